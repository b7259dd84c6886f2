"""--profile: a torch.profiler trace of a few training steps on the chosen ranks.

Megatron-LM's flags and place: the steps that run after --profile-step-start iterations
up to iteration --profile-step-end (Megatron-LM's default 10 and 12: iterations 11 and
12), on the global ranks --profile-ranks (default [0]), written next to
--tensorboard-dir as <tensorboard-dir>/../torch_profile/rank-N.pt.trace.json.gz: a Chrome
trace that Perfetto (ui.perfetto.dev) and chrome://tracing open, and that TensorBoard's
profile plugin (torch-tb-profiler) lists as worker "rank-N" of run "torch_profile" when
pointed at the directory above. CPU activity always, CUDA kernels where there is a GPU.

The loop's one entry point is `StepProfiler.step(done)`, a context around each training
step; `close()` ends a trace a stopped run left open (what it recorded is written).
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from typing import Iterator, Optional

import torch

from megaulysses.config import Config
from megaulysses.config.fields import filled

log = logging.getLogger(__name__)


def trace_dir(tensorboard_dir: str) -> str:
    """Where the traces go: torch_profile beside the tensorboard directory (Megatron-LM)."""
    return os.path.join(os.path.dirname(os.path.abspath(tensorboard_dir)), "torch_profile")


def trace_path(tensorboard_dir: str, rank: int) -> str:
    # ".pt.trace.json" is what TensorBoard's profile plugin looks for; gzip: traces of
    # real models run to hundreds of MB, and every viewer reads the compressed file
    return os.path.join(trace_dir(tensorboard_dir), f"rank-{rank}.pt.trace.json.gz")


class StepProfiler:
    """Traces the steps after `start` iterations up to iteration `end` on this rank, if
    it is one of --profile-ranks; otherwise every call is a no-op."""

    def __init__(self, cfg: Config, rank: int):
        lg = cfg.log
        self.on = lg.profile and (not lg.profile_ranks or rank in lg.profile_ranks)  # []: all
        self.start, self.end = lg.profile_step_start, lg.profile_step_end
        # the rules make --profile need --tensorboard-dir (the traces go beside it)
        self.path = (trace_path(filled(lg.tensorboard_dir, "--tensorboard-dir"), rank)
                     if self.on else None)
        self.prof: Optional[torch.profiler.profile] = None

    @contextlib.contextmanager
    def step(self, done: int) -> Iterator[None]:
        """Around the step that follows `done` iterations."""
        if self.on and self.prof is None and self.start - 1 <= done < self.end:
            self._begin(done)
        yield
        if self.prof is None:
            return
        if done + 1 >= self.end:
            self.close()
        else:  # each step its own ProfilerStep#N span (TensorBoard's step view)
            self.prof.step()

    def _begin(self, done: int) -> None:
        # As Megatron-LM: the step before the trace warms the profiler up (not where a
        # trace starts at the first step, or a resumed run is past it); a schedule also
        # marks each traced step (ProfilerStep#N, TensorBoard's step view).
        first = max(done, self.start)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's warning of a schedule without warm-up
            schedule = torch.profiler.schedule(wait=0, warmup=first - done,
                                               active=self.end - first, repeat=1)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=activities, schedule=schedule,
                                           record_shapes=True)
        self.prof.start()
        log.info("profiler: tracing iterations %d to %d", first + 1, self.end)

    def close(self) -> None:
        """Stop a trace in progress and write what it recorded."""
        if self.prof is None:
            return
        prof, self.prof, path = self.prof, None, self.path
        assert path is not None, "a trace runs only where the profiler is on"
        prof.stop()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        prof.export_chrome_trace(path)
        log.info("profiler: trace written to %s", path)
