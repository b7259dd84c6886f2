"""The global gradient norm of a grid, from the pieces of gradient each rank holds, and
clipping by it. Squares are summed per kind of piece, then over the mesh dims whose ranks
hold the other pieces (tensor-parallel shards, ZeRO rows), then over pipeline stages."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from megaulysses.parallel.dims import DP_SP, PP, TP

if TYPE_CHECKING:
    from megaulysses.parallel.comm import Comm


@dataclass
class GradPart:
    """One tensor of this rank's (already reduced) gradients, as the optimizer will use it.

    `summed_over`: the mesh dims whose ranks hold the other pieces of the same gradient
    (their squared norms add up): TP for a tensor-parallel shard, DP_SP for a ZeRO
    shard; () for a whole gradient every rank of those dims holds alike. `counted`: False
    for a copy whose norm is counted elsewhere (the tied embedding on the last pipeline
    stage): clipped, not counted.
    """

    tensor: torch.Tensor
    summed_over: tuple = ()
    counted: bool = True


@torch.no_grad()
def unscale_and_clip(parts: list[GradPart], inv_scale: float, max_norm: float,
                     comm: Optional[Comm] = None) -> float:
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
          for dims in ((), (TP,), (DP_SP,), (DP_SP, TP))}
    # Every rank of a tp or dp_sp group holds the same kinds of parts (same stage), so each
    # group's ranks meet in the same collectives below.
    tp_sums = torch.stack([sq[(DP_SP, TP)], sq[(TP,)]])
    comm.all_reduce_sum(tp_sums, TP)
    zero = tp_sums[0] + sq[(DP_SP,)]
    comm.all_reduce_sum(zero, DP_SP)
    total = zero + tp_sums[1] + sq[()]
    comm.all_reduce_sum(total, PP)
    return float(total.sqrt())


def _sum_sq(tensors: list, device) -> torch.Tensor:
    """Sum of squares of every element, fp64, on `device` (a collective's device)."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch.stack([torch.linalg.vector_norm(t, dtype=torch.float64) for t in tensors])
    return (norms ** 2).sum().to(device)
