"""AdamW with Megatron's parameter groups, the LR schedule, and fp16 loss scaling."""

from __future__ import annotations

import math
from dataclasses import dataclass

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


@dataclass
class GradPart:
    """One tensor of this rank's (already reduced) gradients, as the optimizer will use it.

    `summed_over`: the mesh dims whose ranks hold the other pieces of the same gradient
    (their squared norms add up): "tp" for a tensor-parallel shard, "dp_sp" for a ZeRO
    shard; () for a whole gradient every rank of those dims holds alike. `counted`: False
    for a copy whose norm is counted elsewhere (the tied embedding on the last pipeline
    stage): clipped, not counted.
    """

    tensor: torch.Tensor
    summed_over: tuple = ()
    counted: bool = True


def grad_parts(params) -> list[GradPart]:
    """The gradients of one process's parameters."""
    return [GradPart(p.grad) for p in params if p.grad is not None]


@torch.no_grad()
def unscale_and_clip(parts: list[GradPart], inv_scale: float, max_norm: float,
                     comm=None) -> float:
    """Unscale grads (fp16), return the global grad norm; clip when max_norm > 0.

    `comm` (on a grid): each part's squared norm is summed over its `summed_over` dims,
    then over the pipeline stages. A non-finite norm is returned as is (the caller skips
    the step, grads untouched).
    """
    tensors = [p.tensor for p in parts]
    if inv_scale != 1.0 and tensors:
        torch._foreach_mul_(tensors, inv_scale)
    norm = _global_norm([p for p in parts if p.counted], comm)
    if max_norm > 0 and math.isfinite(norm) and norm > max_norm and tensors:
        torch._foreach_mul_(tensors, max_norm / (norm + 1e-6))
    return norm


def _global_norm(parts: list[GradPart], comm) -> float:
    """Squares are summed in fp64: an fp32 norm of a large tensor is off by ~1e-5 relative
    (seen on the bundled model's embedding), enough for two grids' clipping to differ and
    their runs to drift apart; in fp64 every grid gets the same norm to ~1e-12."""
    if comm is None or not comm.meshes:  # one process: every gradient is whole and here
        return float(_sum_sq([p.tensor for p in parts], "cpu").sqrt())
    device = comm.meshes["world"].device_type
    sq = {dims: _sum_sq([p.tensor for p in parts if p.summed_over == dims], device)
          for dims in ((), ("tp",), ("dp_sp",), ("dp_sp", "tp"))}
    # Every rank of a tp or dp_sp group holds the same kinds of parts (same stage), so each
    # group's ranks meet in the same collectives below.
    tp_sums = torch.stack([sq[("dp_sp", "tp")], sq[("tp",)]])
    comm.all_reduce_sum(tp_sums, "tp")
    zero = tp_sums[0] + sq[("dp_sp",)]
    comm.all_reduce_sum(zero, "dp_sp")
    total = zero + tp_sums[1] + sq[()]
    comm.all_reduce_sum(total, "pp")
    return float(total.sqrt())


def _sum_sq(tensors: list, device) -> torch.Tensor:
    """Sum of squares of every element, fp64, on `device` (a collective's device)."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch.stack([torch.linalg.vector_norm(t, dtype=torch.float64) for t in tensors])
    return (norms ** 2).sum().to(device)
