"""Stopping early and cleanly: a preemption signal or a wall-clock limit.

SLURM (and most schedulers) send SIGTERM some time before they kill a job; torchrun
passes it on to its workers. A rank that gets SIGTERM or SIGUSR1 only notes it; after the
current step every rank asks whether any rank has a reason to stop (one tiny all-reduce),
so all of them stop after the same step, save the same checkpoint and exit 0.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from megaulysses.parallel.comm import Comm

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# A directory where each rank that stopped early and saved leaves a file: run_node.sh
# (SLURM) counts them to tell a clean signal-stop from a failure, as torchrun cannot.
SAVED_ON_STOP_ENV = "MEGAULYSSES_SAVED_ON_STOP"


def mark_saved_on_stop(rank: int, iteration: int) -> None:
    """This rank stopped early and its checkpoint of `iteration` is committed."""
    directory = os.environ.get(SAVED_ON_STOP_ENV)
    if directory:
        with open(os.path.join(directory, f"rank{rank}"), "w") as f:
            f.write(f"{iteration}\n")


class StopConditions:
    def __init__(self, handle_signals: bool, duration_mins: Optional[float],
                 start: Optional[float] = None):
        self.deadline = None if duration_mins is None else (
            (start or time.monotonic()) + 60.0 * duration_mins)
        self.duration_mins = duration_mins
        self.signal: Optional[str] = None
        self.previous = {}
        if handle_signals and threading.current_thread() is not threading.main_thread():
            log.warning("--exit-signal-handler: not the main thread, signals stay unhandled")
        elif handle_signals:
            for sig in SIGNALS:
                self.previous[sig] = signal.signal(sig, self._on_signal)

    @property
    def active(self) -> bool:
        return bool(self.previous) or self.deadline is not None

    def _on_signal(self, signum, frame):
        # Only a note: saving from inside a handler would interrupt a collective.
        self.signal = signal.Signals(signum).name
        log.warning("%s received: stopping after the current step", self.signal)

    def reason(self, comm: Comm) -> Optional[str]:
        """Why every rank should stop now, or None. A collective when active: every rank
        calls it after every step."""
        if not self.active:
            return None
        mine = self._local_reason()
        if not comm.any_rank(mine is not None):
            return None
        return mine or "a stop request on another rank"

    def _local_reason(self) -> Optional[str]:
        if self.signal is not None:
            return self.signal
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return f"--exit-duration-in-mins {self.duration_mins:g} reached"
        return None

    def close(self) -> None:
        """Give the signals back to whoever handled them before."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}
