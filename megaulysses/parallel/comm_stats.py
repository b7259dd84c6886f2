"""The bookkeeping of comm.py's collectives, apart from them: the bytes this rank sends
per (group, kind) and, with --log-timers-to-tensorboard, the seconds each kind takes
(parallel/timers.py). Nothing here issues a collective; comm.py's module doc gives the byte
conventions."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Any, Callable, Hashable, Iterator, Optional, Protocol

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from megaulysses.parallel.timers import Timers

OTHER_GROUP = "other"  # CommStats' group for collectives on a group that is no mesh dim
BYTE_KINDS = ("all_to_all", "all_reduce", "all_gather", "reduce_scatter", "p2p", "ring")


class Waitable(Protocol):
    """An asynchronous collective in flight: torch's `dist.Work`, or `_TimedWork` around one
    (callers only ever wait on it)."""

    def wait(self) -> Any: ...


class CommStats:
    """Bytes sent by this rank per (group, collective kind), since the last `pop`. The
    group is the mesh dim name: it says which link the bytes cross (tools/plan.py)."""

    def __init__(self) -> None:
        self.bytes: defaultdict[tuple[str, str], int] = defaultdict(int)  # (group, kind) -> bytes
        self.counting = True
        self.timers = Timers()  # seconds per kind (and per step phase), when on
        self.replays: dict[Hashable, list] = {}  # see `counted_once`

    def add(self, kind: str, nbytes: float, group: str) -> None:
        if self.counting:
            self.bytes[(group, kind)] += int(nbytes)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Collectives inside are neither counted nor timed (e.g. evaluation between
        training steps)."""
        before, self.counting = self.counting, False
        timing, self.timers.paused = self.timers.paused, True
        try:
            yield
        finally:
            self.counting, self.timers.paused = before, timing

    @contextlib.contextmanager
    def counted_once(self, key: Hashable, dim_of_group: Callable[[str], str]) -> Iterator[None]:
        """Context counting DTensor's collectives inside (`_FunctionalCollectiveCounter`)
        the first time for each `key`, and after that adding what that time counted,
        without the counter: a dispatch mode runs Python on every op (~3% of a tp2 CPU
        step), and DTensor's collectives follow from the shapes alone, which `key` names.
        Timers on, the counter runs every time (it times them); nothing counted or timed
        (evaluation), it never runs."""
        if not self.counting and not self.timers.active:
            yield
            return
        if self.timers.active or key not in self.replays:
            record: list = []
            with _FunctionalCollectiveCounter(self, dim_of_group, record):
                yield
            if key is not None and not self.timers.active:
                self.replays[key] = record
            return
        for kind, nbytes, group in self.replays[key]:
            self.add(kind, nbytes, group)
        yield

    def timed(self, kind: str, tensor: torch.Tensor) -> contextlib.AbstractContextManager:
        """Context timing a collective of `kind` on `tensor`'s device (a no-op when off)."""
        return self.timers(kind, tensor.device.type)

    def timed_work(self, work: Optional[dist.Work], kind: str,
                   tensor: torch.Tensor) -> Optional[Waitable]:
        """An asynchronous collective's `work`, whose wait() is timed as `kind` too."""
        if work is None or not self.timers.active:
            return work
        return _TimedWork(work, lambda: self.timed(kind, tensor))

    def pop(self, by_group: bool = False) -> dict:
        """Bytes per kind ({kind: bytes}), or with `by_group` per {(group, kind): bytes}."""
        out = dict(self.bytes)
        self.bytes.clear()
        if by_group:
            return out
        kinds: defaultdict[str, int] = defaultdict(int)
        for (_, kind), n in out.items():
            kinds[kind] += n
        return dict(kinds)


class _TimedWork:
    """An asynchronous collective's work whose wait() is timed (only our own code waits
    on these, and only through wait())."""

    def __init__(self, work: dist.Work, timed: Callable[[], contextlib.AbstractContextManager]):
        self.work, self.timed = work, timed

    def wait(self) -> Any:
        with self.timed():
            return self.work.wait()


class _FunctionalCollectiveCounter(TorchDispatchMode):
    """Bytes of `_c10d_functional` collectives, by the conventions of the module doc."""

    KINDS = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
             "all_reduce": "all_reduce", "all_to_all_single": "all_to_all"}

    def __init__(self, stats: CommStats, dim_of_group, record: Optional[list] = None):
        super().__init__()
        self.stats, self.dim_of_group = stats, dim_of_group
        self.record = record  # gets (kind, bytes, group) of each collective counted
        self.pending: dict[int, str] = {}  # timers on: id of an unwaited result -> its kind

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional":
            name = func.__name__.split(".")[0]
            kind = self.KINDS.get(name)
            if kind is not None:
                self._count(kind, args)
                with self.stats.timed(kind, args[0]):
                    out = func(*args, **(kwargs or {}))
                if self.stats.timers.active:  # its wait, later, is this kind's time too
                    self.pending[id(out)] = kind
                return out
            if name == "wait_tensor" and self.pending:
                kind = self.pending.pop(id(args[0]), None)
                if kind is not None:
                    with self.stats.timed(kind, args[0]):
                        return func(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))

    def _count(self, kind: str, args):
        x, group_name = args[0], args[-1]
        p = dist.distributed_c10d._resolve_process_group(group_name).size()
        n = _nbytes(x)
        sent = {"all_gather": n * (p - 1), "reduce_scatter": n * (p - 1) / p,
                "all_reduce": 2 * n * (p - 1) / p, "all_to_all": n * (p - 1) / p}[kind]
        group = self.dim_of_group(group_name)
        self.stats.add(kind, sent, group)
        if self.record is not None and self.stats.counting:
            self.record.append((kind, int(sent), group))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
