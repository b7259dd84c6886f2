"""Megatron-LM's gradient-accumulation fusion's arithmetic: a linear layer's weight
gradient g^T x added into a gradient buffer in the buffer's dtype, by apex's kernel where
it is installed on CUDA, else torch (dist_opt.py's sinks call it)."""

from __future__ import annotations

import torch


def _apex_wgrad():
    """apex's fused_weight_gradient_mlp_cuda (Megatron-LM's kernel), None where absent."""
    try:
        import fused_weight_gradient_mlp_cuda
        return fused_weight_gradient_mlp_cuda
    except ImportError:
        return None


_APEX = _apex_wgrad()
TOKENS_PER_PIECE = 1024  # torch's fp32 path converts this many tokens at a time


def wgrad_backend(device: torch.device) -> str:
    """What adds the fused weight gradients on `device`, for the log."""
    if _APEX is not None and device.type == "cuda":
        return "apex fused_weight_gradient_mlp_cuda"
    # fp32 GEMMs: exact sums of the 16-bit products, but slower than 16-bit ones (on CPU
    # measured up to 2x a bf16 weight-gradient GEMM; on CUDA without apex far more)
    return "torch addmm (16-bit operands made fp32 for an fp32 buffer: fp32 GEMMs)"


def accumulate_wgrad(out: torch.Tensor, g: torch.Tensor, x: torch.Tensor) -> None:
    """out [rows, in] += g^T x (g [T, rows], x [T, in]), summed in out's dtype: for an fp32
    `out`, the 16-bit products are summed in fp32 and added without a 16-bit rounding
    (apex's kernel, or fp32 copies of the operands, a piece of the tokens at a time so
    they stay small); a 16-bit `out` (a 16-bit buffer) gets a 16-bit product, as there."""
    if out.dtype != torch.float32:
        out.addmm_(g.t(), x)
    elif _APEX is not None and out.is_cuda and x.dtype != torch.float32:
        _APEX.wgrad_gemm_accum_fp32(x.contiguous(), g.contiguous(), out)
    else:
        for t in range(0, x.shape[0], TOKENS_PER_PIECE):
            piece = slice(t, t + TOKENS_PER_PIECE)
            out.addmm_(g[piece].t().float(), x[piece].float())
