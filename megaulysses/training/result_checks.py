"""Megatron-LM's result validation in its default mode (--rerun-mode validate_results):
--check-for-spiky-loss and --check-for-large-grads, which do not stop a run there (its
`fatal=False`), and --check-for-nan-in-loss-and-grad, which does (below).

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

--check-for-nan-in-loss-and-grad (on by default) is Megatron-LM's fatal check, decided by
--rerun-mode. validate_results (the default): a step whose loss or gradient norm is NaN or
Inf is run again in place the same way. Reproduced (not finite again):
every rank logs it, a checkpoint of the last completed iteration is saved (the optimizer
has not stepped) and the run exits 16 (EXIT_CODE_RESUME_TO_DISAMBIGUATE: Megatron-LM
resumes it on another GPU for a second opinion). Not reproduced: a transient fault, and
Megatron-LM still stops: exit 17 (EXIT_CODE_FAILED_ON_RESULT_VALIDATION), nothing saved,
the job resumes from its last checkpoint. The job's first step is not validated (as
there: no checkpoint could be taken before an optimizer step); Megatron-LM's optimizer
would step on the NaN, here that step is skipped. disabled: a non-finite value raises at
once, no rerun (exit 1). Our checkpoints keep no rerun state (as Megatron-LM's formats
other than torch_dist): a resume validates the step afresh.

Here the values are the step's global ones, which every rank holds alike (the logged
loss, the gradient norm that clipping uses; a norm that only one replica saw non-finite
is reviewed as NaN everywhere: step.py), so every rank decides alike with no extra
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

from megaulysses.config import TrainingError

log = logging.getLogger(__name__)

FACTOR = 10.0  # Megatron-LM's SPIKY_LOSS_FACTOR, and its large-grads threshold
SAMPLES = 100  # values that set the maximum a later value is compared with
RESUME_TO_DISAMBIGUATE = 16  # Megatron-LM's exit codes of a fatal validation
FAILED_ON_RESULT_VALIDATION = 17
NAN_MODES = ("off", "validate", "raise")  # no check; --rerun-mode validate_results; disabled


class ResultRejected(TrainingError):
    """A non-finite loss or gradient norm stops the run (every rank alike): `exit_code`,
    and whether a checkpoint of the last completed iteration is saved first."""

    def __init__(self, line: str, exit_code: int, checkpoint: bool):
        super().__init__(line)
        self.exit_code = exit_code
        self.checkpoint = checkpoint


@dataclass
class NonFinite:
    """Megatron-LM's fatal NaN / Inf check of one quantity."""
    name: str
    message: str


def nonfinite_check(values: dict) -> Optional[NonFinite]:
    """The first non-finite value, loss before gradient norm (Megatron-LM's order: its
    loss function validates before the gradients are reduced)."""
    for name, where in (("loss", "forward loss calculation"), ("grad norm", "grad norm")):
        value = values[name]
        if not math.isfinite(value):
            kind = "NaN" if math.isnan(value) else "Inf"
            return NonFinite(name, f"found {kind} in {where}")
    return None


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
    nan: str = "off"  # --check-for-nan-in-loss-and-grad under --rerun-mode: NAN_MODES
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
        return bool(self.checks) or self.nan != "off"

    def wants_values(self, nonfinite: bool) -> bool:
        """Whether review needs the step's values (the global loss costs a collective): a
        finite step under the NaN check alone has nothing to look at (it still counts as
        the job's first step, seen)."""
        if nonfinite or self.checks or self.first is not None:
            return True
        self.started = True
        return False

    def save_rng(self) -> None:
        """The RNG states a rerun starts from (before the step's first forward)."""
        self.rng = {"python": random.getstate(), "numpy": np.random.get_state(),
                    "torch": torch.get_rng_state(),
                    **({"cuda": torch.cuda.get_rng_state_all()}
                       if torch.cuda.is_initialized() else {})}

    def restore_rng(self) -> None:
        rng = self.rng
        assert rng is not None, "save_rng() runs before every step"
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng:
            torch.cuda.set_rng_state_all(rng["cuda"])

    def review(self, loss: float, grad_norm: float, iteration: int) -> bool:
        """True: run this step again before stepping. The rerun's own review compares."""
        values = {"loss": loss, "grad norm": grad_norm}
        if self.first is not None:
            self._diagnose(values, iteration)
            return False
        bad = nonfinite_check(values) if self.nan != "off" else None
        if bad is not None and self.nan == "raise":  # even the first step, as Megatron-LM
            raise ResultRejected(f"iteration {iteration}: unexpected result {bad.name} "
                                 f"{values[bad.name]} (message='{bad.message}'; --rerun-mode "
                                 "disabled)", 1, checkpoint=False)
        if not self.started:
            self.started = True
            return False
        if bad is not None:
            self.first = (bad, values)
            log.error("unexpected result %s %s on rank %d at iteration #%d (message='%s')",
                      bad.name, values[bad.name], self.rank, iteration, bad.message)
            if self.rank == 0:
                log.warning("Need to rerun step to check reproducibility of initial result")
            return True
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
        assert self.first is not None, "called on a rerun: the first run's result is kept"
        check, first = self.first
        self.first = None
        a, b = first[check.name], values[check.name]
        if isinstance(check, NonFinite):
            self._fatal(check, a, b, iteration)
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

    def _fatal(self, check: NonFinite, a: float, b: float, iteration: int) -> None:
        """The rerun of a non-finite step decides how the run stops (every rank logs its
        verdict, as Megatron-LM's log_failure; rank 0 says what happens next)."""
        where = f"rank {self.rank}, iteration #{iteration}"
        # Reproduced: non-finite again (Megatron-LM's comparison, except that NaN and Inf
        # match here: a rank may see NaN where a replica saw Inf, and all decide alike).
        if math.isfinite(b):
            log.error("%s: First rerun: unexpected result is not reproducible within the "
                      "tolerance (%s != %s)!", where, b, a)
            log.error("%s: Possible transient error!", where)
            if self.rank == 0:
                log.warning("Exiting now. The job can be resumed from a previous checkpoint")
            raise ResultRejected(
                f"iteration {iteration}: {check.name} {a} not reproduced by the rerun ({b}): "
                f"possible transient error (message='{check.message}'); exit "
                f"{FAILED_ON_RESULT_VALIDATION}, resume from the last checkpoint",
                FAILED_ON_RESULT_VALIDATION, checkpoint=False)
        log.error("%s: First rerun: unexpected result is reproducible within the tolerance "
                  "(%s = %s). Need to rerun on a different GPU to verify correctness.",
                  where, b, a)
        if self.rank == 0:
            log.warning("Saving a checkpoint and exiting now. Please resume the job from the "
                        "checkpoint to rerun the last iteration and establish a diagnostic")
        raise ResultRejected(
            f"iteration {iteration}: {check.name} {a} reproduced by the rerun "
            f"(message='{check.message}'); exit {RESUME_TO_DISAMBIGUATE} after saving the "
            f"last iteration's checkpoint: resume on another device to tell a fault from the "
            "model", RESUME_TO_DISAMBIGUATE, checkpoint=True)
