"""Linear layers through oneDNN: `linear` is F.linear with its fp32 CPU matmuls (forward
and backward, an explicit `torch.autograd.Function`) run by oneDNN instead of MKL, 2x on
AMD CPUs; `ONEDNN_LINEAR` says whether this torch build has it (tests switch it off).
Otherwise (CUDA, 16-bit, tensor subclasses, autocast) `linear` is F.linear itself.

Compiled (--torch-compile) the same oneDNN kernel runs, through `onednn_linear`, a custom
op inductor calls as it is: inductor's own lowering of `mkldnn._linear_pointwise` is for
frozen inference weights (it asserts on trainable ones), and without it inductor would
give the matmuls to MKL.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def _has_onednn_linear() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._linear_pointwise)
    except (AttributeError, RuntimeError):
        return False


# fp32 matmuls on CPU go to oneDNN instead of MKL: MKL picks its AVX2 kernels on AMD CPUs
# (~97 GFLOP/s per core measured on an AVX-512 EPYC), oneDNN its AVX-512 ones (~220).
# Tests switch this off to compare against F.linear.
ONEDNN_LINEAR = _has_onednn_linear()


@torch.library.custom_op("megaulysses::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x @ weight.T (+ bias) `[T, out]` by oneDNN, an op compiled code calls as it is."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@onednn_linear.register_fake
def _(x, weight, bias=None):
    return x.new_empty((x.shape[0], weight.shape[0]))


def _pointwise(x, weight, bias=None):  # x [T, in], weight [out, in] -> [T, out]
    if torch.compiler.is_compiling():
        return onednn_linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _onednn(a, b):
    """a @ b.T for 2-D fp32 CPU tensors. b may be any strided view (b = W.t() is free);
    a non-contiguous `a` is copied first."""
    return _pointwise(a, b)


def _onednn_weight_grad(dy, x):
    """dy.T @ x `[out, in]` for dy `[T, out]`, x `[T, in]`, through oneDNN.

    Its first operand must be contiguous (a transposed view is copied first), so the
    smaller of dy.T and x.T is the one transposed: for out > in, (x.T @ dy).T instead.
    """
    if dy.shape[1] > x.shape[1]:
        return _onednn(x.t().contiguous(), dy.t()).t().contiguous()
    return _onednn(dy.t().contiguous(), x.t())


def _use_onednn(x, weight) -> bool:
    # Plain tensors only: tensor subclasses (DTensor under tensor parallelism) take F.linear,
    # whose sharding rules they know.
    plain = type(x) is torch.Tensor and type(weight) in (torch.Tensor, torch.nn.Parameter)
    # bool(): the stubs type mkldnn.enabled as its descriptor; it reads as a bool
    return bool(plain and ONEDNN_LINEAR and x.device.type == "cpu" and x.dtype == torch.float32
                and weight.dtype == torch.float32 and torch.backends.mkldnn.enabled)


class _OneDNNLinear(torch.autograd.Function):
    """y = x @ W.T (+ b); backward is two more matmuls of the same kind."""

    @staticmethod
    def forward(ctx, x, weight, bias):  # x [T, in], weight [out, in]
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _pointwise(x, weight, bias)  # [T, out]

    @staticmethod
    def backward(ctx, dy):  # dy [T, out]
        x, weight = ctx.saved_tensors
        dy = dy.contiguous()
        dx = _onednn(dy, weight.t()) if ctx.needs_input_grad[0] else None  # dy @ W
        dw = _onednn_weight_grad(dy, x) if ctx.needs_input_grad[1] else None  # dy.T @ x
        db = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear, through oneDNN for fp32 on CPU (see ONEDNN_LINEAR), else F.linear itself."""
    if torch.is_autocast_enabled("cpu") or not _use_onednn(x, weight):
        return F.linear(x, weight, bias)
    y = _OneDNNLinear.apply(x.reshape(-1, x.shape[-1]), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


def _matmul_t(a, b):
    """a @ b.T for the fused ops (the chunked cross entropy): oneDNN where `linear` would
    use it."""
    return _onednn(a, b) if _use_onednn(a, b) else a @ b.t()
