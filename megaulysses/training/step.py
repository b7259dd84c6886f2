"""One training step and one evaluation, on any grid: micro-batches, the exact loss
reduction, gradient reduction, clipping and the optimizer step.

Loss contract (the same on every grid): the logged loss of an iteration is
sum(token losses * loss mask) / sum(loss mask) over the whole global batch. The gradient
is that of Megatron-LM's loss: the mean of the micro-batches' own token means, or with
--calculate-per-token-loss the global per-token mean (loss_weights.py). Each micro-batch's
weight is known before any forward (it only needs the masks), so each backward uses its
final factor and the accumulated gradient is exactly the gradient of that loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megaulysses.data.loader import BatchBuilder
from megaulysses.parallel.comm import Comm
from megaulysses.parallel.dims import DP_SP, PP
from megaulysses.parallel.grad_norm import num_zeros, params_norm, unscale_and_clip
from megaulysses.parallel.pipeline import Pipeline
from megaulysses.parallel.timers import Timers
from megaulysses.parallel.tensor import step_context as tp_step_context
from megaulysses.parallel.zero import Zero
from megaulysses.training.loss_weights import micro_batch_weights
from megaulysses.training.optim import LossScaler
from megaulysses.training.result_checks import ResultChecks
from megaulysses.training.run import autocast


class NoScaler:
    """The loss scaler of bf16 and fp32 runs: scale 1, nothing to adjust."""
    scale = 1.0

    def update(self, overflow: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {}


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    skipped: bool
    tokens: int
    nonfinite: bool = False  # the loss or gradient norm was not finite on some rank
    params_norm: Optional[float] = None  # --log-params-norm: after the step
    num_zeros: Optional[int] = None  # --log-num-zeros-in-grad: of the reduced gradients


def empty_unused_memory(level: int, at: int) -> None:
    """--empty-unused-memory-level: torch.cuda.empty_cache() where Megatron-LM calls it
    (level >= 1 after the forward and backward passes of a training step and of each
    evaluation iteration, >= 2 also after the optimizer step): the CUDA caching allocator
    hands its unused blocks back to the device. Nothing to do without CUDA."""
    if level >= at and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _on(b: dict, device) -> dict:
    """A micro-batch (tokens, position_ids, labels, loss_mask) moved to `device`."""
    return {k: v.to(device) for k, v in b.items()}


def global_sum(comm: Comm, value: float, device: torch.device,
               dims: tuple[str, ...] = (DP_SP,)) -> float:
    """Sum of a per-rank number over the ranks that see different tokens (dp x sp), and
    over PP for numbers only the last pipeline stage knows (losses)."""
    t = torch.tensor(value, dtype=torch.float64, device=device)
    for dim in dims:
        comm.all_reduce_sum(t, dim)
    return float(t)


def train_step(model: torch.nn.Module, batches: list[dict], zero: Zero,
               scaler: LossScaler | NoScaler, clip_grad: float, device: torch.device,
               dtype: torch.dtype, comm: Comm, pipeline: Optional[Pipeline] = None,
               check_nan: bool = True, fault: Optional[Callable] = None,
               per_token_loss: bool = False, log_params_norm: bool = False,
               log_num_zeros: bool = False, checks: Optional[ResultChecks] = None,
               iteration: int = 0, empty_cache_level: int = 0) -> StepResult:
    """One iteration. `check_nan`: a non-finite loss or gradient norm on any rank skips
    the step on every rank (where `checks` has not stopped the run first: its NaN check
    lets only the job's first step through). `fault`: a test's injection, run on the
    gradients mid-step (on a rerun too).
    `per_token_loss`: --calculate-per-token-loss (loss_weights.py). `log_params_norm`,
    `log_num_zeros`: measure them too (the flags of those names). `checks`:
    --check-for-spiky-loss / --check-for-large-grads / --check-for-nan-in-loss-and-grad,
    which may run the step `iteration` again before the optimizer steps, or stop the run
    (ResultRejected, raised alike on every rank; result_checks.py). `empty_cache_level`:
    --empty-unused-memory-level. With
    --log-timers-to-tensorboard (`comm.stats.timers` on) its forward, backward and
    optimizer phases are timed (under a pipeline also the schedule's p2p time between)."""
    timers = comm.stats.timers
    # Each micro-batch's weight is known before any forward: every backward uses its
    # final factor, so the summed gradients are exactly those of the iteration's loss.
    weights, tokens = micro_batch_weights(batches, comm, device, per_token_loss)
    grad_scales = [scaler.scale * w for w in weights]
    review = _reviewer(checks, comm, device, tokens, iteration)
    outcome = None
    while outcome is None:  # once, or twice where `checks` asks for a rerun
        with tp_step_context(comm, _shapes(batches)):  # each pass counts its collectives
            if pipeline is None:
                loss_sum = _forward_backward(model, batches, grad_scales, device, dtype, zero,
                                             timers)
            else:
                with autocast(device, dtype):
                    loss_sum = pipeline.step([_on(b, device) for b in batches], grad_scales)
            empty_unused_memory(empty_cache_level, 1)
            with timers("optimizer", device.type):
                outcome = _finish_grads_and_step(
                    zero, scaler, clip_grad, comm, pipeline, loss_sum, check_nan, fault,
                    count_zeros=log_num_zeros, review=review)
        if outcome is None:
            assert checks is not None, "only a review (`checks`) asks for a rerun"
            checks.restore_rng()
    norm, skipped, nonfinite, zeros = outcome
    empty_unused_memory(empty_cache_level, 2)
    # logged: the global per-token mean in either mode, as Megatron-LM logs it; a batch
    # with no loss tokens gives loss 0, not NaN
    loss = global_sum(comm, loss_sum, device, (DP_SP, PP)) / max(tokens, 1.0)
    pnorm = params_norm(zero.param_parts(_norm_excluded(pipeline)), comm) \
        if log_params_norm else None
    return StepResult(loss, norm, skipped, int(tokens), nonfinite, pnorm, zeros)


def _reviewer(checks: Optional[ResultChecks], comm: Comm, device: torch.device,
              tokens: float, iteration: int) -> Optional[Callable]:
    """`checks`' review of a step's (local loss sum, gradient norm, non-finite anywhere):
    True asks for a rerun. None where no check is on."""
    if checks is None or not checks.active:
        return None
    checks.save_rng()  # a rerun draws the same dropout

    def review(local_loss_sum: float, norm: float, nonfinite: bool) -> bool:
        if not checks.wants_values(nonfinite):  # alike on every rank
            return False  # a finite step, nothing to look at: no extra collective
        loss = global_sum(comm, local_loss_sum, device, (DP_SP, PP)) / max(tokens, 1.0)
        if nonfinite and math.isfinite(loss) and math.isfinite(norm):
            # a norm only another rank saw non-finite (a data-parallel replica's fault
            # after the reduction): every rank's review must decide alike
            norm = math.nan
        return checks.review(loss, norm, iteration)
    return review


def _norm_excluded(pipeline: Optional[Pipeline]) -> list:
    """Parameters whose copy another rank counts (the tied embedding of the last stage)."""
    return pipeline.norm_excluded if pipeline is not None else []


def _forward_backward(model, batches, grad_scales: list[float], device, dtype,
                      zero: Zero, timers: Timers) -> float:
    """Every micro-batch, one after the other; gradients of sum_i(losses_i * grad_scales[i])."""
    loss_sum = torch.zeros((), device=device)
    for i, b in enumerate(batches):
        b = _on(b, device)
        with timers("forward", device.type):
            with autocast(device, dtype):
                losses = model(b["tokens"], b["position_ids"], b["labels"],
                               b.get("documents"))  # [b, s/sp] fp32
            micro_sum = (losses * b["loss_mask"]).sum()
        with timers("backward", device.type):
            zero.before_backward(last=i == len(batches) - 1)  # the last one reduces as it runs
            (micro_sum * grad_scales[i]).backward()
        loss_sum += micro_sum.detach()
    return float(loss_sum)


def _finish_grads_and_step(zero: Zero, scaler, clip_grad, comm, pipeline, loss_sum: float,
                           check_nan: bool, fault=None, count_zeros: bool = False,
                           review: Optional[Callable[[float, float, bool], bool]] = None
                           ) -> Optional[tuple[float, bool, bool, Optional[int]]]:
    """Reduce gradients over dp x sp (and the tied pair), clip by the global norm and
    step, unless a loss or the norm is not finite on any rank: (norm, skipped, non-finite,
    the zero gradient entries when `count_zeros`, else None). None, with the gradients
    cleared and nothing stepped, where `review(this rank's loss sum, norm, non-finite on
    any rank)` asks for the
    step to be run again.
    Every rank decides alike (one tiny all-reduce): a NaN that only one rank sees must not
    step the others alone."""
    zero.finish_grads()
    if fault is not None:
        fault([p.tensor for p in zero.grad_parts()])
    if pipeline is not None:
        pipeline.sync_tied_grads(zero.grad_of)  # after the reduction: both copies alike
    excluded = _norm_excluded(pipeline)
    norm = unscale_and_clip(zero.grad_parts(excluded), 1.0 / scaler.scale, clip_grad, comm)
    zeros = num_zeros(zero.grad_parts(excluded), comm) if count_zeros else None
    nonfinite = comm.any_rank(not (math.isfinite(loss_sum) and math.isfinite(norm)))
    # reviewed even when not finite: --check-for-nan-in-loss-and-grad's rerun, or its stop
    # (a non-finite value is never "large")
    if review is not None and review(loss_sum, norm, nonfinite):
        zero.zero_grad()
        return None
    # fp16 skips an overflow whatever --check-for-nan-in-loss-and-grad says: its loss
    # scale must fall
    skipped = nonfinite and (check_nan or isinstance(scaler, LossScaler))
    if not skipped:
        zero.step()
    scaler.update(overflow=nonfinite)
    zero.zero_grad()
    return norm, skipped, nonfinite, zeros


def _shapes(batches: list[dict]) -> tuple:
    """What fixes the collectives of a step's tensor-parallel forward and backward."""
    return tuple((k, tuple(v.shape)) for b in batches for k, v in b.items()
                 if isinstance(v, torch.Tensor))


@torch.no_grad()
def evaluate(model: torch.nn.Module, builder: BatchBuilder, first_sample: int, iters: int,
             device: torch.device, dtype: torch.dtype, comm: Comm,
             pipeline: Optional[Pipeline] = None, empty_cache_level: int = 0) -> float:
    """Token-weighted mean loss over `iters` global batches starting at `first_sample`.
    Its collectives are not counted: the logged bytes are those of training steps."""
    with tp_step_context(comm), comm.stats.paused():
        model.eval()
        total, count = 0.0, 0.0
        for i in range(iters):
            start = first_sample + i * builder.gbs
            batches = [_on(b, device) for b in builder.micro_batches(start)]
            with autocast(device, dtype):
                total += (pipeline.evaluate(batches) if pipeline is not None
                          else sum(_eval_micro(model, b) for b in batches))
            count += sum(float(b["loss_mask"].sum()) for b in batches)
            empty_unused_memory(empty_cache_level, 1)
        model.train()
        total = global_sum(comm, total, device, (DP_SP, PP))
        return total / max(global_sum(comm, count, device), 1.0)


def _eval_micro(model, b: dict) -> float:
    losses = model(b["tokens"], b["position_ids"], b["labels"], b.get("documents"))  # [b, s/sp]
    return float((losses * b["loss_mask"]).sum())
