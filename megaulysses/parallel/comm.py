"""Every collective megaulysses issues, in one file, each counted in bytes.

`Comm` wraps the DeviceMesh: it names groups by mesh dim (dims.py: "dp", "cp", "sp", "tp",
"pp", "dp_sp") and counts the bytes this rank sends per group and collective kind, so the
trainer can log them, tests can check them against the formulas and the planner can time
each group's bytes over its own link. No module-level groups: callers are handed a `Comm`.

Bytes sent per rank, for a tensor of N bytes in a group of P ranks (what an ideal ring
or pairwise exchange puts on the wire; the chunk a rank keeps is not counted):
    all_to_all      N (P-1)/P        N = this rank's input
    all_reduce      2 N (P-1)/P      reduce-scatter + all-gather
    all_gather      N (P-1)/P        N = the gathered output
    reduce_scatter  N (P-1)/P        N = the full input
    p2p             N                N = each tensor sent to another pipeline stage
                                     (activations and their gradients; torch's
                                     pipelining issues them, counted in `count_p2p`)
    ring            N                N = each tensor passed to the next rank of the ring
                                     (ring attention's key/value blocks and gradients)

With --log-timers-to-tensorboard each collective is also timed, by kind, in
`stats.timers` (parallel/timers.py): the call, plus the wait on an asynchronous one's work
where our code waits (the seconds it was exposed); FSDP2's own asynchronous all-gathers
are timed at issue only (FSDP waits on them itself). Off, no clock is read and nothing
synchronizes.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterable, Optional

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from megaulysses.parallel.comm_stats import (BYTE_KINDS, OTHER_GROUP, CommStats,  # noqa: F401
                                             Waitable, _FunctionalCollectiveCounter, _nbytes)
from megaulysses.parallel.dims import DP_SP, TP

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


# torch 2.13 renamed these; the old names still work but warn.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Comm:
    """`meshes`: ParallelDims.build_mesh()'s dict of named 1-D meshes, or None alone."""

    def __init__(self, meshes: dict | None = None):
        self.meshes = meshes or {}
        self.stats = CommStats()
        self.compiled = False  # torch.compile'd blocks: DTensor's collectives uncounted

    def size(self, dim: str) -> int:
        return self.meshes[dim].size() if dim in self.meshes else 1

    def rank(self, dim: str) -> int:
        return self.meshes[dim].get_local_rank() if dim in self.meshes else 0

    def group(self, dim: str) -> dist.ProcessGroup:
        return self.meshes[dim].get_group()

    def mesh(self, dim: str) -> DeviceMesh:
        return self.meshes[dim]

    def counting_dtensor_collectives(self, key: Hashable = None
                                     ) -> contextlib.AbstractContextManager:
        """Context: count the collectives DTensor issues (tensor parallelism) in `stats`.

        DTensor calls torch's functional collectives from inside its dispatch; a dispatch
        mode sees them in forward and backward, so they land in the same ledger as ours.
        With `key` (what fixes the shapes inside), only the first time per key runs the
        mode; later times add what it counted (`CommStats.counted_once`).
        """
        return self.stats.counted_once(key, lambda g: self.dim_of_group(g, TP))

    # -- plain collectives (no autograd) --------------------------------------------------

    def all_reduce_sum(self, tensor: torch.Tensor, dim: str,
                       async_op: bool = False) -> Optional[Waitable]:
        """In place. Sum, never ReduceOp.AVG: AVG has given wrong results on gloo."""
        p = self.size(dim)
        if p == 1:
            return None
        self.stats.add("all_reduce", 2 * _nbytes(tensor) * (p - 1) / p, dim)
        with self.stats.timed("all_reduce", tensor):
            work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group(dim),
                                   async_op=async_op)
        return self.stats.timed_work(work, "all_reduce", tensor)

    def all_reduce_max(self, tensor: torch.Tensor, dim: str) -> None:
        """In place: the elementwise max over the `dim` group (the vocab-parallel cross
        entropy's row maxima). Counted as an all-reduce."""
        p = self.size(dim)
        if p == 1:
            return
        self.stats.add("all_reduce", 2 * _nbytes(tensor) * (p - 1) / p, dim)
        with self.stats.timed("all_reduce", tensor):
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group(dim))

    def pair_sum(self, tensor: torch.Tensor, dim: str, peer: int) -> None:
        """In place: `tensor` + the same tensor of rank `peer` of the `dim` group (which
        calls this with us as its peer). Both end with bitwise equal sums: a + b == b + a.
        For the tied word embedding of the first and last pipeline stage."""
        group = self.group(dim)
        other = dist.get_global_rank(group, peer)
        received = torch.empty_like(tensor)
        self.stats.add("p2p", _nbytes(tensor), dim)
        with self.stats.timed("p2p", tensor):
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, other, group),
                                            dist.P2POp(dist.irecv, received, other, group)])
            for w in works:
                w.wait()
        tensor += received

    def ring_pass(self, tensors: list, dim: str) -> "RingPass":
        """Start sending `tensors` to the next rank of the `dim` group (rank + 1, wrapping)
        and receiving the previous rank's; `.wait()` returns what arrived. Started before
        the work on the current tensors, it overlaps that work."""
        p, r, group = self.size(dim), self.rank(dim), self.group(dim)
        nxt = dist.get_global_rank(group, (r + 1) % p)
        prv = dist.get_global_rank(group, (r - 1) % p)
        received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, prv, group) for t in received]
        for t in tensors:
            self.stats.add("ring", _nbytes(t), dim)
        timed = lambda: self.stats.timed("ring", tensors[0])  # noqa: E731
        with timed():
            works = dist.batch_isend_irecv(ops)
        return RingPass(works, received, timed)

    def count_p2p(self, ops: Iterable[dist.P2POp], dim: str) -> None:
        """Count the sends among torch.distributed.pipelining's P2POps (it issues them
        over the `dim` group)."""
        for op in ops:
            if op.op is dist.isend:
                self.stats.add("p2p", _nbytes(op.tensor), dim)

    def gather_object(self, obj: Any, dim: str) -> Optional[list[Any]]:
        """Rank 0 of the `dim` group gets everybody's `obj` (pickled) in rank order; the
        others get None. Only the ranks of one group need to call it."""
        if self.size(dim) == 1:
            return [obj]
        group = self.group(dim)
        out = [None] * self.size(dim) if self.rank(dim) == 0 else None
        dist.gather_object(obj, out, dst=dist.get_global_rank(group, 0), group=group)
        return out

    def pop_busiest_bytes(self) -> dict:
        """Bytes per kind sent since the last call by the rank that sent the most of that
        kind: every rank's figure on symmetric grids; pipeline stages differ (the first
        sends no gradients, the last no activations). Every rank must call it."""
        mine = self.stats.pop()
        if not self.meshes:
            return mine
        t = torch.tensor([float(mine.get(k, 0)) for k in BYTE_KINDS], dtype=torch.float64,
                         device=self.meshes["world"].device_type)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # metrics only: not itself counted
        return {k: v for k, v in zip(BYTE_KINDS, t.tolist(), strict=True) if v}

    def pop_slowest_seconds(self, names: tuple[str, ...]) -> dict:
        """Seconds per timer name (`stats.timers`) since the last call, of the rank that
        spent the most on each (Megatron-LM reports its timers' maximum over ranks).
        Every rank must call it, with the same names."""
        mine = self.stats.timers.pop()
        values = [mine.get(name, 0.0) for name in names]
        if self.meshes:
            t = torch.tensor(values, dtype=torch.float64,
                             device=self.meshes["world"].device_type)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # metrics only: neither counted nor timed
            values = t.tolist()
        return dict(zip(names, values, strict=True))

    def barrier(self) -> None:
        if self.meshes:
            dist.barrier()

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when `flag` is True on any rank (a stop request one rank
        saw: a signal, a wall-clock limit, a NaN). Control traffic: not counted."""
        if not self.meshes:
            return flag
        t = torch.tensor([float(flag)], device=self.meshes["world"].device_type)
        with self.stats.paused():  # DTensor's counter would see it inside a step
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def first_of_any_rank(self, obj: Any) -> Any:
        """The first non-None `obj` in rank order, on every rank: one rank's finding (a
        path it cannot write) becomes every rank's. Control traffic: not counted."""
        if not self.meshes or not self.any_rank(obj is not None):  # the usual case: 4 bytes
            return obj
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, obj)  # pickled: a few bytes, a few times a run
        return next((o for o in everyone if o is not None), None)

    def new_checkpoint_group(self, timeout: Optional[timedelta] = None
                             ) -> Optional[dist.ProcessGroup]:
        """A gloo group of all ranks for background checkpoint writes (DCP coordinates
        over it from its own thread, apart from the training collectives). Every rank
        must call it, at the same point; None alone."""
        return dist.new_group(backend="gloo", timeout=timeout) if self.meshes else None

    # -- all-to-all with autograd (Ulysses) ---------------------------------------------

    def all_to_all(self, x: torch.Tensor, dim: str, scatter_dim: int,
                   gather_dim: int) -> torch.Tensor:
        """Split `x` into P chunks along `scatter_dim`, send chunk i to rank i, concatenate
        the received chunks along `gather_dim` in rank order. The backward pass is the
        same exchange with the two dims swapped."""
        if self.size(dim) == 1:
            return x
        return _AllToAll.apply(x, self, dim, scatter_dim, gather_dim)

    def all_to_all_start(self, x: torch.Tensor, dim: str, scatter_dim: int,
                         gather_dim: int) -> PendingAllToAll:
        """`all_to_all`'s exchange issued and not waited for (no autograd; a2a_overlap.py
        builds it): `.wait()` returns the result. Counted here, its wait timed at wait."""
        p = self.size(dim)
        send = torch.stack([c.contiguous() for c in x.chunk(p, dim=scatter_dim)])  # [P, ...]
        recv = torch.empty_like(send)  # chunk i from rank i at index i
        self.stats.add("all_to_all", _nbytes(send) * (p - 1) / p, dim)
        with self.stats.timed("all_to_all", send):
            work = dist.all_to_all_single(recv, send, group=self.group(dim), async_op=True)
        return PendingAllToAll(self.stats.timed_work(work, "all_to_all", send), send, recv,
                               gather_dim)

    def _all_to_all_raw(self, x, dim: str, scatter_dim: int, gather_dim: int):
        return self.all_to_all_start(x, dim, scatter_dim, gather_dim).wait()


    # -- all-gather / reduce-scatter with autograd (Megatron-style sequence parallel) -----

    def all_gather(self, x: torch.Tensor, dim: str, gather_dim: int) -> torch.Tensor:
        """Concatenate every rank's `x` along `gather_dim`; backward reduce-scatters."""
        if self.size(dim) == 1:
            return x
        return _AllGather.apply(x, self, dim, gather_dim)

    def reduce_scatter(self, x: torch.Tensor, dim: str, scatter_dim: int) -> torch.Tensor:
        """Sum `x` over ranks, keep this rank's chunk of `scatter_dim`; backward gathers."""
        if self.size(dim) == 1:
            return x
        return _ReduceScatter.apply(x, self, dim, scatter_dim)

    def _all_gather_raw(self, x, dim: str, gather_dim: int):
        p = self.size(dim)
        out = torch.empty((p * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype,
                          device=x.device)  # ranks' inputs stacked along dim 0
        self.stats.add("all_gather", _nbytes(out) * (p - 1) / p, dim)
        with self.stats.timed("all_gather", out):
            _ALL_GATHER(out, x.contiguous(), group=self.group(dim))
        return torch.cat(out.chunk(p, dim=0), dim=gather_dim)

    def _reduce_scatter_raw(self, x, dim: str, scatter_dim: int):
        p = self.size(dim)
        chunks = x.chunk(p, dim=scatter_dim)
        send = torch.cat([c.contiguous() for c in chunks], dim=0)  # chunk i for rank i
        out = torch.empty_like(chunks[0], memory_format=torch.contiguous_format)
        self.stats.add("reduce_scatter", _nbytes(send) * (p - 1) / p, dim)
        with self.stats.timed("reduce_scatter", send):
            _REDUCE_SCATTER(out, send, op=dist.ReduceOp.SUM, group=self.group(dim))
        return out

    # -- ZeRO: collectives on flat buffers, and FSDP2's own collectives counted ----------

    def reduce_scatter_flat(self, out: torch.Tensor, inp: torch.Tensor, dim: str,
                            async_op: bool = False) -> Optional[Waitable]:
        """`out` = this rank's 1/P of the sum over ranks of the flat `inp` (P pieces)."""
        p = self.size(dim)
        self.stats.add("reduce_scatter", _nbytes(inp) * (p - 1) / p, dim)
        with self.stats.timed("reduce_scatter", inp):
            work = _REDUCE_SCATTER(out, inp, op=dist.ReduceOp.SUM, group=self.group(dim),
                                   async_op=async_op)
        return self.stats.timed_work(work, "reduce_scatter", inp)

    def all_gather_flat(self, out: torch.Tensor, inp: torch.Tensor, dim: str,
                        async_op: bool = False) -> Optional[Waitable]:
        """`out` = every rank's flat `inp`, in rank order."""
        p = self.size(dim)
        self.stats.add("all_gather", _nbytes(out) * (p - 1) / p, dim)
        with self.stats.timed("all_gather", out):
            work = _ALL_GATHER(out, inp, group=self.group(dim), async_op=async_op)
        return self.stats.timed_work(work, "all_gather", out)

    def fsdp_collectives(self) -> tuple[_FsdpAllGather, _FsdpReduceScatter]:
        """(all-gather, reduce-scatter) for FSDP2's `set_custom_all_gather` /
        `set_custom_reduce_scatter`: the same c10d calls FSDP2 makes by default, counted
        here. The reduce-scatter always sums (the caller turns off FSDP's averaging)."""
        of_group = lambda g: self.dim_of_group(g, DP_SP)  # noqa: E731
        return _FsdpAllGather(self.stats, of_group), _FsdpReduceScatter(self.stats, of_group)

    def dim_of_group(self, group_name: str, expected: str) -> str:
        """The mesh dim whose process group is called `group_name`, for collectives torch
        issues on a group we handed it (DTensor's, FSDP2's): `expected` when its group is
        that one (a mesh may give two dims of the same ranks one group: sp and dp_sp when
        dp = cp = 1), else the first that is, else OTHER_GROUP."""
        dims = [expected] + [d for d in self.meshes if d != expected]
        for dim in dims:  # the 1-D meshes ("world" is the whole grid: no one group)
            mesh = self.meshes.get(dim)
            if mesh is not None and mesh.ndim == 1 and mesh.get_group().group_name == group_name:
                return dim
        return OTHER_GROUP  # a group of no mesh dim (e.g. a checkpoint's): still counted


class PendingAllToAll:
    """An all-to-all in flight. The send buffer stays referenced until `wait()` (gloo and
    NCCL read it meanwhile), which returns the exchanged tensor, once."""

    def __init__(self, work: Optional[Waitable], send: torch.Tensor, recv: torch.Tensor,
                 gather_dim: int):
        self.work, self.gather_dim = work, gather_dim
        self.buffers: Optional[tuple[torch.Tensor, torch.Tensor]] = (send, recv)

    def wait(self) -> torch.Tensor:
        if self.buffers is None:
            raise RuntimeError("PendingAllToAll.wait() called twice: its result is given once")
        with record_function("megaulysses::all_to_all_wait"):  # profiler traces' marker
            if self.work is not None:
                self.work.wait()
        recv, self.work, self.buffers = self.buffers[1], None, None
        return torch.cat(recv.unbind(0), dim=self.gather_dim)


class RingPass:
    def __init__(self, works: list, received: list,
                 timed: Callable[[], contextlib.AbstractContextManager]):
        self.works, self.received, self.timed = works, received, timed

    def wait(self) -> list:
        with self.timed():
            for w in self.works:
                w.wait()
        return self.received


class _FsdpAllGather:
    def __init__(self, stats: CommStats, dim_of_group):
        self.stats, self.dim_of_group = stats, dim_of_group

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        p = group.size()
        self.stats.add("all_gather", _nbytes(output_tensor) * (p - 1) / p,
                       self.dim_of_group(group.group_name))
        with self.stats.timed("all_gather", output_tensor):
            return _ALL_GATHER(output_tensor, input_tensor, group=group, async_op=async_op)


class _FsdpReduceScatter(_FsdpAllGather):
    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        p = group.size()
        self.stats.add("reduce_scatter", _nbytes(input_tensor) * (p - 1) / p,
                       self.dim_of_group(group.group_name))
        with self.stats.timed("reduce_scatter", input_tensor):
            return _REDUCE_SCATTER(output_tensor, input_tensor, op=op, group=group,
                                   async_op=async_op)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm: Comm, dim: str, gather_dim: int):
        ctx.comm, ctx.dim, ctx.gather_dim = comm, dim, gather_dim
        return comm._all_gather_raw(x, dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm._reduce_scatter_raw(grad, ctx.dim, ctx.gather_dim), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm: Comm, dim: str, scatter_dim: int):
        ctx.comm, ctx.dim, ctx.scatter_dim = comm, dim, scatter_dim
        return comm._reduce_scatter_raw(x, dim, scatter_dim)

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm._all_gather_raw(grad, ctx.dim, ctx.scatter_dim), None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm: Comm, dim: str, scatter_dim: int, gather_dim: int):
        ctx.comm, ctx.dim, ctx.dims = comm, dim, (scatter_dim, gather_dim)
        return comm._all_to_all_raw(x, dim, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        g = ctx.comm._all_to_all_raw(grad.contiguous(), ctx.dim, gather_dim, scatter_dim)
        return g, None, None, None, None
