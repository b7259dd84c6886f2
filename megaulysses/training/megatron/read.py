"""Reading a Megatron-LM checkpoint directory, either format, any tensor/pipeline sizes.

    <save>/latest_checkpointed_iteration.txt    "10" (or "release")
    <save>/iter_0000010/                        (or release/)
        torch_dist: .metadata, __R_K.distcp, metadata.json, and up to megatron-core 0.18 a
                    common.pt (args, iteration, ...); from 0.19 that common state is a
                    ShardedObject "common_state" inside the DCP files. Layers are stacked
                    on a leading axis ("decoder.layers.<name>" of shape [L, ...]), tensors
                    are whole (DCP merges the ranks' chunks).
        torch:      mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt, each a pickled dict of
                    one rank's shards: "model" (layer numbers local to its stage), "args",
                    "iteration", "checkpoint_version", optionally the optimizer's.

No megatron import: DCP and a tolerant unpickler (args.load_pickle) read everything.
"""

from __future__ import annotations

import io
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from megaulysses.config import CheckpointError, ModelConfig
from megaulysses.training.megatron import args as margs
from megaulysses.training.megatron.detect import (CONFIG_FILE, RANK_DIR, TRACKER,
                                                  checkpoint_format, find_iteration_dir)
from megaulysses.training.megatron.layout import (NORM_ALIASES, check_shapes, from_megatron,
                                                  megatron_names, tp_merge)

COMMON_FILE = "common.pt"
COMMON_KEY = "common_state/shard_0_1"  # megatron-core >= 0.19: ShardedObject("common_state")
LEGACY_FILE = "model_optim_rng.pt"
# Tensors under these prefixes are the model's; everything else (optimizer, RNG) is not.
MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.", "encoder.", "lm_head.",
                  "binary_head.", "pooler.")
# Names of models we do not build, found among the tensors: what to call them.
FOREIGN = (("encoder.", "an encoder (a T5 or BERT model)"),
           ("lm_head.", "a BERT model"), ("binary_head.", "a BERT model"),
           (".experts.", "mixture of experts"), (".router.", "mixture of experts"),
           (".mixer.", "a Mamba model"), ("inter_attention", "a T5 decoder"))


@dataclass
class MegatronCheckpoint:
    """What a Megatron-LM checkpoint holds, converted: our model and its run's state."""

    path: str  # the iter_* (or release) directory
    fmt: str  # "torch_dist" or "torch"
    cfg: ModelConfig
    vocab_known: bool
    state: dict[str, torch.Tensor]  # ours, whole tensors, fp32
    common: dict[str, Any] = field(default_factory=dict)  # args, iteration, scheduler
    source_dtype: str = "float32"
    grid: dict[str, int] = field(default_factory=dict)  # tp, pp of a legacy save
    holds: set[str] = field(default_factory=set)  # "optimizer", "rng": what it saved beside


# -- torch_dist --------------------------------------------------------------------------

def _dist_metadata(path: str) -> Any:
    from torch.distributed.checkpoint import FileSystemReader
    try:
        with open(os.path.join(path, CONFIG_FILE)) as f:
            backend = json.load(f).get("sharded_backend")
        if backend != "torch_dist":
            raise CheckpointError(f"{os.path.join(path, CONFIG_FILE)}: sharded_backend "
                                  f"{backend!r} is not read here (only torch_dist)")
        return FileSystemReader(path).read_metadata()
    except (OSError, ValueError, EOFError, RuntimeError) as e:
        raise CheckpointError(f"{path}: unreadable torch_dist checkpoint ({e})") from e


def _raw_bytes_planner() -> Any:
    """DCP's load planner, but an object entry (megatron-core's ShardedObjects: the common
    state, extra states) stays the bytes it is: megatron-core wrote them with torch.save
    itself, and DCP's own torch.load would need megatron's classes importable."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class RawBytes(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            target = self.state_dict[read_item.dest_index.fqn]  # the caller's BytesIO
            target.write(value.read())
            target.seek(0)

    return RawBytes(flatten_state_dict=False)


def _dist_load(path: str, state: dict) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from megaulysses.training.checkpoint import _quiet, _root_cause
    try:
        with _quiet():
            dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=True,
                     planner=_raw_bytes_planner())
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"{path}: corrupt or incomplete torch_dist checkpoint "
                              f"({_root_cause(e)})") from e


def _dist_common(path: str, metadata: Any) -> dict:
    common = os.path.join(path, COMMON_FILE)
    if os.path.exists(common):
        return margs.load_pickle(common, common)
    if COMMON_KEY not in metadata.state_dict_metadata:
        raise CheckpointError(f"{path}: no {COMMON_FILE} and no common_state inside: not a "
                              "Megatron-LM checkpoint (its args are missing)")
    state = {COMMON_KEY: io.BytesIO()}
    _dist_load(path, state)
    buf = state[COMMON_KEY]
    return margs.load_pickle(buf, f"{path} (common_state)")[0]


def _unstack(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """"decoder.layers.<x>" [L, ...] -> "decoder.layers.<i>.<x>" for each layer."""
    prefix = "decoder.layers."
    if not name.startswith(prefix) or name[len(prefix)].isdigit():
        return {name: tensor}
    rest = name[len(prefix):]
    return {f"{prefix}{i}.{rest}": t for i, t in enumerate(tensor.unbind(0))}


def read_torch_dist(path: str) -> tuple[dict, dict, str]:
    """(common state, Megatron tensors by per-layer name, stored dtype). The common state's
    "holds" lists the non-model parts the checkpoint has (optimizer, rng)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    metadata = _dist_metadata(path)
    common = dict(_dist_common(path, metadata))
    keys = metadata.state_dict_metadata
    common["holds"] = {part for part in ("optimizer", "rng_state")
                       if any(k.startswith(part) for k in keys)}
    wanted = {k: torch.empty(m.size, dtype=m.properties.dtype)
              for k, m in metadata.state_dict_metadata.items()
              if isinstance(m, TensorStorageMetadata) and k.startswith(MODEL_PREFIXES)}
    if not wanted:
        raise CheckpointError(f"{path}: holds no model tensors (embedding.*, decoder.*)")
    _dist_load(path, wanted)
    dtype = str(next(iter(wanted.values())).dtype).replace("torch.", "")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in wanted.items():
        out.update(_unstack(name, tensor))
    return common, out, dtype


# -- legacy torch ------------------------------------------------------------------------

def _rank_files(path: str) -> tuple[dict[tuple[int, int], str], int, int]:
    ranks = {}
    for name in os.listdir(path):
        m = RANK_DIR.match(name)
        if m:
            ranks[(int(m.group(1)), int(m.group(2) or 0))] = os.path.join(path, name,
                                                                          LEGACY_FILE)
    tp = 1 + max(t for t, _ in ranks)
    pp = 1 + max(p for _, p in ranks)
    for t in range(tp):
        for p in range(pp):
            name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
            if (t, p) not in ranks or not os.path.isfile(ranks[(t, p)]):
                raise CheckpointError(f"{os.path.join(path, name, LEGACY_FILE)}: missing "
                                      f"(a tensor/pipeline rank file of a tp {tp} x pp {pp} "
                                      "save)")
    return ranks, tp, pp


def _normalize(key: str) -> Optional[str]:
    """A legacy key under torch_dist's names; None for what is not a weight."""
    if key.endswith("_extra_state"):
        return None
    for old, new in NORM_ALIASES.items():
        key = key.replace("." + old, "." + new)
    return key


def _stage_state(sd: dict, file: str, offset: int) -> tuple[dict, int]:
    """One stage file's model tensors with global layer numbers; its layer count."""
    if "model" not in sd:
        extra = " (virtual pipeline stages: model0, model1, ...)" if "model0" in sd else ""
        raise CheckpointError(f"{file}: no 'model' entry{extra}: not read here")
    out, layers = {}, set()
    for key, value in sd["model"].items():
        name = _normalize(key)
        if name is None or not torch.is_tensor(value):
            continue
        m = re.match(r"^decoder\.layers\.(\d+)\.(.*)$", name)
        if m:
            layers.add(int(m.group(1)))
            name = f"decoder.layers.{int(m.group(1)) + offset}.{m.group(2)}"
        out[name] = value
    return out, len(layers)


def read_legacy(path: str) -> tuple[dict, dict, str, dict]:
    """(common state, whole Megatron tensors, stored dtype, {"tp", "pp"})."""
    ranks, tp, pp = _rank_files(path)
    shards: dict[str, list] = {}
    common: dict = {}
    for t in range(tp):
        offset = 0
        for p in range(pp):
            sd = margs.load_pickle(ranks[(t, p)], ranks[(t, p)])
            stage, count = _stage_state(sd, ranks[(t, p)], offset)
            offset += count
            if not common:
                common = {k: v for k, v in sd.items() if k not in ("model", "optimizer")}
                common["holds"] = {k for k in ("optimizer", "rng_state") if sd.get(k)}
            for name, tensor in stage.items():
                if p < pp - 1 or name != "output_layer.weight" or _untied(common):
                    shards.setdefault(name, [None] * tp)[t] = tensor
    for name, parts in shards.items():
        if any(p is None for p in parts):
            t = parts.index(None)
            raise CheckpointError(f"{os.path.join(path, f'mp_rank_{t:02d}')}*: tensor {name} "
                                  "is missing from this tensor-parallel rank's files")
    dtype = str(next(iter(shards.values()))[0].dtype).replace("torch.", "")
    return common, shards, dtype, {"tp": tp, "pp": pp}


def _untied(common: dict) -> bool:
    return bool(getattr(common.get("args"), "untie_embeddings_and_output_weights", False))


# -- either ------------------------------------------------------------------------------

def _check_foreign(found: set, path: str) -> None:
    for part, what in FOREIGN:
        name = next((n for n in sorted(found) if part in n), None)
        if name is not None:
            raise CheckpointError(f"{path}: tensor {name}: {what} is not an architecture "
                                  "this framework builds (a dense GPT only)")


def _check_names(cfg: ModelConfig, found: set, path: str) -> None:
    want = set(megatron_names(cfg))
    missing, extra = sorted(want - found), sorted(found - want)
    if missing:
        raise CheckpointError(f"{path}: tensor {missing[0]} is missing ({len(missing)} of "
                              f"{len(want)} missing) for the model its args describe")
    if extra:
        raise CheckpointError(f"{path}: tensor {extra[0]} is not part of a model this "
                              "framework builds (its args describe a dense GPT)")


def read_megatron(path: str) -> MegatronCheckpoint:
    """A Megatron-LM save directory or iter_* directory -> our model and its state."""
    iter_dir = find_iteration_dir(path)
    if iter_dir is None:
        raise CheckpointError(f"{path}: not a Megatron-LM checkpoint (no {TRACKER} naming "
                              f"an iter_* directory with {CONFIG_FILE} or mp_rank_*)")
    fmt = checkpoint_format(iter_dir)
    if fmt is None:
        raise CheckpointError(f"{iter_dir}: neither {CONFIG_FILE} (torch_dist) nor mp_rank_* "
                              "directories (legacy torch): not a Megatron-LM checkpoint")
    grid: dict[str, int] = {}
    if fmt == "torch_dist":
        common, whole, dtype = read_torch_dist(iter_dir)
    else:
        common, shards, dtype, grid = read_legacy(iter_dir)
    args = common.get("args")
    if args is None:
        raise CheckpointError(f"{iter_dir}: no 'args' in the checkpoint (saved without "
                              "Megatron-LM's training loop?): the model's shape is unknown")
    version = common.get("checkpoint_version", 0) or 0
    if version < 2.0:
        raise CheckpointError(f"{iter_dir}: checkpoint_version {version}: the pre-2.0 qkv "
                              "ordering is not read here (re-save with Megatron-LM first)")
    names = set(whole) if fmt == "torch_dist" else set(shards)
    _check_foreign(names, iter_dir)
    padded = _padded_vocab(whole if fmt == "torch_dist" else shards)
    cfg, known = margs.model_config(args, iter_dir, padded)
    _check_names(cfg, names, iter_dir)
    if fmt == "torch":
        whole = {n: tp_merge(cfg, n, s) for n, s in shards.items()}
    check_shapes(cfg, whole, lambda name: iter_dir)
    state = {k: v.float() for k, v in from_megatron(cfg, whole).items()}
    return MegatronCheckpoint(iter_dir, fmt, cfg, known, state, common, dtype, grid,
                              common.pop("holds", set()))


def read_common(iter_dir: str) -> dict:
    """The common state alone (args, iteration): no tensor is read but a legacy rank 0's."""
    if checkpoint_format(iter_dir) == "torch_dist":
        return _dist_common(iter_dir, _dist_metadata(iter_dir))
    ranks, _, _ = _rank_files(iter_dir)
    return margs.load_pickle(ranks[(0, 0)], ranks[(0, 0)])


def read_model_config(iter_dir: str) -> ModelConfig:
    """The model a Megatron-LM checkpoint's args describe (for --use-checkpoint-args)."""
    args = read_common(iter_dir).get("args")
    if args is None or not getattr(args, "padded_vocab_size", None):
        raise CheckpointError(f"{iter_dir}: no args with padded_vocab_size in the checkpoint")
    return margs.model_config(args, iter_dir, int(args.padded_vocab_size))[0]


def _padded_vocab(tensors: dict) -> int:
    emb = tensors.get("embedding.word_embeddings.weight")
    if emb is None:
        raise CheckpointError("embedding.word_embeddings.weight is missing")
    if isinstance(emb, list):
        return sum(int(t.shape[0]) for t in emb)
    return int(emb.shape[0])
