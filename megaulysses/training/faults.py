"""Faults: naming a failed or hung rank after a collective fails, and (tests only)
injecting faults.

A collective fails on the ranks that survive a dead or hung rank: at once where the
dead rank's connections close, or after --distributed-timeout-minutes. `failure_line`
turns that into the one line a user sees, naming the ranks that did not answer a roll
call (`roll_call`); the caller exits non-zero without a traceback.

Fault injection is for tests: MEGAULYSSES_FAULT="KIND:RANK:ITERATION[:SECONDS]", read
here alone (ITERATION+ : that iteration and every later one). At ITERATION, on RANK, after the backward and before the gradient norm's
collectives (mid-step: the other ranks are waiting in a collective):
    kill    the process SIGKILLs itself (kill -9)
    hang    it sleeps SECONDS (longer than the timeout: a frozen rank)
    nan     one of its gradients becomes NaN (after the reduction: only this rank sees it)
    fill    (not mid-step: at the save of ITERATION, after its free-space check) RANK
            fills --save's file system with a file (another job's, as it were): the
            checkpoint's own writes then fail for want of space
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megaulysses.config import ConfigError

log = logging.getLogger(__name__)

ENV = "MEGAULYSSES_FAULT"
KINDS = ("kill", "hang", "nan", "fill")

# Words in the errors gloo and NCCL raise when a peer is gone or a collective timed out.
_DISTRIBUTED_SIGNS = ("connection closed by peer", "timed out", "connection reset",
                      "broken pipe", "nccl", "gloo", "socket")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    iteration: int
    seconds: float = 0.0
    onwards: bool = False  # every iteration from `iteration` on

    def hook(self, rank: int, iteration: int) -> Optional[Callable[[list], None]]:
        """The injection for this rank's step `iteration` (it gets the gradient tensors),
        or None where nothing is injected."""
        if self.kind == "fill" or not self._hits(rank, iteration):
            return None
        return self._inject

    def _hits(self, rank: int, iteration: int) -> bool:
        hit = iteration >= self.iteration if self.onwards else iteration == self.iteration
        return rank == self.rank and hit

    def _inject(self, grads: list[torch.Tensor]) -> None:
        log.warning("%s: injecting %s on rank %d", ENV, self.kind, self.rank)
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.kind == "hang":
            time.sleep(self.seconds)
        elif grads:
            grads[0].view(-1)[0] = float("nan")

    def fill_before_save(self, rank: int, iteration: int, directory: str) -> None:
        """The `fill` fault: a file in `directory` grows until its file system is full."""
        if self.kind != "fill" or not self._hits(rank, iteration):
            return
        log.warning("%s: filling the file system of %s", ENV, directory)
        fd = os.open(os.path.join(directory, "fault_filler"), os.O_WRONLY | os.O_CREAT)
        try:
            for size in (2 ** 20, 4096, 1):  # large writes, then the last pages
                try:
                    while os.write(fd, b"\0" * size):
                        pass
                except OSError:
                    pass
        finally:
            os.close(fd)


def from_env() -> Optional[Fault]:
    """The fault MEGAULYSSES_FAULT asks for, or None; ConfigError when it does not parse."""
    text = os.environ.get(ENV)
    if not text:
        return None
    parts = text.split(":")
    try:
        fault = Fault(parts[0], int(parts[1]), int(parts[2].rstrip("+")),
                      float(parts[3]) if len(parts) > 3 else 0.0, parts[2].endswith("+"))
    except (IndexError, ValueError):
        fault = None
    if fault is None or fault.kind not in KINDS or len(parts) > 4:
        raise ConfigError(ENV, f"{text!r}: want KIND:RANK:ITERATION[+][:SECONDS], KIND one of "
                          f"{', '.join(KINDS)}")
    return fault


def is_distributed_failure(e: BaseException) -> bool:
    """Whether `e` is a collective that failed because a peer died or hung."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return False
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(s in text for s in _DISTRIBUTED_SIGNS)


def failure_line(e: BaseException, timeout_minutes: float) -> str:
    """One line for a failed collective: what failed here and which ranks are gone
    (after a roll call that lasts until every survivor has failed too: roll_call)."""
    import torch.distributed as dist
    rank = dist.get_rank()
    cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    cause = cause.split("] ", 1)[-1].split(". ")[0][:120]  # no source location, no advice
    with _stderr_silenced():  # the store's client prints C++ traces when its host is gone
        missing = roll_call(60.0 * timeout_minutes, "timed out" in str(e).lower())
    if missing is None:
        who = ("the failed rank could not be named: the job's store (on rank 0, or "
               "torchrun's) is gone, so rank 0 or the launcher failed, or the others "
               "have exited")
    elif missing:
        who = (f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did "
               "not answer: dead or hung")
    else:
        who = "every rank answered: the failure came from this rank's own collective"
    return (f"rank {rank}: a collective failed ({cause}); {who} "
            f"(--distributed-timeout-minutes {timeout_minutes:g}); the job stops, resume "
            "from the last checkpoint with the same command")


# -- after a failed collective: who is gone ---------------------------------------------

ROLL_CALL_SECONDS = 5.0  # how long survivors wait for each other beyond a timeout
_ROLL_CALL = "megaulysses/roll_call/"


def roll_call(timeout_s: float, timed_out: bool) -> Optional[list[int]]:
    """After a collective failed on this rank: the ranks that do not answer on the job's
    key-value store (dead or hung), or None when the store itself is gone (it lives in
    rank 0's process unless torchrun hosts it).

    A rank that failed because a peer's connection closed may have survivors still
    blocked in a collective (gloo frees no peer until its process exits, or times out),
    each failing within the timeout: the call lasts `timeout_s` + 5 s from the first
    failure. Once any rank has failed by timing out, every survivor blocked since that
    step has timed out too: 5 s from then. Every rank waits alike, so all name the same
    ranks. O(1) store requests per poll: it scales to large jobs. Rank 0 stays 2 s
    longer: the others read the store it may host."""
    import torch.distributed as dist
    store = dist.distributed_c10d._get_default_store()
    me, world = dist.get_rank(), dist.get_world_size()
    try:
        store.set(_key(str(me)), "1")
        if store.add(_key("count"), 1) == 1:  # the first failure sets the longest deadline
            store.set(_key("deadline"), repr(time.time() + timeout_s + ROLL_CALL_SECONDS))
        if timed_out and store.add(_key("timed_out"), 1) == 1:
            store.set(_key("timed_out_deadline"), repr(time.time() + ROLL_CALL_SECONDS))
        while store.add(_key("count"), 0) < world and time.time() < _deadline(store):
            time.sleep(0.5)
        return [r for r in range(world) if not store.check([_key(str(r))])]
    except (RuntimeError, OSError, ValueError):  # the store's host is gone
        return None
    finally:
        if me == 0:
            time.sleep(2.0)


def _key(name: str) -> str:
    return _ROLL_CALL + name


def _deadline(store) -> float:
    """The roll call's end: the first failure's, or sooner once a rank timed out."""
    deadline = float(store.get(_key("deadline")))
    if store.check([_key("timed_out_deadline")]):
        deadline = min(deadline, float(store.get(_key("timed_out_deadline"))))
    return deadline


@contextlib.contextmanager
def _stderr_silenced():
    """File descriptor 2 to /dev/null for a while: C++ code writes there directly."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)
