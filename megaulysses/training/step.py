"""One training step and one evaluation, on any grid: micro-batches, the exact loss
reduction, gradient reduction, clipping and the optimizer step.

Loss contract (the same on every grid): the loss of an iteration is
sum(token losses * loss mask) / sum(loss mask) over the whole global batch. The token
count is known before any forward (it only needs the masks), so each micro-batch's
backward uses the final denominator and the accumulated gradient is exactly the gradient
of the global mean loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megaulysses.data.loader import BatchBuilder
from megaulysses.parallel.comm import Comm
from megaulysses.parallel.dims import DP_SP, PP
from megaulysses.parallel.grad_norm import unscale_and_clip
from megaulysses.parallel.pipeline import Pipeline
from megaulysses.parallel.tensor import step_context as tp_step_context
from megaulysses.parallel.zero import Zero
from megaulysses.training.optim import LossScaler
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
               check_nan: bool = True, fault: Optional[Callable] = None) -> StepResult:
    """One iteration. `check_nan`: a non-finite loss or gradient norm on any rank skips
    the step on every rank. `fault`: a test's injection, run on the gradients mid-step."""
    with tp_step_context(comm):
        # The global loss-token count is known before any forward: every backward divides
        # by it, so the summed gradients are exactly those of the global mean loss.
        tokens = global_sum(comm, sum(float(b["loss_mask"].sum()) for b in batches), device)
        denom = max(tokens, 1.0)  # a batch with no loss tokens gives loss 0, not NaN
        if pipeline is None:
            loss_sum = _forward_backward(model, batches, scaler.scale / denom, device, dtype,
                                         zero)
        else:
            with autocast(device, dtype):
                loss_sum = pipeline.step([_on(b, device) for b in batches], scaler.scale / denom)
        norm, skipped, nonfinite = _finish_grads_and_step(
            zero, scaler, clip_grad, comm, pipeline, math.isfinite(loss_sum), check_nan, fault)
    loss = global_sum(comm, loss_sum, device, (DP_SP, PP)) / denom
    return StepResult(loss, norm, skipped, int(tokens), nonfinite)


def _forward_backward(model, batches, grad_scale: float, device, dtype, zero: Zero) -> float:
    """Every micro-batch, one after the other; gradients of sum(losses) * grad_scale."""
    loss_sum = torch.zeros((), device=device)
    for i, b in enumerate(batches):
        b = _on(b, device)
        with autocast(device, dtype):
            losses = model(b["tokens"], b["position_ids"], b["labels"],
                           b.get("documents"))  # [b, s/sp] fp32
        micro_sum = (losses * b["loss_mask"]).sum()
        zero.before_backward(last=i == len(batches) - 1)  # the last one reduces as it runs
        (micro_sum * grad_scale).backward()
        loss_sum += micro_sum.detach()
    return float(loss_sum)


def _finish_grads_and_step(zero: Zero, scaler, clip_grad, comm, pipeline, loss_finite: bool,
                           check_nan: bool, fault=None) -> tuple[float, bool, bool]:
    """Reduce gradients over dp x sp (and the tied pair), clip by the global norm and
    step, unless a loss or the norm is not finite on any rank: (norm, skipped, non-finite).
    Every rank decides alike (one tiny all-reduce): a NaN that only one rank sees must not
    step the others alone."""
    zero.finish_grads()
    if fault is not None:
        fault([p.tensor for p in zero.grad_parts()])
    if pipeline is not None:
        pipeline.sync_tied_grads(zero.grad_of)  # after the reduction: both copies alike
    excluded = pipeline.norm_excluded if pipeline is not None else []
    norm = unscale_and_clip(zero.grad_parts(excluded), 1.0 / scaler.scale, clip_grad, comm)
    nonfinite = comm.any_rank(not (loss_finite and math.isfinite(norm)))
    # fp16 skips an overflow whatever --check-for-nan-in-loss-and-grad says: its loss
    # scale must fall
    skipped = nonfinite and (check_nan or isinstance(scaler, LossScaler))
    if not skipped:
        zero.step()
    scaler.update(overflow=nonfinite)
    zero.zero_grad()
    return norm, skipped, nonfinite


@torch.no_grad()
def evaluate(model: torch.nn.Module, builder: BatchBuilder, first_sample: int, iters: int,
             device: torch.device, dtype: torch.dtype, comm: Comm,
             pipeline: Optional[Pipeline] = None) -> float:
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
        model.train()
        total = global_sum(comm, total, device, (DP_SP, PP))
        return total / max(global_sum(comm, count, device), 1.0)


def _eval_micro(model, b: dict) -> float:
    losses = model(b["tokens"], b["position_ids"], b["labels"], b.get("documents"))  # [b, s/sp]
    return float((losses * b["loss_mask"]).sum())
