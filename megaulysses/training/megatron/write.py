"""Writing our model as a Megatron-LM checkpoint, at the tensor/pipeline sizes asked.

torch_dist: one process writes the whole tensors as a PyTorch distributed checkpoint
with megatron-core's keys (layers stacked on a leading axis, SwiGLU's fc1 as [gate; up]
of all ranks, which is how megatron-core's sharded_state_dict lays the tensor-parallel
chunks out), the linears' empty `_extra_state` objects, metadata.json, and the common state
(args, iteration, checkpoint_version): inside the DCP files as megatron-core >= 0.19
writes it, or in a common.pt beside them as up to 0.18 (`common_pt`). A torch_dist
checkpoint does not depend on the sizes it was saved at: Megatron-LM loads it at any
tp/pp; the args record the ones asked.

torch (legacy): mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt for each rank, each with
its shards, layer numbers local to its stage, and the same common state; the module
names of Transformer Engine's layers (Megatron-LM's default --transformer-impl) or of the
local spec's (`impl="local"`).
"""

from __future__ import annotations

import io
import json
import os
from typing import Any

import torch

from megaulysses.config import CheckpointError, ModelConfig
from megaulysses.training.megatron.args import CHECKPOINT_VERSION, dumps
from megaulysses.training.megatron.layout import NORM_ALIASES, tp_split
from megaulysses.training.megatron.detect import CONFIG_FILE
from megaulysses.training.megatron.read import COMMON_FILE, COMMON_KEY

LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
           "mlp.linear_fc2")
# What megatron-core's training loop records about how the state dict was built.
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def common_state(args: Any, iteration: int) -> dict:
    return {"args": args, "iteration": iteration, "checkpoint_version": CHECKPOINT_VERSION,
            "num_floating_point_operations_so_far": 0, "content_metadata": CONTENT_METADATA}


def _split_layers(cfg: ModelConfig, pp: int) -> list[range]:
    if cfg.num_layers % pp:
        raise CheckpointError(f"--pipeline-model-parallel-size: {pp} does not divide the "
                              f"model's {cfg.num_layers} layers")
    n = cfg.num_layers // pp
    return [range(p * n, (p + 1) * n) for p in range(pp)]


def check_sizes(cfg: ModelConfig, tp: int, pp: int) -> None:
    """Megatron-LM's own rules for these sizes, before anything is written."""
    rules = ((cfg.num_attention_heads, "attention heads"), (cfg.num_kv_heads, "query groups"),
             (cfg.ffn_size, "MLP width (--ffn-hidden-size)"),
             (cfg.padded_vocab_size, "padded vocabulary rows"))
    for size, what in rules:
        if size % tp:
            raise CheckpointError(f"--tensor-model-parallel-size: {tp} does not divide the "
                                  f"model's {size} {what}")
    _split_layers(cfg, pp)


# -- torch_dist --------------------------------------------------------------------------

def _stacked(cfg: ModelConfig, meg: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Per-layer names -> megatron-core's stacked [L, ...] keys, plus each layer linear's
    (empty) extra state, one ShardedObject a layer; the output layer has none there."""
    out: dict[str, Any] = {}
    per_layer: dict[str, list] = {}
    for name, tensor in meg.items():
        if name.startswith("decoder.layers."):
            i, rest = name[len("decoder.layers."):].split(".", 1)
            per_layer.setdefault(rest, [None] * cfg.num_layers)[int(i)] = tensor
        else:
            out[name] = tensor
    for rest, tensors in per_layer.items():
        out["decoder.layers." + rest] = torch.stack(tensors)
    n = cfg.num_layers
    for linear in LINEARS:
        for k in range(n):
            out[f"decoder.layers.{linear}._extra_state/shard_{k}_{n}"] = dumps([None])
    return out


def _raw_bytes_planner() -> Any:
    """DCP's save planner, but an object entry already serialized (io.BytesIO of a
    torch.save, as megatron-core stores its ShardedObjects) is written as it is."""
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    class RawBytes(DefaultSavePlanner):
        def transform_object(self, write_item: Any, object: Any) -> Any:
            if write_item.type == WriteItemType.BYTE_IO and isinstance(object, io.BytesIO):
                return object
            return super().transform_object(write_item, object)

    return RawBytes()


def write_torch_dist(out: str, cfg: ModelConfig, meg: dict[str, torch.Tensor],
                     common: dict, common_pt: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from megaulysses.training.checkpoint import _quiet
    state = _stacked(cfg, meg)
    if common_pt:
        torch.save(common, os.path.join(out, COMMON_FILE))
    else:
        state[COMMON_KEY] = dumps([common])
    with _quiet():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(out), no_dist=True,
                 planner=_raw_bytes_planner())
    with open(os.path.join(out, CONFIG_FILE), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                   "common_backend": "torch", "common_backend_version": 1}, f)


# -- legacy torch ------------------------------------------------------------------------

def _local_name(name: str, layers: range, impl: str) -> str:
    if not name.startswith("decoder.layers."):
        return name
    i, rest = name[len("decoder.layers."):].split(".", 1)
    if impl == "local":
        for old, new in NORM_ALIASES.items():
            rest = rest.replace(new, old)
    return f"decoder.layers.{int(i) - layers.start}.{rest}"


def _in_stage(name: str, layers: range, first: bool, last: bool) -> bool:
    if name.startswith("decoder.layers."):
        return int(name.split(".")[2]) in layers
    if name.startswith("embedding."):
        return first
    return last  # final norm, output layer


def _stage_model(cfg: ModelConfig, meg: dict, t: int, tp: int, layers: range, first: bool,
                 last: bool, impl: str) -> dict:
    model: dict[str, Any] = {}
    for name, whole in meg.items():
        if _in_stage(name, layers, first, last):
            model[_local_name(name, layers, impl)] = tp_split(cfg, name, whole, tp)[t]
    for i in range(len(layers)):
        for linear in LINEARS:
            model[f"decoder.layers.{i}.{linear}._extra_state"] = None
    if last:
        model["output_layer._extra_state"] = None
        if not cfg.untie_embeddings_and_output_weights and not first:
            # Megatron-LM's last stage holds its own copy of the tied embedding
            word = meg["embedding.word_embeddings.weight"]
            model["output_layer.weight"] = tp_split(cfg, "output_layer.weight", word, tp)[t]
    return model


def write_legacy(out: str, cfg: ModelConfig, meg: dict[str, torch.Tensor], common: dict,
                 tp: int, pp: int, impl: str) -> None:
    stages = _split_layers(cfg, pp)
    for t in range(tp):
        for p, layers in enumerate(stages):
            name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
            os.makedirs(os.path.join(out, name))
            model = _stage_model(cfg, meg, t, tp, layers, p == 0, p == pp - 1, impl)
            torch.save({**common, "model": model},
                       os.path.join(out, name, "model_optim_rng.pt"))


