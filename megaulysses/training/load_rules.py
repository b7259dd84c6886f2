"""What a checkpoint must agree on to be loaded, and what may change at --load.

The weights are meaningless under another shape, vocabulary or tokenizer: those are
errors (exit 2). What no weight depends on may change, and a change is logged once:

- `--seq-length` (the data's length) and the vocabulary padding keys (checked apart);
- for RoPE models, the positions themselves: `--max-position-embeddings`, `--rotary-base`
  and the RoPE scalings (llama3, linear, YaRN). Rotary tables are computed from these, not
  stored, so raising the base or the scaling at `--load` is the standard context-extension
  recipe (continue a 8K model at 64K with a larger theta). The new checkpoint records the
  new values (it saves this run's ModelConfig.shape_dict()).

A key missing from an older checkpoint's "model" entry has the value ModelConfig's field
default had when that checkpoint was written: the defaults of shape fields never change.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

from megaulysses.config import CheckpointError, ModelConfig

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


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


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
