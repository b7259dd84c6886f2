"""What --use-checkpoint-args reads: the model flags of a --load checkpoint, ours
(trainer_state.json's "model") or Megatron-LM's (its `args`), as parser destinations.
config.checkpoint_args merges them into the command line."""

from __future__ import annotations

import logging
from typing import Any, Optional

from megaulysses.config import ModelConfig
from megaulysses.training import checkpoint as ckpt
from megaulysses.config import MASK_FIELDS
from megaulysses.training.load_rules import ROPE_KEYS, saved_mask
from megaulysses.training.megatron.detect import find_iteration_dir

log = logging.getLogger(__name__)

# Shape keys that are no flag of their own (the vocabulary comes from the tokenizer).
NOT_FLAGS = ("vocab_size", "padded_vocab_size")


def fields_of(cfg: ModelConfig) -> dict[str, Any]:
    """{parser destination: value} of the flags that build `cfg`'s shape."""
    shape = cfg.shape_dict()
    out = {k: v for k, v in shape.items() if k not in NOT_FLAGS}
    gqa = cfg.num_kv_heads != cfg.num_attention_heads
    out.update(group_query_attention=gqa, num_query_groups=cfg.num_kv_heads if gqa else None)
    return out


def free_keys(cfg: ModelConfig) -> set[str]:
    """What a run may change at --load (load_rules says why; a mask flag given is logged
    there as a deliberate change of the attention)."""
    rope = set(ROPE_KEYS) if cfg.position_embedding_type == "rope" else set()
    return {"seq_length", "hidden_dropout", "attention_dropout", *MASK_FIELDS} | rope


def model_fields(load: str, save: Optional[str] = None) -> tuple[dict[str, Any], str, set[str]]:
    """(fields, where, free keys) of the checkpoint --load names; no fields where --load
    is the run's own --save and holds nothing yet (logged)."""
    path = ckpt.find_checkpoint(load, save)
    if path is None:
        log.info("--use-checkpoint-args: %s holds no checkpoint yet: the model flags given "
                 "build the model", load)
        return {}, load, set()
    fields, where = _read(path)
    return fields, where, free_keys(ckpt.model_config(fields))


def _read(path: str) -> tuple[dict[str, Any], str]:
    if find_iteration_dir(path) is not None:
        from megaulysses.training.megatron.read import read_model_config
        cfg = read_model_config(path)
        dropout = {k: getattr(cfg, k) for k in ("hidden_dropout", "attention_dropout")}
        return {**fields_of(cfg), **dropout}, f"the Megatron-LM checkpoint {path}"
    meta = ckpt.read_meta(path)
    cfg = ckpt.model_config(meta["model"])
    # a training run's dropout, or the one a Megatron-LM import recorded
    run = meta.get("args", {}).get("model", meta.get("converted_from", {}))
    dropout = {k: run[k] for k in ("hidden_dropout", "attention_dropout") if k in run}
    mask = saved_mask(meta) or {}  # the window and sparsity it was trained or imported with
    return {**fields_of(cfg), **dropout, **mask}, path
