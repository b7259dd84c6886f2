"""A linear whose weight gradient autograd never sees: Megatron-LM's gradient-accumulation
fusion. Backward hands the layer's input x and output gradient g to a sink (the
distributed optimizer, parallel/dist_opt.py), which adds g^T x straight into its gradient
buffer, summed in the buffer's dtype (fp32 by default): no 16-bit weight gradient, no
`.grad` tensor per micro-batch.

Imports nothing distributed: the sink is any object with `used(w)` (a forward that will
have a backward) and `wgrad(w, x, g)` (x `[T, in]`, g `[T, out]`, both in the compute
dtype).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def linear_to_sink(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   sink) -> torch.Tensor:  # [..., in] -> [..., out]
    """F.linear(x, weight, bias) (autocast's dtype under autocast, as F.linear), whose
    weight gradient goes to `sink.wgrad` instead of autograd."""
    device, param = x.device.type, weight
    if torch.is_autocast_enabled(device):  # what autocast would do to F.linear's operands
        dtype = torch.get_autocast_dtype(device)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
        sink.used(param)  # not a recomputation inside backward: its backward will come
    with torch.autocast(device, enabled=False):
        return _LinearToSink.apply(x, weight, bias, param, sink)


class _LinearToSink(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, param, sink):
        ctx.save_for_backward(x, weight)
        ctx.param, ctx.sink, ctx.has_bias = param, sink, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):  # g [..., out]
        x, weight = ctx.saved_tensors
        grad_x = g.matmul(weight) if ctx.needs_input_grad[0] else None
        g2d = g.reshape(-1, g.shape[-1])  # [T, out]
        grad_b = g2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        ctx.sink.wgrad(ctx.param, x.reshape(-1, x.shape[-1]), g2d)
        return grad_x, None, grad_b, None, None
