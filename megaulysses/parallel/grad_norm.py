"""The global gradient norm of a grid, from the pieces of gradient each rank holds, and
clipping by it. Squares are summed per kind of piece, then over the mesh dims whose ranks
hold the other pieces (tensor-parallel shards, ZeRO rows), then over pipeline stages.
The same sum gives the logged parameter norm and count of zero gradient entries
(--log-params-norm, --log-num-zeros-in-grad).

Kernels (model/ops/kernels.py): torch's foreach ops, one call per (device, dtype) group of
tensors (one multi-tensor kernel each on CUDA), never a kernel per tensor from Python."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, cast

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from megaulysses.parallel.dims import DP_SP, PP, TP

if TYPE_CHECKING:
    from megaulysses.parallel.comm import Comm


@dataclass
class GradPart:
    """One tensor of this rank's (already reduced) gradients, as the optimizer will use it
    (or of its parameters, for their norm).

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
        _scale_(tensors, inv_scale)
    norm = _global_norm([p for p in parts if p.counted], comm)
    if max_norm > 0 and math.isfinite(norm) and norm > max_norm and tensors:
        _scale_(tensors, max_norm / (norm + 1e-6))
    return norm


def _scale_(tensors: list, factor: float) -> None:
    """Every tensor *= factor, in place: one foreach call per (device, dtype) group (a mixed
    list would take foreach's per-tensor path; host-offloaded gradients mix devices)."""
    for (group,), _ in _group_tensors_by_device_and_dtype([tensors]).values():
        # typed list[Optional[Tensor]] by torch; `tensors` holds no None
        torch._foreach_mul_(cast(list[torch.Tensor], group), factor)


def _global_norm(parts: list[GradPart], comm) -> float:
    """Squares are summed in fp64: an fp32 norm of a large tensor is off by ~1e-5 relative
    (seen on the bundled model's embedding), enough for two grids' clipping to differ and
    their runs to drift apart; in fp64 every grid gets the same norm to ~1e-12."""
    return float(global_sum(parts, comm, _squares).sqrt())


def global_sum(parts: list[GradPart], comm: Optional[Comm],
               of: Callable[[list], torch.Tensor]) -> torch.Tensor:
    """The sum over the whole grid of `of`'s value of each piece (`of`: pieces of one
    device and dtype -> fp64 [n], each a sum over the piece's elements) for every counted
    part, each element of the model once: 0-dim fp64 on the collectives' device (the CPU
    on one process)."""
    parts = [p for p in parts if p.counted]
    if comm is None or not comm.meshes:  # one process: every tensor is whole and here
        return _sum_of([p.tensor for p in parts], "cpu", of)
    device = comm.meshes["world"].device_type
    sums = {dims: _sum_of([p.tensor for p in parts if p.summed_over == dims], device, of)
            for dims in ((), (TP,), (DP_SP,), (DP_SP, TP))}
    # Every rank of a tp or dp_sp group holds the same kinds of parts (same stage), so each
    # group's ranks meet in the same collectives below.
    tp_sums = torch.stack([sums[(DP_SP, TP)], sums[(TP,)]])
    comm.all_reduce_sum(tp_sums, TP)
    zero = tp_sums[0] + sums[(DP_SP,)]
    comm.all_reduce_sum(zero, DP_SP)
    total = zero + tp_sums[1] + sums[()]
    comm.all_reduce_sum(total, PP)
    return total


def _squares(tensors: list) -> torch.Tensor:
    """Each tensor's squared L2 norm, fp64 [n]: the squares of fp32 (or 16-bit) entries are
    exact in fp64 and summed there, on CUDA too (_foreach_norm accumulates in its output
    dtype)."""
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float64)) ** 2


def _zeros(tensors: list) -> torch.Tensor:
    """Each tensor's count of zero entries, fp64 [n] (exact below 2**53): numel minus its
    "L0 norm", the count of entries != 0 (NaN counts as nonzero, as in count_nonzero)."""
    nonzero = torch.stack(torch._foreach_norm(tensors, 0, dtype=torch.float64))
    sizes = torch.tensor([t.numel() for t in tensors], dtype=torch.float64)
    return sizes.to(nonzero.device) - nonzero


def _sum_of(tensors: list, device, of) -> torch.Tensor:
    """Sum of `of` (per-tensor values [n] of a list of tensors of one device and dtype) over
    `tensors`, fp64, on `device` (a collective's device). The values are summed in the
    order of `tensors`, whatever the grouping: the same sum, bit for bit, as one kernel
    per tensor would give."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    # .to: some parts may live on the host (--optimizer-cpu-offload's gradients)
    groups = list(_group_tensors_by_device_and_dtype([tensors], with_indices=True).values())
    if len(groups) == 1:  # one device and dtype: already in order
        return of(groups[0][0][0]).to(device).sum()
    values = torch.cat([of(group).to(device) for (group,), _ in groups])
    where = torch.tensor([i for _, indices in groups for i in indices], device=device)
    return values.new_empty(len(tensors)).index_copy_(0, where, values).sum()


@torch.no_grad()
def params_norm(parts: list[GradPart], comm: Optional[Comm] = None) -> float:
    """--log-params-norm: the L2 norm of the whole model's parameters, from the pieces
    each rank holds (`Zero.param_parts`), each parameter once. Metrics only: its
    collectives are neither counted nor timed."""
    with _metrics_only(comm):
        return float(global_sum(parts, comm, _squares).sqrt())


@torch.no_grad()
def num_zeros(parts: list[GradPart], comm: Optional[Comm] = None) -> int:
    """--log-num-zeros-in-grad: the zero entries of the whole model's reduced gradients
    (`Zero.grad_parts`), each parameter once. Metrics only, as `params_norm`."""
    with _metrics_only(comm):
        return int(global_sum(parts, comm, _zeros))


def _metrics_only(comm: Optional[Comm]):
    return comm.stats.paused() if comm is not None else contextlib.nullcontext()
