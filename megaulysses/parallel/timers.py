"""Seconds spent per named span of a training step (forward, backward, optimizer, each
collective kind), for --log-timers-to-tensorboard.

Off (the default) a timer is one shared null context: nothing is read, the device is never
synchronized, so a run that does not ask pays an attribute test per span. On, each span
reads `time.perf_counter()` at both ends; on CUDA it first synchronizes the device at both
ends (as Megatron-LM's timers do), so a span measures the device's work, not the launch of
its kernels. `Comm` owns one (`comm.stats.timers`): every collective is timed where it is
issued, and `CommStats.paused()` (evaluation, control traffic) pauses it too.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Iterator

import torch

_OFF = contextlib.nullcontext()


class Timers:
    """Seconds per name since the last `pop`, while `on` and not `paused`."""

    def __init__(self) -> None:
        self.on = False
        self.paused = False
        self.seconds: dict[str, float] = defaultdict(float)

    @property
    def active(self) -> bool:
        return self.on and not self.paused

    def __call__(self, name: str, device_type: str = "cpu") -> contextlib.AbstractContextManager:
        """Context: its seconds add to `name` (nothing when off or paused at entry)."""
        if not self.active:
            return _OFF
        return _Span(self.seconds, name, device_type == "cuda")

    @contextlib.contextmanager
    def remainder(self, name: str, inner: tuple[str, ...],
                  device_type: str = "cpu") -> Iterator[None]:
        """Context: its seconds less what the `inner` names gained meanwhile add to
        `name` (the pipeline schedule's time outside forward and backward: its sends,
        receives and waits for the other stages)."""
        if not self.active:
            yield
            return
        before = sum(self.seconds[n] for n in inner)
        span: dict[str, float] = defaultdict(float)
        with _Span(span, name, device_type == "cuda"):
            yield
        gained = sum(self.seconds[n] for n in inner) - before
        self.seconds[name] += max(0.0, span[name] - gained)

    def pop(self) -> dict[str, float]:
        """{name: seconds} since the last call."""
        out = dict(self.seconds)
        self.seconds.clear()
        return out


class _Span:
    def __init__(self, seconds: dict, name: str, cuda: bool):
        self.seconds, self.name, self.cuda = seconds, name, cuda

    def __enter__(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.t0 = time.perf_counter()

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds[self.name] += time.perf_counter() - self.t0
