"""RMSNorm with a hand-written backward (`rms_norm`; autograd's has ~2x the passes),
computed in fp32 on an input of any float dtype, which it keeps as given. On CUDA an fp32
input may take apex's fused kernel instead (kernels.py says when).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megaulysses.model.ops.kernels import FusedNorm, select_kernels


class _RMSNorm(torch.autograd.Function):
    """y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps), with a hand-written backward:

    dx = rstd * (g*w - x_hat * mean(g*w * x_hat)),  dw = sum over tokens of g * x_hat.

    (nn.RMSNorm's forward is fused, but its backward is autograd's composite formula,
    about twice the passes and temporaries.) Backward keeps the input x, not x_hat, and
    recomputes x_hat = x * rstd (the same op, the same values): x is the residual stream,
    which something else usually holds anyway (a recomputed group's input, the tiled
    MLP's checkpoint), so the norm adds only rstd to what a layer keeps. A 16-bit x (the
    residual stream under --bf16/--fp16) is kept in 16 bits and widened where used; the
    output is fp32 and x's gradient comes back in x's dtype.
    """

    @staticmethod
    def forward(ctx, x, weight, eps: float):  # x [..., h] any float dtype, weight [h] fp32
        xf = x.float()  # x itself when fp32
        sq = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square_()  # sum(x^2) [..., 1]
        rstd = sq.div_(x.shape[-1]).add_(eps).rsqrt_()  # [..., 1]
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd).mul_(weight)  # fp32

    @staticmethod
    def backward(ctx, grad):  # grad fp32 [..., h]
        x, weight, rstd = ctx.saved_tensors
        x_hat = x.float() * rstd
        dw = (grad * x_hat).sum(dim=tuple(range(grad.dim() - 1)))  # [h]
        gw = grad * weight
        dot = (gw * x_hat).mean(dim=-1, keepdim=True)  # [..., 1]
        dx = gw.addcmul_(x_hat, dot, value=-1).mul_(rstd)
        return dx.to(x.dtype), dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm(x.float(), (h,), weight, eps) over the last dim: fp32 out, for x of any
    float dtype (kept for backward as given, not widened) and an fp32 weight."""
    if weight.dtype != torch.float32 or not x.is_floating_point():
        return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps)
    fused = _apex(x, weight)
    if fused is not None:
        return fused(x, weight, (x.shape[-1],), eps)
    return _RMSNorm.apply(x, weight, eps)


def _apex(x: torch.Tensor, weight: torch.Tensor) -> Optional[FusedNorm]:
    """apex's fused RMSNorm where it keeps this function's contract: fp32 x (for a 16-bit
    x its output would be 16-bit), contiguous (apex would keep a contiguous copy for
    backward, ours keeps x), plain CUDA tensors (no tensor subclass), eagerly (under
    torch.compile ours traces; apex's extension would break the graph). None: ours."""
    if (x.dtype != torch.float32 or not x.is_cuda or not x.is_contiguous()
            or type(x) is not torch.Tensor
            or type(weight) not in (torch.Tensor, torch.nn.Parameter)
            or torch.compiler.is_compiling()):
        return None
    return select_kernels(x.device).rms_norm
