"""Checkpoints: DCP for model and optimizer, JSON for trainer state, atomic commit.

Layout of `--save DIR`:
    DIR/iter_0000100/            one committed checkpoint
        .metadata, *.distcp      torch.distributed.checkpoint (model + optimizer)
        trainer_state.json       iteration, consumed samples, loss scaler, model shape
        rng_rank00000.pt         python / numpy / torch (/ cuda) RNG states of each rank
    DIR/latest_checkpointed_iteration.txt   "100" (Megatron's name for the marker)

A checkpoint is written to DIR/.tmp_iter_0000100 and renamed into place only when
complete; the marker is replaced atomically after that. A crash mid-save leaves the
previous checkpoint and marker untouched.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)

from megaulysses.config import CheckpointError  # noqa: F401 (raised here, caught by the CLI)

log = logging.getLogger(__name__)

MARKER = "latest_checkpointed_iteration.txt"
# Optimizer state keyed per parameter name ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr"):
# pipeline stages hold different parameters, so a nested per-rank list of param groups
# would not survive DCP's de-duplication; flat keys also load on any other grid.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
STATE_FILE = "trainer_state.json"


@dataclass
class TrainState:
    iteration: int = 0
    consumed_train_samples: int = 0
    skipped_iterations: int = 0
    loss_scaler: dict = field(default_factory=dict)


def iteration_dir(save_dir: str, iteration: int) -> str:
    return os.path.join(save_dir, f"iter_{iteration:07d}")


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _write_json(path: str, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(save_dir: str, model, optimizer, state: TrainState, model_shape: dict,
                    rank: int = 0, barrier=lambda: None):
    """Every rank calls this; `barrier` synchronizes them (a no-op on one process)."""
    final = iteration_dir(save_dir, state.iteration)
    tmp = os.path.join(save_dir, ".tmp_" + os.path.basename(final))
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # debris of an earlier interrupted save
        os.makedirs(tmp)
    barrier()  # the directory exists before anybody writes into it
    model_sd, optim_sd = _state_dicts(model, optimizer)
    with warnings.catch_warnings():  # single process: DCP warns that it runs without a group
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
    torch.save(_rng_state(), os.path.join(tmp, f"rng_rank{rank:05d}.pt"))
    barrier()  # every rank's files are in place before the commit
    if rank == 0:
        _write_json(os.path.join(tmp, STATE_FILE),
                    {"iteration": state.iteration,
                     "consumed_train_samples": state.consumed_train_samples,
                     "skipped_iterations": state.skipped_iterations,
                     "loss_scaler": state.loss_scaler, "model": model_shape})
        if os.path.exists(final):  # re-saving the same iteration: replace it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        with open(os.path.join(save_dir, MARKER + ".tmp"), "w") as f:
            f.write(str(state.iteration))
        os.replace(os.path.join(save_dir, MARKER + ".tmp"), os.path.join(save_dir, MARKER))
    barrier()  # nobody runs ahead (and, e.g., exits) before the commit
    log.info("saved checkpoint %s", final)


def _state_dicts(model, optimizer) -> tuple[dict, dict]:
    """Model and optimizer state, keyed by parameter name, as DTensors where sharded. The
    ZeRO-1 optimizer gives its own (same keys and global shapes as torch's)."""
    model_sd = get_model_state_dict(model, options=OPTIONS)
    if hasattr(optimizer, "dcp_state_dict"):
        return model_sd, optimizer.dcp_state_dict(_names(model))
    return model_sd, get_optimizer_state_dict(model, optimizer, options=OPTIONS)


def _names(model) -> dict:
    return {p: name for name, p in model.named_parameters()}


def find_checkpoint(load: str) -> str | None:
    """The directory to load from `--load`, or None to start from scratch.

    A missing or empty directory means a first run (as in Megatron); a directory with
    anything in it that is not a readable checkpoint is an error, never a silent restart.
    """
    if not os.path.exists(load):
        log.warning("--load %s does not exist: starting from scratch", load)
        return None
    if not os.path.isdir(load):
        raise CheckpointError(f"--load: {load} is not a directory")
    if os.path.exists(os.path.join(load, STATE_FILE)):
        return load  # an iter_XXXXXXX directory itself
    marker = os.path.join(load, MARKER)
    if os.path.exists(marker):
        try:
            iteration = int(open(marker).read().strip())
        except (OSError, ValueError):
            raise CheckpointError(f"--load: {marker} is unreadable or not an iteration number")
        path = iteration_dir(load, iteration)
        if not os.path.isdir(path):
            raise CheckpointError(f"--load: {marker} names iteration {iteration} but "
                                  f"{path} does not exist")
        return path
    try:
        entries = os.listdir(load)
    except OSError as e:
        raise CheckpointError(f"--load: cannot read {load}: {e.strerror}")
    if not entries:
        log.warning("--load %s is empty: starting from scratch", load)
        return None
    raise CheckpointError(f"--load: {load} exists but holds no checkpoint "
                          f"(no {MARKER} and no {STATE_FILE})")


def load_checkpoint(path: str, model, optimizer, model_shape: dict, rank: int = 0) -> TrainState:
    try:
        with open(os.path.join(path, STATE_FILE)) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"--load: {path}/{STATE_FILE} is unreadable ({e})")
    _check_shape(path, meta.get("model", {}), model_shape)
    model_sd, optim_sd = _state_dicts(model, optimizer)
    state_dict = {"model": model_sd, "optim": optim_sd}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state_dict, checkpoint_id=path)
        rng_file = os.path.join(path, f"rng_rank{rank:05d}.pt")
        rng = torch.load(rng_file, weights_only=False) if os.path.exists(rng_file) else None
    # DCP wraps per-rank failures in CheckpointException, a BaseException (not Exception).
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"--load: {path} is corrupt or incomplete: {_root_cause(e)}")
    set_model_state_dict(model, state_dict["model"], options=OPTIONS)
    if hasattr(optimizer, "load_dcp_state_dict"):
        optimizer.load_dcp_state_dict(state_dict["optim"], _names(model))
    else:
        set_optimizer_state_dict(model, optimizer, state_dict["optim"], options=OPTIONS)
    if rng is not None:
        _set_rng_state(rng)
    else:  # saved on fewer ranks: this rank has no stream to continue
        log.warning("%s has no RNG state for rank %d: keeping the seeded RNG", path, rank)
    log.info("loaded checkpoint %s (iteration %d)", path, meta["iteration"])
    return TrainState(iteration=meta["iteration"],
                      consumed_train_samples=meta["consumed_train_samples"],
                      skipped_iterations=meta.get("skipped_iterations", 0),
                      loss_scaler=meta.get("loss_scaler", {}))


def _root_cause(e: BaseException) -> str:
    """One line: the innermost error DCP saw on any rank, else the exception's own text."""
    if isinstance(e, CheckpointException):
        for failure in e.failures.values():  # values are (exception, traceback frames)
            e = failure[0] if isinstance(failure, tuple) else failure
            break
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _check_shape(path: str, saved: dict, current: dict):
    for key, value in current.items():
        if saved.get(key) != value:
            flag = "--" + key.replace("_", "-")
            raise CheckpointError(f"--load: {path} was saved with {flag}={saved.get(key)} "
                                  f"but this run has {value}")
