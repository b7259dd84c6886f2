"""A run never overwrites an earlier run's outputs without saying so.

A run that resumes (its --load holds a checkpoint) continues its files. A run that starts
from scratch refuses, with one line, a --metrics-jsonl that already holds records or a
--save directory that already holds another run's checkpoints: the user resumes, deletes
them, or points the run elsewhere. Every rank checks the same files before any training,
so every rank refuses alike.
"""

from __future__ import annotations

import os
from typing import Optional

from megaulysses.config import CheckpointError, Config, ConfigError

# training.checkpoint (torch.distributed.checkpoint, FSDP) is imported where it is used:
# run.py imports this module, and --dry-run imports run.py without building anything


def check_outputs(cfg: Config) -> None:
    """ConfigError when this run would overwrite an earlier run's metrics or checkpoints."""
    from megaulysses.training import checkpoint as ckpt
    _check_kinds(cfg)
    t = cfg.train
    loaded = ckpt.find_checkpoint(t.load, t.save, t.exit_on_missing_checkpoint) \
        if t.load else None
    resumes_own = (loaded is not None and t.load is not None and t.save is not None
                   and _same(t.load, t.save))
    if loaded is None:
        _check_metrics(cfg.log.metrics_jsonl)
    if t.save and not resumes_own:
        _check_save_dir(t.save, t.load)


def _check_kinds(cfg: Config) -> None:
    """An output path of the wrong kind fails when first written: at the end of training
    for --save. Refuse it before any step."""
    for flag, path in (("--save", cfg.train.save), ("--tensorboard-dir", cfg.log.tensorboard_dir)):
        if path and os.path.exists(path) and not os.path.isdir(path):
            raise ConfigError(flag, f"{path} exists and is not a directory")
    path = cfg.log.metrics_jsonl
    if path and os.path.isdir(path):
        raise ConfigError("--metrics-jsonl", f"{path} is a directory; give a file path")


def _same(a: str, b: str) -> bool:
    return os.path.abspath(a) == os.path.abspath(b)


def _check_metrics(path: Optional[str]):
    if path and os.path.isfile(path) and os.path.getsize(path) > 0:
        raise ConfigError("--metrics-jsonl", f"{path} already holds an earlier run's records "
                          "and this run starts from scratch: resume that run (--load its "
                          "checkpoints), delete the file, or give another path")


def _check_save_dir(save: str, load: Optional[str]):
    if not os.path.isdir(save):
        return
    from megaulysses.training import checkpoint as ckpt
    try:
        theirs = ckpt.find_checkpoint(save, save)
    except CheckpointError:  # nothing loadable there: nothing a save could overwrite
        return
    if theirs is not None:
        how = f"--load {save} to resume it" if load is None else "another --save directory"
        raise ConfigError("--save", f"{save} already holds another run's checkpoints "
                          f"({os.path.basename(theirs)}) that this run would overwrite: "
                          f"pass {how}, or delete them")
