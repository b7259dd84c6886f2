"""What a checkpoint must agree on to be loaded, and what may change at --load.

The weights are meaningless under another shape, vocabulary or tokenizer: those are
errors (exit 2). What no weight depends on may change, and a change is logged once:

- `--seq-length` (the data's length) and the vocabulary padding keys (checked apart);
- for RoPE models, the positions themselves: `--max-position-embeddings`, `--rotary-base`
  and the RoPE scalings (llama3, linear, YaRN). Rotary tables are computed from these, not
  stored, so raising the base or the scaling at `--load` is the standard context-extension
  recipe (continue a 8K model at 64K with a larger theta). The new checkpoint records the
  new values (it saves this run's ModelConfig.shape_dict()).

The attention mask (`--window-size`, `--attention-sparsity` and its block settings) is no
weight's shape, but it is part of the model's function: a model trained or imported with a
window is another function under full causal attention. A checkpoint records it (a run's
flags in "args", an import's window in "converted_from"); check_mask compares it with the
run's (mask_of). A mask left at its default where the checkpoint has another is an error
(a forgotten flag would train another model silently); one given explicitly is logged (a
deliberate change, e.g. a longer window); one that attends alike at this --seq-length (a
window of --seq-length tokens or more is full causal) is logged too.

A key missing from an older checkpoint's "model" entry has the value ModelConfig's field
default had when that checkpoint was written: the defaults of shape fields never change.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

from megaulysses.config import CheckpointError, ModelConfig
from megaulysses.config.schema import MASK_FIELDS

log = logging.getLogger(__name__)

VOCAB_KEYS = ("vocab_size", "padded_vocab_size", "make_vocab_size_divisible_by")
# Shape keys older checkpoints lack whose value then was not today's field default.
SHAPE_ADDED_LATER = {"apply_layernorm_1p": False}
# RoPE settings: free to change at --load (context extension), logged when they do.
ROPE_KEYS = ("max_position_embeddings", "rotary_base", "use_rope_scaling",
             "rope_scaling_factor", "rope_scaling_low_freq_factor",
             "rope_scaling_high_freq_factor", "original_max_position_embeddings",
             "rotary_seq_len_interpolation_factor", "rope_type", "rotary_scaling_factor",
             "yarn_beta_fast", "yarn_beta_slow", "mscale", "mscale_all_dim")


def _field_defaults() -> dict:
    return {f.name: f.default for f in dataclasses.fields(ModelConfig)
            if f.default is not dataclasses.MISSING}


# Shape keys whose flag is not "--" + the key
FLAG_OF_KEY = {"bias_gelu_fusion": "the tanh GeLU of --bias-gelu-fusion (off: "
                                   "--no-bias-gelu-fusion or --disable-bias-linear)"}


def _flag(key: str) -> str:
    return FLAG_OF_KEY.get(key, "--" + key.replace("_", "-"))


def mask_of(cfg: ModelConfig) -> dict:
    """The run's attention mask settings, as a checkpoint records them."""
    return {k: getattr(cfg, k) for k in MASK_FIELDS}


def saved_mask(saved: dict) -> Optional[dict]:
    """The mask a checkpoint was trained with (a run's flags) or imported with (from-hf's
    window); None where it is not known (a Megatron-LM import, older conversions)."""
    defaults = _field_defaults()
    run = saved.get("args", {}).get("model")
    if run is not None:
        return {k: run.get(k, defaults[k]) for k in MASK_FIELDS}
    origin = saved.get("converted_from", {})
    if "window_size" in origin:  # a Hugging Face model: dense, perhaps a sliding window
        return {**{k: defaults[k] for k in MASK_FIELDS}, "window_size": origin["window_size"]}
    return None


def _mask_keys(mask: dict) -> tuple:
    """The settings the mask depends on: the block settings only under their layout."""
    kind = mask["attention_sparsity"]
    blocks = {"dense": (), "fixed": ("sparse_block_size", "sparse_local_blocks",
                                     "sparse_global_blocks")}.get(kind, MASK_FIELDS[2:])
    return ("window_size", "attention_sparsity", *blocks)


def _effective(mask: dict, seq_length: int) -> dict:
    """What the mask attends at this length: a window of seq_length or more is none."""
    window = mask["window_size"]
    out = {k: mask[k] for k in _mask_keys(mask)}
    out["window_size"] = None if window is None or window >= seq_length else window
    return out


def _flags(mask: dict, keys) -> str:
    return " ".join(f"{_flag(k)} {'none' if mask[k] is None else mask[k]}" for k in keys)


def check_mask(path: str, saved: dict, now: dict, seq_length: int) -> None:
    """Error (exit 2, naming the flag) where this run would attend otherwise than the
    checkpoint's model with a mask flag left at its default; logged where it was given."""
    was = saved_mask(saved)
    if was is None:
        return
    keys = [k for k in _mask_keys(was) if was[k] != now[k]]  # what rebuilds the saved mask
    if not keys:  # at most settings of a layout neither uses differ
        return
    if _effective(was, seq_length) == _effective(now, seq_length):
        log.warning("%s was trained with %s; this run has %s, which attends alike at "
                    "--seq-length %d (the checkpoints it saves record it)", path,
                    _flags(was, keys), _flags(now, keys), seq_length)
        return
    defaults = _field_defaults()
    silent = [k for k in keys if now[k] == defaults[k]]
    if silent:
        hint = (f"; to drop the window on purpose, --window-size {seq_length} (full causal at "
                f"--seq-length {seq_length})" if silent == ["window_size"] else "")
        raise CheckpointError(
            f"{_flag(silent[0])}: {path} was trained with {_flags(was, keys)} but this run "
            f"has {_flags(now, keys)}, another attention mask: pass {_flags(was, keys)} "
            f"(or --use-checkpoint-args){hint}")
    log.warning("%s was trained with %s; this run attends with %s (given: a different "
                "attention mask from here on, recorded in the checkpoints it saves)", path,
                _flags(was, keys), _flags(now, keys))


def check_meta(path: str, saved: dict, expect: dict) -> None:
    """Errors (exit 2) for what makes the weights meaningless here: model shape,
    vocabulary, tokenizer. `expect`: {"model": shape_dict, "tokenizer": {...}}. Logs the
    position settings this run changes (context extension)."""
    shape = saved.get("model", {})
    saved_value = {**_field_defaults(), **SHAPE_ADDED_LATER, **shape}.get
    free = set(VOCAB_KEYS) | {"seq_length"}  # the data's length: no weight depends on it
    rope = expect["model"].get("position_embedding_type") == "rope"
    if rope:
        free |= set(ROPE_KEYS)  # rotary tables are computed, not stored
    differ = [(_flag(key), saved_value(key), value) for key, value in expect["model"].items()
              if key not in free and saved_value(key) != value]
    if len(differ) == 1:  # the usual case: one flag changed
        flag, old, new = differ[0]
        raise CheckpointError(f"--load: {path} was saved with {flag}={old} but this run "
                              f"has {new}")
    if differ:  # one changed switch moves derived sizes too: name them all
        raise CheckpointError(
            f"--load: {path} was saved with {', '.join(f'{f}={o}' for f, o, _ in differ)} "
            f"but this run has {', '.join(f'{f}={n}' for f, _, n in differ)}")
    # A Megatron-LM import records the padded vocabulary only (not its tokenizer's size)
    known = saved.get("converted_from", {}).get("vocab_size_known", True)
    _check_vocab(path, shape, saved.get("tokenizer"), expect, known)
    if "mask" in expect:
        check_mask(path, saved, expect["mask"], expect["model"]["seq_length"])
    if rope:
        log_position_changes(path, saved_value, expect["model"])


def position_changes(saved_value, now: dict) -> list[tuple[str, object, object]]:
    """(flag, saved, now) of the positions settings (ROPE_KEYS, --seq-length) that differ."""
    return [(_flag(key), saved_value(key), now[key]) for key in ("seq_length", *ROPE_KEYS)
            if key in now and saved_value(key) != now[key]]


def log_position_changes(path: str, saved_value, now: dict) -> None:
    changes = position_changes(saved_value, now)
    if changes:
        log.info("context extension: %s was saved with %s; this run trains with %s "
                 "(recorded in the checkpoints it saves)", path,
                 ", ".join(f"{f} {old}" for f, old, _ in changes),
                 ", ".join(f"{f} {new}" for f, _, new in changes))


def _check_vocab(path: str, shape: dict, saved_tok: Optional[dict], expect: dict,
                 known: bool = True) -> None:
    want, tok = expect["model"], expect.get("tokenizer") or {}
    where = tok.get("flag", "the tokenizer")
    if known and shape.get("vocab_size") != want["vocab_size"]:
        raise CheckpointError(f"--load: {path} was saved with a vocabulary of "
                              f"{shape.get('vocab_size')} tokens but {where} has "
                              f"{want['vocab_size']}")
    if shape.get("padded_vocab_size") != want["padded_vocab_size"]:
        raise CheckpointError(f"--load: {path} was saved with --make-vocab-size-divisible-by="
                              f"{shape.get('make_vocab_size_divisible_by')} (padded vocabulary "
                              f"{shape.get('padded_vocab_size')}) but this run pads to "
                              f"{want['padded_vocab_size']}")
    if saved_tok and tok.get("sha256") and saved_tok.get("sha256") != tok["sha256"]:
        raise CheckpointError(f"--load: {path} was trained with another tokenizer than "
                              f"{where} (same size, different vocabulary: sha256 "
                              f"{saved_tok['sha256'][:12]} vs {tok['sha256'][:12]})")
