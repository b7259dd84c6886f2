"""AdamW with Megatron's parameter groups, the LR schedule, and fp16 loss scaling."""

from __future__ import annotations

import functools
import logging
import math
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices as _fused_devices

from megaulysses.config import TrainConfig
from megaulysses.config.fields import filled
from megaulysses.config.schedule import decoupled_min_lr, schedule_position

log = logging.getLogger(__name__)

# Megatron-LM's is_embedding_or_output_parameter, which --decoupled-lr applies to: the word
# embedding (and its tied copy on a pipeline's last stage, under the same name) and the
# untied output layer. The learned position embedding is not one of them.
DECOUPLED = ("embed.word.weight", "head.output.weight")


def _grouped(model: nn.Module, decoupled: bool) -> list[tuple[tuple[bool, bool, bool], list]]:
    """The trainable parameters by (decoupled learning rate, weight decay, DTensor), in the
    optimizer's group order: decayed first, the decoupled groups last."""
    from torch.distributed.tensor import DTensor  # here: --dry-run imports this module
    groups: dict = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            key = (decoupled and name in DECOUPLED, p.ndim >= 2, isinstance(p, DTensor))
            groups.setdefault(key, []).append(p)
    return sorted(groups.items(), key=lambda kv: (kv[0][0], not kv[0][1], kv[0][2]))


def param_groups(model: nn.Module, weight_decay: float, decoupled: bool = False) -> list[dict]:
    """No weight decay on biases and norm weights (every 1-D parameter), as in Megatron.
    `decoupled` (--decoupled-lr): the embedding and output layer in groups of their own.

    Under tensor parallelism DTensor and plain parameters go to separate groups: a fused
    or foreach kernel cannot take both kinds in one call.
    """
    return [{"params": ps, "weight_decay": weight_decay if decay else 0.0}
            for (_, decay, _), ps in _grouped(model, decoupled)]


def lr_bounds(model: nn.Module, t: TrainConfig) -> list[tuple[float, float]]:
    """(peak, floor) learning rate of each group of `param_groups(model, ...)` as the run
    builds them: --lr and --min-lr, or --decoupled-lr and --decoupled-min-lr. Kept here,
    not in the groups: a key there would be saved with the optimizer and change what
    a checkpoint must hold."""
    peak = t.decoupled_lr  # None: every group on --lr
    return [(peak, decoupled_min_lr(t)) if key[0] and peak is not None else (t.lr, t.min_lr)
            for key, _ in _grouped(model, peak is not None)]


def build_optimizer(model: nn.Module, t: TrainConfig) -> torch.optim.Optimizer:
    return adamw(param_groups(model, t.weight_decay), t)


def adamw(groups: list[dict], t: TrainConfig) -> torch.optim.Optimizer:
    """torch's fused AdamW: one multi-tensor kernel per device and dtype, on CPU and CUDA
    (model/ops/kernels.py says why not apex's FusedAdam). Where torch has no fused kernel
    for a parameter (its device or dtype) its foreach kernels for all, said in the log;
    never the for-loop (a few kernels per parameter from Python, torch's default on CPU).
    Decided here: torch would refuse only at the first step."""
    kwargs: dict[str, Any] = dict(lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)
    fused = _fused_devices()
    refused = sorted({f"{p.dtype} on {p.device.type}" for g in groups for p in g["params"]
                      if not (p.is_floating_point() and p.device.type in fused)})
    if not refused:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    _said_once(f"AdamW: torch has no fused kernel for parameters of {', '.join(refused)}: "
               f"its foreach kernels instead")
    return torch.optim.AdamW(groups, foreach=True, **kwargs)


@functools.lru_cache(maxsize=None)
def _said_once(message: str) -> None:
    log.info("%s", message)  # a ZeRO optimizer may build several AdamWs


class LRSchedule:
    """Megatron-LM's learning-rate schedule: linear warmup to the peak, then cosine, linear
    or constant decay to the floor, in iterations (--train-iters) or in samples consumed
    (--train-samples). Each optimizer group has its own peak and floor (`bounds`: --lr and
    --min-lr, or --decoupled-lr and --decoupled-min-lr) on the same shape.

    A pure function of where the run stands, so resuming needs no scheduler state. The step
    that starts `done` units in (iterations, or samples consumed) runs at the schedule's
    value at `done`, as Megatron-LM's OptimizerParamScheduler, which steps after the
    update: the warmup rises linearly from --lr-warmup-init (0: the first step then makes
    no update) to the peak at `done == warmup`, then decays.
    """

    def __init__(self, t: TrainConfig, bounds: Optional[list[tuple[float, float]]] = None):
        self.t = t
        if t.train_samples is None:
            self.warmup = t.lr_warmup_iters
            self.decay = t.lr_decay_iters or filled(t.train_iters, "--train-iters")
        else:
            self.warmup = t.lr_warmup_samples
            self.decay = t.lr_decay_samples or t.train_samples
        self.style = t.lr_decay_style
        self.bounds = bounds or [(t.lr, t.min_lr)]

    def __call__(self, done: int, size: int = 1) -> float:
        """--lr's schedule: the LR of the step after `done` units that takes `size` more."""
        return self.lr(done, size, self.t.lr, self.t.min_lr)

    def lr(self, done: int, size: int, peak: float, floor: float) -> float:
        # `size` (the step's own units) does not move it: kept for the callers' symmetry
        if self.warmup > 0 and done <= self.warmup:
            start = self.t.lr_warmup_init
            return start + (peak - start) * done / self.warmup
        if self.style == "constant" or done >= self.decay:
            return peak if self.style == "constant" else floor
        frac = (done - self.warmup) / max(1, self.decay - self.warmup)
        if self.style == "linear":
            coeff = 1.0 - frac
        else:
            coeff = 0.5 * (1.0 + math.cos(math.pi * frac))
        return floor + coeff * (peak - floor)

    def group_lrs(self, iteration: int, consumed: int, batch: int) -> list[float]:
        """Each group's LR for the step after `iteration` steps and `consumed` samples that
        takes a global batch of `batch` samples."""
        done, size = schedule_position(self.t, iteration, consumed, batch)
        return [self.lr(done, size, peak, floor) for peak, floor in self.bounds]

    def logged(self, iteration: int, consumed: int, batch: int) -> dict[str, float]:
        """What the log shows of that step: --lr's schedule, and --decoupled-lr's."""
        done, size = schedule_position(self.t, iteration, consumed, batch)
        out = {"lr": self.lr(done, size, self.t.lr, self.t.min_lr)}
        if self.t.decoupled_lr is not None:
            out["decoupled_lr"] = self.lr(done, size, self.t.decoupled_lr,
                                          decoupled_min_lr(self.t))
        return out


def set_lr(optimizer: torch.optim.Optimizer, lrs: list[float]) -> None:
    """`lrs`: one per group (LRSchedule.group_lrs)."""
    assert len(lrs) == len(optimizer.param_groups), (len(lrs), len(optimizer.param_groups))
    for g, lr in zip(optimizer.param_groups, lrs, strict=True):
        g["lr"] = lr


class LossScaler:
    """Loss scale for fp16: static (--loss-scale) or dynamic, as in Megatron.

    Dynamic: an overflow (non-finite grad norm) skips the step and, after `hysteresis`
    overflows, halves the scale; `window` clean steps in a row double it.
    """

    def __init__(self, t: TrainConfig):
        self.dynamic = t.loss_scale is None
        self.scale = t.initial_loss_scale if t.loss_scale is None else t.loss_scale
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
