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
    return adamw(param_groups(model, t.weight_decay), t)


def adamw(groups: list[dict], t: TrainConfig) -> torch.optim.Optimizer:
    # fused=True runs one kernel per step on CPU and CUDA; fall back where unsupported
    # (e.g. DTensor parameters on some backends) rather than fail.
    kwargs = dict(lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW([dict(g) for g in groups], **kwargs)


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


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
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

    def update(self, overflow: bool) -> None:
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

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"]
        self.clean_steps = state["clean_steps"]
        self.hysteresis_left = state["hysteresis_left"]
