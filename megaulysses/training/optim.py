"""AdamW with Megatron's parameter groups, the LR schedule, and fp16 loss scaling."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from megaulysses.config import TrainConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on biases and norm weights (every 1-D parameter), as in Megatron.

    Under tensor parallelism DTensor and plain parameters go to separate groups: a fused
    or foreach kernel cannot take both kinds in one call.
    """
    groups: dict = {}
    for p in model.parameters():
        if p.requires_grad:
            key = (p.ndim >= 2, isinstance(p, DTensor))
            groups.setdefault(key, []).append(p)
    return [{"params": ps, "weight_decay": weight_decay if decay else 0.0}
            for (decay, _), ps in sorted(groups.items(), key=lambda kv: (not kv[0][0], kv[0][1]))]


def build_optimizer(model: nn.Module, t: TrainConfig) -> torch.optim.Optimizer:
    # fused=True runs one kernel per step on CPU and CUDA; fall back where unsupported
    # (e.g. DTensor parameters on some backends) rather than fail.
    kwargs = dict(lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)
    groups = param_groups(model, t.weight_decay)
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(param_groups(model, t.weight_decay), **kwargs)


class LRSchedule:
    """Linear warmup to --lr, then cosine/linear/constant decay to --min-lr.

    A pure function of the iteration, so resuming needs no scheduler state.
    """

    def __init__(self, t: TrainConfig):
        self.max_lr, self.min_lr = t.lr, t.min_lr
        self.warmup = t.lr_warmup_iters
        self.decay_iters = t.lr_decay_iters or t.train_iters
        self.style = t.lr_decay_style

    def __call__(self, iteration: int) -> float:
        """LR used for the step that produces iteration `iteration + 1`."""
        if self.warmup > 0 and iteration < self.warmup:
            return self.max_lr * (iteration + 1) / self.warmup
        if self.style == "constant" or iteration >= self.decay_iters:
            return self.max_lr if self.style == "constant" else self.min_lr
        frac = (iteration - self.warmup) / max(1, self.decay_iters - self.warmup)
        if self.style == "linear":
            coeff = 1.0 - frac
        else:
            coeff = 0.5 * (1.0 + math.cos(math.pi * frac))
        return self.min_lr + coeff * (self.max_lr - self.min_lr)


def set_lr(optimizer: torch.optim.Optimizer, lr: float):
    for g in optimizer.param_groups:
        g["lr"] = lr


class LossScaler:
    """Loss scale for fp16: static (--loss-scale) or dynamic, as in Megatron.

    Dynamic: an overflow (non-finite grad norm) skips the step and, after `hysteresis`
    overflows, halves the scale; `window` clean steps in a row double it.
    """

    def __init__(self, t: TrainConfig):
        self.dynamic = t.loss_scale is None
        self.scale = t.initial_loss_scale if self.dynamic else t.loss_scale
        self.min_scale, self.window, self.hysteresis = (t.min_loss_scale, t.loss_scale_window,
                                                        t.hysteresis)
        self.clean_steps = 0
        self.hysteresis_left = self.hysteresis

    def update(self, overflow: bool):
        if not self.dynamic:
            return
        if overflow:
            self.clean_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
                self.hysteresis_left = self.hysteresis
            return
        self.clean_steps += 1
        if self.clean_steps % self.window == 0:
            self.scale *= 2.0
            self.hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps,
                "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, state: dict):
        self.scale = state["scale"]
        self.clean_steps = state["clean_steps"]
        self.hysteresis_left = state["hysteresis_left"]


@torch.no_grad()
def unscale_and_clip(params, inv_scale: float, max_norm: float, exclude=(),
                     sum_squares=None) -> float:
    """Unscale grads (fp16), return the global grad norm; clip when max_norm > 0.

    Gradients must already be reduced over data/sequence ranks and be in their
    parameter's layout. `exclude`: parameters clipped but not counted (a copy counted
    elsewhere: the tied embedding on the last pipeline stage). `sum_squares(sharded,
    whole)`: on a grid, turns this rank's squared norms of its tensor-parallel shards and
    of its whole (replicated) gradients into the global squared norm (summing the first
    over tp, and both over the pipeline stages). A non-finite norm is returned as is
    (the caller skips the step, grads untouched).
    """
    skip = {id(p) for p in exclude}
    grads = [p.grad for p in params if p.grad is not None]
    if inv_scale != 1.0:
        for kind in _by_kind(grads):
            torch._foreach_mul_(kind, inv_scale)
    norm = _global_norm([p.grad for p in params if p.grad is not None and id(p) not in skip],
                        sum_squares)
    if max_norm > 0 and math.isfinite(norm) and norm > max_norm:
        for kind in _by_kind(grads):
            torch._foreach_mul_(kind, max_norm / (norm + 1e-6))
    return norm


def _global_norm(grads: list, sum_squares) -> float:
    if not grads:
        return 0.0
    if sum_squares is None:  # one process: every gradient is whole and here
        return float(torch.nn.utils.get_total_norm(grads))
    # Local tensors, reduced by the caller: a DTensor norm of a list mixing sharded and
    # replicated gradients is not reliably the global one.
    sharded = [g.to_local() for g in grads if _is_sharded(g)]
    whole = [g.to_local() if isinstance(g, DTensor) else g for g in grads if not _is_sharded(g)]
    zero = torch.zeros((), device=grads[0].device)
    sharded_sq, whole_sq = (torch.nn.utils.get_total_norm(k).float() ** 2 if k else zero.clone()
                            for k in (sharded, whole))
    return float(sum_squares(sharded_sq, whole_sq).sqrt())


def _is_sharded(g) -> bool:
    return isinstance(g, DTensor) and any(pl.is_shard() for pl in g.placements)


def _by_kind(grads: list) -> list[list]:
    """DTensor and plain gradients apart: a foreach kernel takes one kind per call."""
    kinds = ([g for g in grads if isinstance(g, DTensor)],
             [g for g in grads if not isinstance(g, DTensor)])
    return [k for k in kinds if k]
