"""--check-for-spiky-loss and --check-for-large-grads: Megatron-LM's result validation in
its default mode (--rerun-mode validate_results) for these two checks, which do not stop
a run there (its `fatal=False`).

What Megatron-LM does, and so this module: a value is unexpectedly large when it is at
least 10 times (its SPIKY_LOSS_FACTOR, and the threshold of its large-grads check) the
largest absolute value of the first 100 values seen (values of the job's first iteration
are not looked at; NaN and Inf are left to --check-for-nan-in-loss-and-grad). Such a step
is run again in place before the optimizer steps: the same micro-batches, the RNG states
as they were before the step (so dropout draws alike). The two results are compared
(Megatron-LM's relative difference |a - b| / |(a + b) / 2|; tolerance 0 for the loss,
0.001 for the gradient norm, as there): reproducible means the value is what the model
computes ("likely correct, or an application error"), not reproducible a transient fault
of the device. Either way the run goes on with the rerun's gradients, and the line says
which. (Megatron-LM's second opinion, a rerun on another GPU from a checkpoint, is only
for its fatal checks.)

Here the values are the step's global ones, which every rank holds alike (the logged
loss, the gradient norm that clipping uses), so every rank decides alike with no extra
collective; Megatron-LM looks at each rank's micro-batch loss sums and gradient-bucket
norms before the data-parallel reduction, and reruns when any rank asks.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

log = logging.getLogger(__name__)

FACTOR = 10.0  # Megatron-LM's SPIKY_LOSS_FACTOR, and its large-grads threshold
SAMPLES = 100  # values that set the maximum a later value is compared with


@dataclass
class LargeValue:
    """Megatron-LM's is_unexpectedly_large for one quantity."""
    name: str
    message: str  # Megatron-LM's wording of the failure
    tolerance: float  # of the rerun's comparison
    samples: int = SAMPLES
    count: int = 0
    max: float = 0.0

    def is_large(self, value: float) -> bool:
        value = abs(value)
        if not math.isfinite(value):
            return False
        if self.count < self.samples:
            self.count += 1
            self.max = max(self.max, value)
            if self.count == self.samples:
                log.info("%s: the largest of the first %d values is %.6g (a value of %g "
                         "times it reruns its step)", self.name, self.samples, self.max,
                         FACTOR)
            return False
        return value >= self.max * FACTOR


def relative_difference(a: float, b: float) -> float:
    """Megatron-LM's comparison of a result and its rerun's."""
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs((a - b) / (a + b) * 2)


@dataclass
class ResultChecks:
    """The step's reviewer: `review(loss, grad_norm)` before the optimizer steps says
    whether to run the step again (train_step restores `rng` and does)."""
    spiky_loss: bool = False
    large_grads: bool = False
    rank: int = 0
    samples: int = SAMPLES  # Megatron-LM's; tests take fewer
    checks: list = field(default_factory=list)
    started: bool = False  # the job's first step is not looked at (Megatron-LM's rule)
    first: Optional[tuple] = None  # (check, the suspicious step's values) while rerunning
    rng: Optional[dict] = None

    def __post_init__(self):
        if self.spiky_loss:
            self.checks.append(LargeValue("loss", "Spiky loss", 0.0, self.samples))
        if self.large_grads:
            self.checks.append(LargeValue("grad norm", "found unexpected large grads", 0.001,
                                          self.samples))

    @property
    def active(self) -> bool:
        return bool(self.checks)

    def save_rng(self) -> None:
        """The RNG states a rerun starts from (before the step's first forward)."""
        self.rng = {"python": random.getstate(), "numpy": np.random.get_state(),
                    "torch": torch.get_rng_state(),
                    **({"cuda": torch.cuda.get_rng_state_all()}
                       if torch.cuda.is_initialized() else {})}

    def restore_rng(self) -> None:
        random.setstate(self.rng["python"])
        np.random.set_state(self.rng["numpy"])
        torch.set_rng_state(self.rng["torch"])
        if "cuda" in self.rng:
            torch.cuda.set_rng_state_all(self.rng["cuda"])

    def review(self, loss: float, grad_norm: float, iteration: int) -> bool:
        """True: run this step again before stepping. The rerun's own review compares."""
        values = {"loss": loss, "grad norm": grad_norm}
        if self.first is not None:
            self._diagnose(values, iteration)
            return False
        if not self.started:
            self.started = True
            return False
        for check in self.checks:
            if check.is_large(values[check.name]):
                self.first = (check, values)
                if self.rank == 0:
                    log.warning("iteration %d: unexpected result %s %.6g, >= %g times the "
                                "largest of the first %d (%.6g; message='%s'): rerunning the "
                                "step to check its reproducibility", iteration, check.name,
                                values[check.name], FACTOR, check.samples, check.max,
                                check.message)
                return True
        return False

    def _diagnose(self, values: dict, iteration: int) -> None:
        check, first = self.first
        self.first = None
        a, b = first[check.name], values[check.name]
        if self.rank != 0:
            return
        if relative_difference(a, b) > check.tolerance:
            verdict = (f"not reproducible within {check.tolerance} ({b:.6g} != {a:.6g}): "
                       "possible transient error")
        else:
            verdict = (f"reproducible within {check.tolerance} ({b:.6g} = {a:.6g}): likely a "
                       "correct result, or an application error")
        log.warning("iteration %d: rerun: %s %s; continuing normal execution with the "
                    "rerun's gradients (message='%s' is not fatal)", iteration, check.name,
                    verdict, check.message)
