"""Building blocks of the GPT: linears, norms, embedding, the MLP (rotary position
embedding: rope.py)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from megaulysses.model.ops import linear, rms_norm


class Linear(nn.Linear):
    """nn.Linear (same parameters and names) whose matmuls use `ops.linear`: oneDNN for
    fp32 on CPU, where it is ~2x faster than the default MKL path on AMD CPUs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def compute_weight(w: torch.Tensor) -> torch.Tensor:
    """`w` as a step uses it: rounded to the autocast dtype under autocast (--bf16/--fp16),
    else itself.

    The mixed-precision policy, one for every grid and ZeRO stage: every parameter is used
    in the compute dtype, as Megatron-LM's 16-bit modules do; masters and gradient sums
    stay fp32, the residual stream is in the compute dtype (fp32 under
    --fp32-residual-connection: `Embedding`). Autocast rounds the linears' weights itself;
    norms and embeddings, which it leaves in fp32, round through here. ZeRO-2/3 gather
    parameters already in the compute dtype (the rounding is then a no-op), so they compute
    exactly what stages 0/1 compute, and hand on the same activations.
    """
    sink = getattr(w, "grad_sink", None)
    if sink is not None and w.requires_grad and torch.is_grad_enabled():
        return _ToSink.apply(w, sink)
    device = w.device.type
    if torch.is_autocast_enabled(device):
        return w.to(torch.get_autocast_dtype(device))
    return w


def shared_input(x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """For an fp32 `x` (a norm's output) that several linears read under autocast: a
    function giving each its own handle on ONE rounded copy. Autocast would round x once per
    linear, and each linear would keep its own copy for backward (three [T, h] copies for q,
    k and v); here they share one. Each handle is a separate autograd node whose gradient
    goes back to x in fp32, so the linears' input gradients still sum in fp32, as with
    autocast's copies: the same values, bit for bit."""
    device = x.device.type
    if not torch.is_autocast_enabled(device) or x.dtype != torch.float32:
        return lambda: x
    low = x.detach().to(torch.get_autocast_dtype(device))
    return lambda: _Rounded.apply(x, low)


class _Rounded(torch.autograd.Function):
    """`low` (x rounded, made once) as a use of x: the gradient goes to x in x's dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
        ctx.dtype = x.dtype
        return low.view_as(low)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.dtype), None


class _ToSink(torch.autograd.Function):
    """`w` itself, whose gradient from this use goes to `sink(w, grad)`, not into `w.grad`.

    For a 16-bit weight used twice in one graph (the tied word embedding): autograd would
    sum the two uses' gradients in 16 bits before any hook sees them; an optimizer that
    accumulates gradients in fp32 (parallel/dist_opt.py) sets `w.grad_sink` and takes this
    use's gradient itself, as Megatron-LM's fused weight-gradient accumulation does."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, sink) -> torch.Tensor:
        ctx.w, ctx.sink = w, sink
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.sink(ctx.w, grad)
        return None, None


def _zero_centered(norm: RMSNorm | LayerNorm, zero_centered: bool) -> None:
    """--apply-layernorm-1p (Megatron-LM's zero-centered gamma): the parameter holds
    gamma - 1, starting at 0, and the norm scales by weight + 1. Same function, same
    gradient; the stored values sit near 0, where a 16-bit rounding of them (and the weight
    decay it has not, being 1-D) loses less."""
    norm.zero_centered = zero_centered
    if zero_centered:
        nn.init.zeros_(norm.weight)


def _scale(norm: RMSNorm | LayerNorm) -> torch.Tensor:
    """The norm's gamma in fp32, from its weight in the compute dtype (`compute_weight`)."""
    w = compute_weight(norm.weight).float()
    return w + 1.0 if norm.zero_centered else w


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (same parameter) with the fused forward and backward of `rms_norm`:
    computed in fp32 with the weight in the compute dtype (`compute_weight`), on an input
    in any dtype (a 16-bit residual stream), which it keeps as is for backward. The output
    is fp32: the linears reading it round it once (`shared_input`), and their input
    gradients sum in fp32, as one fused qkv (or gate + fc1) matmul would."""
    zero_centered: bool  # --apply-layernorm-1p (`_zero_centered`)

    def __init__(self, size: int, eps: float, zero_centered: bool = False):
        super().__init__(size, eps=eps)
        _zero_centered(self, zero_centered)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., h] -> fp32 [..., h]
        assert self.eps is not None  # __init__ sets a float (nn.RMSNorm allows None)
        return rms_norm(x, _scale(self), self.eps)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (same parameters) computed in fp32 with its weight and bias in the
    compute dtype (`compute_weight`); fp32 out, as RMSNorm. (On a 16-bit input it keeps
    the fp32 copy F.layer_norm computes on: the planner counts it.)"""
    zero_centered: bool  # --apply-layernorm-1p (`_zero_centered`)

    def __init__(self, size: int, eps: float, zero_centered: bool = False):
        super().__init__(size, eps=eps)
        _zero_centered(self, zero_centered)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., h] -> fp32 [..., h]
        return F.layer_norm(x.float(), self.normalized_shape, _scale(self),
                            compute_weight(self.bias).float(), self.eps)


class EmbeddingTable(nn.Embedding):
    """nn.Embedding (same parameter) that looks up the weight in the compute dtype
    (`compute_weight`): its rows as they are, in that dtype."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [b, s] -> [b, s, h]
        return F.embedding(ids, compute_weight(self.weight))


def build_norm(kind: str, size: int, eps: float, zero_centered: bool = False) -> nn.Module:
    """`kind`: "RMSNorm" or "LayerNorm"; `zero_centered`: --apply-layernorm-1p."""
    if kind == "RMSNorm":
        return RMSNorm(size, eps, zero_centered)
    return LayerNorm(size, eps, zero_centered)


class MLP(nn.Module):
    """GeLU MLP (fc1 -> gelu -> fc2) or SwiGLU (silu(gate) * up -> fc2).

    Gate and up are separate linears (not one fused [2f, h] weight) so that tensor
    parallelism can shard each by rows without re-interleaving.
    """

    def __init__(self, hidden: int, ffn: int, swiglu: bool, bias: bool,
                 gelu_approximate: str = "tanh"):
        super().__init__()
        self.swiglu = swiglu
        self.gelu_approximate = gelu_approximate  # "tanh" or "none" (erf): ModelConfig's
        self.fc1 = Linear(hidden, ffn, bias=bias)
        self.gate = Linear(hidden, ffn, bias=bias) if swiglu else None
        self.fc2 = Linear(ffn, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, s, h]
        if self.gate is not None:  # SwiGLU (self.swiglu)
            use = shared_input(x)  # one 16-bit copy of x for gate and fc1, not two
            y = F.silu(self.gate(use())) * self.fc1(use())  # [b, s, f]
        else:
            y = F.gelu(self.fc1(x), approximate=self.gelu_approximate)
        return self.fc2(y)  # [b, s, h]
