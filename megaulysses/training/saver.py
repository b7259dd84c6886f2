"""Writing checkpoints (checkpoint.py says the layout and the commit protocol), and what a
save does when its storage fails it.

Every rank calls `Saver.save`; rank 0 commits. Each phase ends with every rank agreeing
whether it went well (one small collective), so a failure anywhere is one TrainingError
on every rank: the one line names the directory, the iteration, the OS error in words,
the checkpoint's size and the free space, and the last good checkpoint; the partial
`.tmp_iter_*` directory is removed and the `latest` marker still names the last good
checkpoint, so the next run resumes from it. Before writing, a save checks the free space
against one checkpoint's size (storage.checkpoint_bytes); short of it, the retention
policy prunes first, and if that is not enough the run stops (nothing half-written).
A background save (--async-save) that fails is reported at the next save or the end.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
from typing import Any, Callable, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from megaulysses.config import TrainingError
from megaulysses.parallel.comm import Comm
from megaulysses.training.checkpoint import (COMMIT_FILE, MARKER, STATE_FILE, TrainState,
                                             _fsync_dir, _iteration_dirs, _quiet, _rng_state,
                                             _state_dicts, _write_file, iteration_dir,
                                             tokenizer_sha256)
from megaulysses.training.faults import Fault
from megaulysses.training.storage import Retention, failure_reason, free_bytes, mib

log = logging.getLogger(__name__)


class Saver:
    """Writes checkpoints into `save_dir`. `comm`: every rank's agreement and barriers
    (world 1: none). With `use_async` the DCP write runs in a background thread on a CPU
    copy of the state, coordinating over `async_group` (a gloo group of all ranks for
    checkpoint traffic only, None alone); rank 0 commits when its write is done, which
    DCP reports only after every rank's data is written. `size`: one checkpoint's bytes.
    `protected`: the iteration the run loaded from here, which retention never removes."""

    def __init__(self, save_dir: str, rank: int, comm: Optional[Comm] = None,
                 retention: Optional[Retention] = None, use_async: bool = False,
                 async_group: Optional[torch.distributed.ProcessGroup] = None, size: int = 0,
                 fault: Optional[Fault] = None, contents: tuple = ("model", "optim", "rng")):
        self.save_dir, self.rank, self.comm = save_dir, rank, comm
        # what a checkpoint holds: the model, and unless --no-save-optim / --no-save-rng
        # the optimizer state and each rank's RNG states
        self.contents = tuple(contents)
        self.retention, self.size = retention or Retention(), size  # default: keep all
        self.use_async, self.async_group = use_async, async_group
        # (future, tmp dir, final dir, meta) of a background save
        self.pending: Optional[tuple[Any, str, str, dict]] = None
        self.failed: Optional[str] = None  # a background save's failure, not yet reported
        self.last_saved: Optional[int] = None
        self.protected: Optional[int] = None
        self.fault = fault  # tests only (faults.py: fill)
        if rank == 0:
            self._clear_debris(announce=True)

    # -- agreement among ranks -------------------------------------------------------------

    def _barrier(self) -> None:
        if self.comm is not None:
            self.comm.barrier()

    def _agree(self, failure: Optional[str], tmp: Optional[str] = None) -> None:
        """Raise TrainingError on every rank when `failure` (one line) is set on any; the
        partial directory `tmp` is removed first."""
        if self.comm is not None:
            failure = self.comm.first_of_any_rank(failure)
        if failure is None:
            return
        if self.rank == 0 and tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise TrainingError(failure)

    def _attempt(self, what: Callable[[], Any], iteration: int, tmp: str) -> Optional[str]:
        """Run one phase of a save: None, or the one line saying why it failed."""
        try:
            what()
        except (OSError, RuntimeError, CheckpointException) as e:
            return self._failure_line(e, iteration, tmp)
        return None

    def _failure_line(self, e: BaseException, iteration: int, tmp: Optional[str]) -> str:
        reason = failure_reason(e, self.save_dir, self.size)
        removed = f"; removed {tmp}" if tmp else ""
        return (f"saving iteration {iteration} to {self.save_dir} failed: {reason} "
                f"({self._space()}){removed}; {self._last_good()}")

    def _space(self) -> str:
        try:
            free = mib(free_bytes(self.save_dir))
        except OSError:
            free = "unknown"
        return f"one checkpoint is {mib(self.size)}, {free} free"

    def _latest(self) -> Optional[int]:
        """The iteration the `latest` marker names, if any."""
        try:
            with open(os.path.join(self.save_dir, MARKER)) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return None

    def _last_good(self) -> str:
        latest = self._latest()
        if latest is None:
            return "there is no earlier checkpoint in it"
        return (f"the last good checkpoint is {iteration_dir(self.save_dir, latest)}, which "
                f"--load {self.save_dir} resumes from")

    # -- saving ---------------------------------------------------------------------------

    def save(self, model: torch.nn.Module, optimizer: Any, state: TrainState, meta: dict,
             tokenizer: dict[str, str]) -> None:
        """`meta`: what trainer_state.json records besides the train state; `tokenizer`:
        the files to copy into it, {name in the checkpoint: path} (storage.tokenizer_files)."""
        self.wait()  # one save in flight at a time; a failed background save stops here
        it = state.iteration
        final = iteration_dir(self.save_dir, it)
        tmp = os.path.join(self.save_dir, ".tmp_" + os.path.basename(final))
        self._make_room(it)
        if self.fault is not None:
            self.fault.fill_before_save(self.rank, it, self.save_dir)
        self._agree(self._attempt(lambda: self._prepare(tmp, tokenizer), it, tmp), tmp)
        if "rng" in self.contents:
            rng = os.path.join(tmp, f"rng_rank{self.rank:05d}.pt")
            self._agree(self._attempt(lambda: torch.save(_rng_state(), rng), it, tmp), tmp)
        with_optim = "optim" in self.contents
        model_sd, optim_sd = _state_dicts(model, optimizer, with_optim)
        meta = dict(meta, iteration=it, contents=list(self.contents),
                    consumed_train_samples=state.consumed_train_samples,
                    skipped_iterations=state.skipped_iterations, loss_scaler=state.loss_scaler)
        self.last_saved = it
        states = {"model": model_sd, **({"optim": optim_sd} if with_optim else {})}
        if self.use_async:
            future = dcp.async_save(states, checkpoint_id=tmp, process_group=self.async_group,
                                    no_dist=self.async_group is None)
            self.pending = (future, tmp, final, meta)
            log.info("saving checkpoint %s in the background", final)
            return
        with _quiet():
            self._agree(self._attempt(lambda: dcp.save(states, checkpoint_id=tmp), it, tmp),
                        tmp)
        commit = (lambda: self._commit(tmp, final, meta)) if self.rank == 0 else (lambda: None)
        self._agree(self._attempt(commit, it, tmp), tmp)  # nobody runs ahead of the commit

    def _prepare(self, tmp: str, tokenizer: dict[str, str]) -> None:
        if self.rank == 0:
            self._clear_debris()
            os.makedirs(tmp)
            _copy_tokenizer(tokenizer, tmp)
        # the agreement after this phase (a collective) is the barrier: the directory
        # exists before anybody writes into it

    def _make_room(self, iteration: int) -> None:
        """Free space for one checkpoint, on every rank's view of the directory: retention
        prunes what it would remove after this save; short still, the run stops."""
        if not self._short():
            return
        if self.rank == 0 and self.retention.active:
            self._prune(extra=iteration, why="to make room")
        self._barrier()
        short = self._short()
        policy = (f"after pruning by {self.retention.flags()}" if self.retention.active else
                  "(--keep-last or --save-retain-interval prune old ones)")
        self._agree(f"saving iteration {iteration} to {self.save_dir}: not enough space "
                    f"({self._space()}) {policy}; nothing was written; {self._last_good()}"
                    if short else None)

    def _short(self) -> bool:
        short = free_bytes(self.save_dir) < self.size
        return self.comm.any_rank(short) if self.comm is not None else short

    def poll(self) -> None:
        """Commit a finished background save (rank 0); cheap, no collective. A failure is
        kept for `wait` to report on every rank."""
        if self.pending is not None and self.pending[0].done():
            self._finish()

    def wait(self) -> None:
        """Block until a background save is written and committed, on every rank; raise
        TrainingError on every rank if it failed."""
        if self.pending is not None:
            self._finish()
        if self.use_async:
            failed, self.failed = self.failed, None
            self._agree(failed)

    def _finish(self) -> None:
        assert self.pending is not None, "called with a background save pending"
        future, tmp, final, meta = self.pending
        self.pending = None
        it = meta["iteration"]
        try:
            future.result()
            if self.rank == 0:
                self._commit(tmp, final, meta)
        except (Exception, CheckpointException) as e:
            self.failed = self._failure_line(e, it, tmp)
            log.error("%s", self.failed)
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)

    def _commit(self, tmp: str, final: str, meta: dict) -> None:
        _write_file(os.path.join(tmp, STATE_FILE), json.dumps(meta, indent=1))
        _write_file(os.path.join(tmp, COMMIT_FILE), f"{meta['iteration']}\n")
        _fsync_dir(tmp)
        if os.path.exists(final):  # re-saving the same iteration: replace it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_file(os.path.join(self.save_dir, MARKER), str(meta["iteration"]))
        _fsync_dir(self.save_dir)
        log.info("saved checkpoint %s", final)
        self._prune()

    # -- retention and debris -------------------------------------------------------------

    def _prune(self, extra: Optional[int] = None, why: str = "") -> None:
        """Remove the committed checkpoints the retention policy does not keep (`extra`:
        an iteration about to be saved, counted as the newest)."""
        committed = [it for it, ok in _iteration_dirs(self.save_dir) if ok]
        candidates = committed + ([extra] if extra is not None else [])
        for it in self.retention.prunable(candidates, (self.protected, self._latest())):
            if it == extra:
                continue
            path = iteration_dir(self.save_dir, it)
            shutil.rmtree(path, ignore_errors=True)
            log.info("%s: removed %s%s", self.retention.flags(), path, f" ({why})" if why else "")

    def _clear_debris(self, announce: bool = False) -> None:
        """Remove what interrupted saves left (never a committed checkpoint)."""
        for path in glob.glob(os.path.join(self.save_dir, ".tmp_iter_*")):
            shutil.rmtree(path, ignore_errors=True)
            if announce:
                log.info("removed %s, the partial checkpoint of an interrupted save", path)
        os.makedirs(self.save_dir, exist_ok=True)


def _copy_tokenizer(files: dict[str, str], directory: str) -> None:
    """The run's tokenizer files into a checkpoint: a checkpoint holds all it needs."""
    for name, path in files.items():
        shutil.copyfile(path, os.path.join(directory, name))


def write_model_checkpoint(save_dir: str, state_dict: dict, model_shape: dict,
                           tokenizer: Optional[dict[str, str]] = None, iteration: int = 0,
                           extra: Optional[dict] = None) -> str:
    """One process: a committed model-only checkpoint the trainer loads (the converter's
    import). `state_dict`: the GPT's parameters by name, whole tensors; `tokenizer`: the
    files to copy, {name in the checkpoint: path}, as storage.tokenizer_files."""
    saver = Saver(save_dir, 0)
    final = iteration_dir(save_dir, iteration)
    tmp = os.path.join(save_dir, ".tmp_" + os.path.basename(final))
    os.makedirs(tmp)
    meta = {"iteration": iteration, "contents": ["model"], "consumed_train_samples": 0,
            "skipped_iterations": 0, "loss_scaler": {}, "model": model_shape,
            **(extra or {})}
    if tokenizer:
        _copy_tokenizer(tokenizer, tmp)
        # The vocabulary's identity, as a training run records it (checkpoint.tokenizer_meta):
        # a Hugging Face tokenizer's tokenizer.json alone, not its config files.
        vocab = [tokenizer["tokenizer.json"]] if "tokenizer.json" in tokenizer else \
            list(tokenizer.values())
        meta["tokenizer"] = {"sha256": tokenizer_sha256(*vocab)}
    with _quiet():
        dcp.save({"model": dict(state_dict)}, checkpoint_id=tmp, no_dist=True)
    saver._commit(tmp, final, meta)
    return final
