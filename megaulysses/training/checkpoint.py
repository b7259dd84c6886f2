"""Checkpoints: DCP for model and optimizer, JSON for trainer state, atomic commit.

Layout of `--save DIR`:
    DIR/iter_0000100/            one committed checkpoint
        .metadata, *.distcp      torch.distributed.checkpoint: "model.<name>" (whole-model
                                 shapes, whatever grid saved them), "optim.<...>"
        trainer_state.json       iteration, consumed samples, loss scaler, model shape,
                                 LR schedule, data, tokenizer, the flags of the run
        tokenizer.model          a copy of the run's tokenizer (self-contained checkpoint);
        vocab.json, merges.txt   GPT2BPETokenizer's two files instead
        rng_rank00000.pt         python / numpy / torch (/ cuda) RNG states of each rank
        COMMITTED                written last: the checkpoint is complete
    DIR/latest_checkpointed_iteration.txt   "100" (Megatron's name for the `latest` marker)

Commit protocol: everything is written into DIR/.tmp_iter_0000100; when every rank's
files are there, rank 0 writes trainer_state.json and COMMITTED (fsync'd), renames the
directory into place (atomic) and then replaces the marker (atomic). A crash at any point
leaves the previous checkpoint and marker as they were; an `iter_*` directory without
COMMITTED (a copy cut short, a non-atomic file system) is skipped with a warning.

A checkpoint written by tools/convert_checkpoint.py holds only the model ("contents":
["model"] in trainer_state.json): loading it starts at its iteration (0) with a fresh
optimizer, as continued pretraining from imported weights. A training run saves "optim"
and "rng" too, unless --no-save-optim / --no-save-rng; loading such a checkpoint then needs
--no-load-optim / --no-load-rng (Megatron-LM's rule).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import random
import re
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Union

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)

from megaulysses.config import CheckpointError, Config, RunConfig, TrainConfig
from megaulysses.config.fields import filled
from megaulysses.config.schema import SECTIONS
from megaulysses.training.load_rules import check_meta

if TYPE_CHECKING:
    from megaulysses.config import ModelConfig
    from megaulysses.parallel.zero import ShardedAdamW

    Optimizer = Union[torch.optim.Optimizer, ShardedAdamW]

log = logging.getLogger(__name__)

MARKER = "latest_checkpointed_iteration.txt"
STATE_FILE = "trainer_state.json"
COMMIT_FILE = "COMMITTED"
ITER_DIR = re.compile(r"^iter_(\d{7})$")
# Optimizer state keyed per parameter name ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr"):
# pipeline stages hold different parameters, so a nested per-rank list of param groups
# would not survive DCP's de-duplication; flat keys also load on any other grid.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# One process saves without a process group on purpose; a background save warns about it
# from its own thread, where a catch_warnings() around the call does not reach.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                        "uninitialized", category=UserWarning)


@dataclass
class TrainState:
    iteration: int = 0
    consumed_train_samples: int = 0
    skipped_iterations: int = 0
    loss_scaler: dict = field(default_factory=dict)


def iteration_dir(save_dir: str, iteration: int) -> str:
    return os.path.join(save_dir, f"iter_{iteration:07d}")


# -- RNG and small files ------------------------------------------------------------------

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


def _write_file(path: str, text: str):
    """Write, fsync, rename: the file is either absent or whole."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _fsync_dir(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- saving -------------------------------------------------------------------------------

def _state_dicts(model, optimizer, with_optim: bool = True) -> tuple[dict, Optional[dict]]:
    """Model and optimizer state, keyed by parameter name, as DTensors where sharded. The
    ZeRO-1 optimizer gives its own (same keys and global shapes as torch's); under the
    distributed optimizer the model's weights are its fp32 main weights, not the 16-bit
    ones the forward uses. Without the optimizer (`with_optim` False): no optimizer state."""
    model_sd = get_model_state_dict(model, options=OPTIONS)
    if hasattr(optimizer, "model_state_dict"):
        model_sd.update(optimizer.model_state_dict(_names(model)))
    if optimizer is None or not with_optim:
        return model_sd, None
    if hasattr(optimizer, "dcp_state_dict"):
        return model_sd, optimizer.dcp_state_dict(_names(model))
    return model_sd, get_optimizer_state_dict(model, optimizer, options=OPTIONS)


def _names(model) -> dict:
    return {p: name for name, p in model.named_parameters()}


def _not_from_dcp(record: logging.LogRecord) -> bool:
    return f"{os.sep}distributed{os.sep}checkpoint{os.sep}" not in record.pathname


@contextlib.contextmanager
def _quiet():
    """DCP warns when it runs without a process group, and logs each failure with a
    traceback on the root logger; we report failures ourselves, in one line."""
    root = logging.getLogger()
    root.addFilter(_not_from_dcp)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            yield
    finally:
        root.removeFilter(_not_from_dcp)


# -- finding and loading ------------------------------------------------------------------

def _iteration_dirs(save_dir: str) -> list[tuple[int, bool]]:
    """(iteration, committed) of every iter_XXXXXXX directory."""
    out = []
    for name in os.listdir(save_dir):
        m = ITER_DIR.match(name)
        if m and os.path.isdir(os.path.join(save_dir, name)):
            out.append((int(m.group(1)), os.path.exists(os.path.join(save_dir, name,
                                                                     COMMIT_FILE))))
    return out


def find_checkpoint(load: str, save: Optional[str] = None,
                    required: bool = False) -> Optional[str]:
    """The committed checkpoint directory `--load` names, or None to start from scratch.
    A Megatron-LM checkpoint's iteration directory is returned as it is (megatron.is_megatron
    tells it apart; the trainer converts it).

    Starting from scratch is allowed only where a run resumes into its own --save
    directory (the same command line for the first job and every requeued one), and not
    even there with --exit-on-missing-checkpoint (`required`); any other --load that holds
    nothing loadable is an error, never a silent fresh start.
    """
    from megaulysses.training.megatron.detect import find_iteration_dir
    own = save is not None and os.path.abspath(save) == os.path.abspath(load)
    if required and own and (not os.path.isdir(load) or not os.listdir(load)):
        raise CheckpointError(f"--exit-on-missing-checkpoint: --load {load} holds no "
                              "checkpoint")
    megatron = find_iteration_dir(load)
    if megatron is not None:
        return megatron
    if not os.path.exists(load):
        if own:
            log.info("--load %s does not exist yet: starting from scratch", load)
            return None
        raise CheckpointError(f"--load: {load} does not exist (to start from scratch and "
                              "resume into it later, pass the same directory to --save)")
    if not os.path.isdir(load):
        raise CheckpointError(f"--load: {load} is not a directory")
    if ITER_DIR.match(os.path.basename(os.path.normpath(load))) or os.path.exists(
            os.path.join(load, STATE_FILE)):
        return _single(load)  # an iter_XXXXXXX directory itself
    try:
        dirs = _iteration_dirs(load)
    except OSError as e:
        raise CheckpointError(f"--load: cannot read {load}: {e.strerror}") from None
    path = _newest_committed(load, dirs, _marker(load))
    if path is not None:
        return path
    if own and not required:
        log.warning("--load %s holds no committed checkpoint: starting from scratch", load)
        return None
    if dirs:
        raise CheckpointError(f"--load: {load} holds no committed checkpoint (only "
                              f"interrupted saves without {COMMIT_FILE})")
    if not os.listdir(load):
        raise CheckpointError(f"--load: {load} is empty (to start from scratch and resume "
                              "into it later, pass the same directory to --save)")
    raise CheckpointError(f"--load: {load} exists but holds no checkpoint "
                          f"(no {MARKER} and no iter_XXXXXXX directories)")


def _single(path: str) -> str:
    if not os.path.exists(os.path.join(path, COMMIT_FILE)):
        raise CheckpointError(f"--load: {path} has no {COMMIT_FILE} marker: an interrupted "
                              "or incomplete save")
    return path


def _marker(load: str) -> Optional[int]:
    marker = os.path.join(load, MARKER)
    if not os.path.exists(marker):
        return None
    try:
        return int(open(marker).read().strip())
    except (OSError, ValueError):
        raise CheckpointError(
            f"--load: {marker} is unreadable or not an iteration number") from None


def _newest_committed(load: str, dirs: list, marked: Optional[int]) -> Optional[str]:
    """The marker's iteration if committed, else the newest committed one below it (with a
    warning for each skipped one). Without a marker: the newest committed."""
    if marked is not None and marked not in {it for it, _ in dirs}:
        raise CheckpointError(f"--load: {os.path.join(load, MARKER)} names iteration "
                              f"{marked} but {iteration_dir(load, marked)} does not exist")
    for it, ok in sorted(dirs, reverse=True):
        if marked is not None and it > marked:
            log.warning("%s is newer than %s (%d): ignored", iteration_dir(load, it), MARKER,
                        marked)
        elif not ok:
            log.warning("%s has no %s marker (an interrupted save?): ignored",
                        iteration_dir(load, it), COMMIT_FILE)
        else:
            return iteration_dir(load, it)
    return None


def read_meta(path: str) -> dict:
    try:
        with open(os.path.join(path, STATE_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"--load: {path}/{STATE_FILE} is unreadable ({e})") from None


def load_checkpoint(path: str, model: torch.nn.Module, optimizer: Optimizer, expect: dict,
                    rank: int = 0, load_optim: bool = True,
                    load_rng: bool = True) -> tuple[TrainState, dict]:
    """Load into the (already parallelized) model and optimizer: DCP reshards whatever
    grid saved it onto ours. `expect` is what the checkpoint must agree on (check_meta).
    Returns the train state and the checkpoint's trainer_state.json."""
    meta = read_meta(path)
    check_meta(path, meta, expect)
    contents = meta.get("contents", ["model", "optim", "rng"])
    _check_contents(path, meta, contents, load_optim, load_rng)
    with_optim = load_optim and "optim" in contents
    model_sd, optim_sd = _state_dicts(model, optimizer, with_optim)  # optim_sd: if with_optim
    state_dict = {"model": model_sd, **({"optim": optim_sd} if optim_sd is not None else {})}
    rng = _load_dcp(path, state_dict, rank if load_rng and "rng" in contents else None)
    if hasattr(optimizer, "load_model_state_dict"):  # its main weights, then the 16-bit
        optimizer.load_model_state_dict(state_dict["model"], _names(model))
    else:
        set_model_state_dict(model, state_dict["model"], options=OPTIONS)
    if with_optim and hasattr(optimizer, "load_dcp_state_dict"):
        optimizer.load_dcp_state_dict(state_dict["optim"], _names(model))
    elif with_optim:  # torch's own (ours have load_dcp_state_dict)
        assert isinstance(optimizer, torch.optim.Optimizer), type(optimizer)
        set_optimizer_state_dict(model, optimizer, state_dict["optim"], options=OPTIONS)
    else:
        log.info("%s: model only (%s): the optimizer starts fresh", path,
                 "--no-load-optim" if not load_optim else "an imported checkpoint")
    if rng is not None:
        _set_rng_state(rng)
    log.info("loaded checkpoint %s (iteration %d)", path, meta["iteration"])
    return TrainState(iteration=meta["iteration"],
                      consumed_train_samples=meta["consumed_train_samples"],
                      skipped_iterations=meta.get("skipped_iterations", 0),
                      loss_scaler=meta.get("loss_scaler", {}) if with_optim else {}), meta


def _check_contents(path: str, meta: dict, contents: list, load_optim: bool,
                    load_rng: bool) -> None:
    """A training run's checkpoint saved without its optimizer state (--no-save-optim) or
    RNG states (--no-save-rng) loads only when the run is told to go without them
    (--no-load-optim, --no-load-rng), as in Megatron-LM. An imported checkpoint
    (tools/convert_checkpoint.py: the model only, no run's flags) needs neither: it
    starts a fresh optimizer, as Megatron-LM's release checkpoints do."""
    if "args" not in meta:
        return
    for part, wanted, saved_without, flag, what in (
            ("optim", load_optim, "--no-save-optim", "--no-load-optim", "optimizer state"),
            ("rng", load_rng, "--no-save-rng", "--no-load-rng", "RNG states")):
        if wanted and part not in contents:
            raise CheckpointError(f"{flag}: {path} was saved with {saved_without} (it holds "
                                  f"no {what}): pass {flag} to load it anyway")


def _load_dcp(path: str, state_dict: dict, rng_rank: Optional[int]) -> Optional[dict]:
    """DCP load in place; this rank's RNG state (None if not asked for or not saved)."""
    try:
        with _quiet():
            dcp.load(state_dict, checkpoint_id=path)
        if rng_rank is None:
            return None
        rng_file = os.path.join(path, f"rng_rank{rng_rank:05d}.pt")
        if not os.path.exists(rng_file):  # saved on fewer ranks: no stream to continue
            log.warning("%s has no RNG state for rank %d: keeping the seeded RNG", path,
                        rng_rank)
            return None
        return torch.load(rng_file, weights_only=False)
    # DCP wraps per-rank failures in CheckpointException, a BaseException (not Exception).
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"--load: {path} is corrupt or incomplete: {_root_cause(e)}") from e


def read_model_checkpoint(path: str) -> tuple[dict, dict]:
    """One process, no grid: (trainer_state.json, {parameter name: whole tensor}) of a
    committed checkpoint saved on any grid. For tools (conversion to Hugging Face)."""
    from megaulysses.model.gpt import GPT
    found = find_checkpoint(path)  # not another run's --save: never None, raises instead
    assert found is not None, path
    path = found
    meta = read_meta(path)
    cfg = model_config(meta["model"])
    with torch.device("meta"):
        names = GPT(cfg).state_dict()
    state = {name: torch.empty(t.shape, dtype=t.dtype) for name, t in names.items()}
    _load_dcp(path, {"model": state}, None)
    return meta, state


def model_config(shape: dict) -> ModelConfig:
    """ModelConfig from a checkpoint's "model" entry (ModelConfig.shape_dict())."""
    from dataclasses import fields
    from megaulysses.config import ModelConfig
    names = {f.name for f in fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in shape.items() if k in names})


def _root_cause(e: BaseException) -> str:
    """One line: the innermost error DCP saw on any rank, else the exception's own text."""
    if isinstance(e, CheckpointException):
        for failure in e.failures.values():  # values are (exception, traceback frames)
            e = failure[0] if isinstance(failure, tuple) else failure
            break
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


# ---- what a training run writes beside its weights, and checks when it resumes ----------


@functools.lru_cache(maxsize=None)
def tokenizer_sha256(*paths: str) -> str:
    """The tokenizer's identity: its file's sha256, or for several files (GPT-2's vocab and
    merges, in that order) the sha256 of their sha256s. Once per run: every save records it."""
    if len(paths) == 1:
        return file_sha256(paths[0])
    return hashlib.sha256(" ".join(map(file_sha256, paths)).encode()).hexdigest()


def tokenizer_meta(cfg: Config, vocab_size: int) -> dict:
    """What identifies the vocabulary: a checkpoint must be loaded with the same."""
    d = cfg.data
    if d.tokenizer_type == "NullTokenizer":
        return {"type": d.tokenizer_type, "vocab_size": vocab_size,
                "flag": f"--vocab-size {d.vocab_size} (NullTokenizer)"}
    if d.tokenizer_type == "GPT2BPETokenizer":
        return {"type": d.tokenizer_type, "vocab_size": vocab_size,
                "sha256": tokenizer_sha256(d.vocab_file, d.merge_file),
                "flag": f"--vocab-file {d.vocab_file} --merge-file {d.merge_file}"}
    if d.tokenizer_type == "HuggingFaceTokenizer":  # its tokenizer.json holds the vocabulary
        from megaulysses.data.hf_tokenizer import tokenizer_json
        return {"type": d.tokenizer_type, "vocab_size": vocab_size,
                "sha256": tokenizer_sha256(tokenizer_json(
                    filled(d.tokenizer_model, "--tokenizer-model"))),
                "flag": f"--tokenizer-model {d.tokenizer_model}"}
    return {"type": d.tokenizer_type, "vocab_size": vocab_size,
            "sha256": tokenizer_sha256(d.tokenizer_model),
            "flag": f"--tokenizer-model {d.tokenizer_model}"}


def schedule_meta(t: TrainConfig) -> dict:
    return {"lr": t.lr, "min_lr": t.min_lr, "lr_decay_style": t.lr_decay_style,
            "lr_warmup_iters": t.lr_warmup_iters,
            "lr_decay_iters": t.lr_decay_iters or t.train_iters,
            **{k: getattr(t, k) for k in ("train_samples", "lr_warmup_samples",
                                          "lr_decay_samples", "rampup_batch_size",
                                          "decoupled_lr", "decoupled_min_lr")}}


def data_meta(cfg: Config) -> dict:
    d = cfg.data
    return {"data_path": list(d.data_path or ()), "split": d.split, "seed": cfg.train.seed,
            "mock_data": d.mock_data, "seq_length": cfg.model.seq_length}


def run_meta(cfg: RunConfig, vocab_size: int, zero_stage: int) -> dict:
    """meta.json of a training run's checkpoint: the model's shape, the tokenizer, the
    schedule, the data, the grid and every flag's value."""
    d = cfg.dims
    return {"model": cfg.model.shape_dict(), "tokenizer": tokenizer_meta(cfg, vocab_size),
            "lr_schedule": schedule_meta(cfg.train), "data": data_meta(cfg),
            "grid": {"dp": d.dp, "tp": d.tp, "pp": d.pp, "sp": d.sp, "zero_stage": zero_stage},
            "args": {name: dataclasses.asdict(getattr(cfg, name)) for name in SECTIONS}}


def warn_changed(path: str, key: str, meta: dict, now: dict, consequence: str) -> None:
    """Flags that may change on resume (unlike the model's shape), but rarely should."""
    saved = meta.get(key, {})
    for name, value in now.items():
        if name in saved and saved[name] != value:
            log.warning("--%s is %s but %s was saved with %s: %s", name.replace("_", "-"),
                        value, path, saved[name], consequence)
