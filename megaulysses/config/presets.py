"""Named presets: settings a run takes in place of the flags' defaults, except where the
user passed the flag.

The flags' defaults are Megatron-LM's (schema.py), so a Megatron-LM script means here what
it means there. The bundled run is different on purpose: `python pretrain_gpt.py` with no
data source trains a small Llama-style model on the Shakespeare corpus in data/, and those
settings are the preset SHAKESPEARE, applied when neither --data-path nor --mock-data is
given, and printed at start with the flags that overrode it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterable, Optional

from megaulysses.config.schema import BUNDLED_DATA, Config, _relative

# section -> field -> value: what differs from the defaults in the bundled run.
SHAKESPEARE: dict[str, dict[str, Any]] = {
    "model": dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                  add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0),
    "data": dict(data_path=[BUNDLED_DATA]),
    "train": dict(global_batch_size=16, lr_decay_style="cosine", lr_warmup_fraction=0.1,
                  min_lr=2e-4, weight_decay=0.1, adam_beta2=0.95, eval_interval=50,
                  eval_iters=5),
    "log": dict(log_interval=10),
}
PRESETS = {"shakespeare": SHAKESPEARE}

# Fields the preset leaves alone when the user set a related one: an explicit warm-up in
# iterations replaces the preset's fraction (the two cannot be combined), and a learning
# rate of one's own decays to the default --min-lr 0 (the preset's could exceed it).
YIELDS_TO = {"lr_warmup_fraction": ("lr_warmup_iters", "lr_warmup_samples"),
             "min_lr": ("lr",)}

DATA_SOURCES = ("data_path", "mock_data")


def preset_for(given: Iterable[str]) -> Optional[str]:
    """The preset a command line gets: "shakespeare" without a data source, else none."""
    return None if set(DATA_SOURCES) & set(given) else "shakespeare"


def apply_preset(cfg: Config, name: str, given: Iterable[str]) -> Config:
    """`cfg` with preset `name`'s values for every field the user did not set (`given`:
    the parser destinations the command line set)."""
    given = set(given)
    sections = {}
    for section, values in PRESETS[name].items():
        keep = {k: v for k, v in values.items()
                if k not in given and not given & set(YIELDS_TO.get(k, ()))}
        sections[section] = replace(getattr(cfg, section), **keep)
    return replace(cfg, preset=name, **sections)


def preset_lines(cfg: Config) -> list[str]:
    """What the log says about the preset: its name, and its values the flags overrode."""
    if cfg.preset is None:
        return []
    overridden = [f"{k}={getattr(getattr(cfg, section), k)}"
                  for section, values in PRESETS[cfg.preset].items()
                  for k, v in values.items() if getattr(getattr(cfg, section), k) != v]
    text = (f"no --data-path or --mock-data: the bundled '{cfg.preset}' preset "
            f"(megaulysses/config/presets.py: {_spell(PRESETS[cfg.preset])})")
    if overridden:
        text += f"; the flags given make it {', '.join(overridden)}"
    return [text]


def _spell(preset: dict[str, dict[str, Any]]) -> str:
    return ", ".join(f"{k}={_relative(v[0]) if k == 'data_path' else v}"
                     for values in preset.values() for k, v in values.items())
