"""The two directions as whole operations: a Megatron-LM checkpoint -> ours, ours -> a
Megatron-LM checkpoint. Both write into the directory given, which the caller stages
(tools/convert_checkpoint.py renames it into place; the trainer removes it after loading)."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from typing import Any, Optional

import torch

from megaulysses.config import CheckpointError
from megaulysses.training.megatron import write
from megaulysses.training.megatron.args import megatron_args
from megaulysses.training.megatron.detect import TRACKER
from megaulysses.training.megatron.layout import to_megatron
from megaulysses.training.megatron.read import (MegatronCheckpoint, find_iteration_dir,
                                                read_megatron)

log = logging.getLogger(__name__)

# Our schedule flags <- Megatron-LM's args of the same names (checkpoint.schedule_meta).
SCHEDULE_KEYS = ("lr", "min_lr", "lr_decay_style", "lr_warmup_iters", "train_samples",
                 "lr_warmup_samples", "lr_decay_samples", "rampup_batch_size", "decoupled_lr",
                 "decoupled_min_lr")


def is_megatron(path: str) -> bool:
    """Whether `path` (a --load) is a Megatron-LM save or iter_* directory."""
    return find_iteration_dir(path) is not None


def _schedule(args: Any) -> dict:
    out = {k: getattr(args, k) for k in SCHEDULE_KEYS if hasattr(args, k)}
    if hasattr(args, "train_iters") or hasattr(args, "lr_decay_iters"):
        out["lr_decay_iters"] = getattr(args, "lr_decay_iters", None) or getattr(
            args, "train_iters", None)
    return out


RUN_SETTINGS = ("hidden_dropout", "attention_dropout", "init_method_std")


def origin(ckpt: MegatronCheckpoint) -> dict:
    """trainer_state.json's "converted_from" for an imported Megatron-LM checkpoint."""
    args = ckpt.common["args"]
    return {"megatron_dir": os.path.abspath(ckpt.path), "format": ckpt.fmt,
            "dtype": ckpt.source_dtype, "vocab_size_known": ckpt.vocab_known,
            "tensor_model_parallel_size": getattr(args, "tensor_model_parallel_size", 1),
            "pipeline_model_parallel_size": getattr(args, "pipeline_model_parallel_size", 1),
            # the run's settings --use-checkpoint-args and to-hf carry (no weight's shape)
            **{k: getattr(ckpt.cfg, k) for k in RUN_SETTINGS},
            # its attention mask (load_rules checks a run against it): dense, this window
            "window_size": ckpt.cfg.window_size}


def imported_meta(ckpt: MegatronCheckpoint) -> dict:
    """trainer_state.json's entries for an imported Megatron-LM checkpoint (the model's
    shape aside): where the run stood, its LR schedule, where it came from."""
    args = ckpt.common["args"]
    return {"iteration": int(ckpt.common.get("iteration", 0) or 0),
            "consumed_train_samples": int(getattr(args, "consumed_train_samples", 0) or 0),
            "lr_schedule": _schedule(args), "converted_from": origin(ckpt)}


def import_megatron(path: str, save_dir: str) -> tuple[MegatronCheckpoint, str]:
    """Read `path`, write our committed checkpoint into `save_dir`; (what was read, the
    checkpoint directory written)."""
    from megaulysses.training.saver import write_model_checkpoint
    ckpt = read_megatron(path)
    extra = imported_meta(ckpt)
    done = write_model_checkpoint(save_dir, ckpt.state, ckpt.cfg.shape_dict(),
                                  iteration=extra.pop("iteration"), extra=extra)
    return ckpt, done


def not_carried(ckpt: MegatronCheckpoint) -> str:
    """The one line saying what the import leaves behind."""
    parts = ["the optimizer's state (Adam moments and fp32 main weights: the optimizer "
             "starts fresh)" if "optimizer" in ckpt.holds
             else "no optimizer state (the source holds none: the optimizer starts fresh)"]
    if "rng_state" in ckpt.holds:
        parts.append("RNG states")
    if not ckpt.vocab_known:
        parts.append("the tokenizer's own vocabulary size (Megatron-LM records the padded "
                     "size only: any tokenizer that pads to it loads)")
    return "not carried: " + "; ".join(parts)


def import_for_run(path: str, save: Optional[str], rank: int, comm: Any) -> str:
    """--load of a Megatron-LM checkpoint: rank 0 converts it into a directory every rank
    reads (inside --save, else the temporary directory), then every rank has its path,
    or every rank raises rank 0's one-line error (no rank waits on a failed one)."""
    work = os.path.join(save or tempfile.gettempdir(),
                        ".megatron_import_" + os.path.basename(os.path.normpath(path)))
    failure, done = None, None
    if rank == 0:
        shutil.rmtree(work, ignore_errors=True)  # an earlier run's, cut short
        try:
            ckpt, done = import_megatron(path, work)
            log.info("--load %s: a Megatron-LM %s checkpoint (%s, iteration %s), converted "
                     "on the fly into %s; %s", path, ckpt.fmt, ckpt.source_dtype,
                     ckpt.common.get("iteration"), work, not_carried(ckpt))
        except (CheckpointError, OSError) as e:
            shutil.rmtree(work, ignore_errors=True)
            failure = str(e) if isinstance(e, CheckpointError) else f"--load: {path}: {e}"
    failure = comm.first_of_any_rank(failure)
    if failure is not None:
        raise CheckpointError(failure)
    return done or os.path.join(work, f"iter_{_iteration(work):07d}")


def _iteration(work: str) -> int:
    with open(os.path.join(work, TRACKER)) as f:
        return int(f.read().strip())


def remove_import(done: str, rank: int, comm: Any) -> None:
    """After every rank loaded it: the converted copy goes."""
    comm.barrier()
    if rank == 0:
        shutil.rmtree(os.path.dirname(done), ignore_errors=True)


# -- ours -> Megatron-LM ---------------------------------------------------------------------

def _run_args(meta: dict) -> dict:
    flat: dict = {}
    for section in meta.get("args", {}).values():
        if isinstance(section, dict):
            flat.update(section)
    return flat


def _megatron_mask(meta: dict) -> dict:
    """The checkpoint's window as a ModelConfig field (megatron_args writes Megatron-LM's
    pair); a block-sparse layout has no Megatron-LM equivalent."""
    from megaulysses.training.load_rules import saved_mask
    mask = saved_mask(meta) or {}
    sparsity = mask.get("attention_sparsity") or "dense"
    if sparsity != "dense":
        raise CheckpointError(f"--attention-sparsity {sparsity}: Megatron-LM has no "
                              "block-sparse attention to export it to")
    return {"window_size": mask.get("window_size")}


def export_megatron(meta: dict, state: dict[str, torch.Tensor], out: str, fmt: str, tp: int,
                    pp: int, common_pt: bool = False, impl: str = "transformer_engine",
                    dtype: str = "float32") -> tuple[str, Any]:
    """Our whole-model `state` (trainer_state `meta`) -> a Megatron-LM save directory in
    `out` (tracker + iter_* or release/); returns the iteration directory and the args
    written."""
    from megaulysses.training.checkpoint import model_config
    run = _run_args(meta) or meta.get("converted_from", {})  # dropout and init, if known
    cfg = model_config({**meta["model"], **{k: run[k] for k in RUN_SETTINGS if k in run},
                        **_megatron_mask(meta)})
    write.check_sizes(cfg, tp, pp)
    meg = {k: v.to(getattr(torch, dtype)).contiguous() for k, v in
           to_megatron(cfg, state).items()}
    args = megatron_args(cfg, tp, pp, _run_args(meta), dtype)
    iteration = int(meta.get("iteration", 0))
    args.ckpt_format, args.transformer_impl = fmt, impl
    args.consumed_train_samples = int(meta.get("consumed_train_samples", 0))
    args.iteration = iteration
    common = write.common_state(args, iteration)
    # A model-only checkpoint at iteration 0 is what Megatron-LM calls a release: it loads
    # it without optimizer and RNG state and starts at iteration 0.
    name = "release" if iteration == 0 else f"iter_{iteration:07d}"
    iter_dir = os.path.join(out, name)
    os.makedirs(iter_dir)
    if fmt == "torch_dist":
        write.write_torch_dist(iter_dir, cfg, meg, common, common_pt)
    elif fmt == "torch":
        write.write_legacy(iter_dir, cfg, meg, common, tp, pp, impl)
    else:
        raise CheckpointError(f"--ckpt-format: {fmt!r} is not written here (torch_dist or "
                              "torch)")
    with open(os.path.join(out, TRACKER), "w") as f:
        f.write("release" if iteration == 0 else str(iteration))
    return iter_dir, args


def load_flags(iter_dir: str) -> Optional[str]:
    """The Megatron-LM flags a continued run needs for an exported checkpoint."""
    if os.path.basename(iter_dir) == "release":
        return None
    return "--no-load-optim --no-load-rng"
