"""Every collective megaulysses issues, in one file, each counted in bytes.

`Comm` wraps the DeviceMesh: it names groups by mesh dim (dims.py: "dp", "cp", "sp", "tp",
"pp", "dp_sp") and counts the bytes this rank sends per group and collective kind, so the
trainer can log them, tests can check them against the formulas and the planner can time
each group's bytes over its own link. There are no module-level groups:
whoever needs a collective is handed the `Comm`.

Bytes sent per rank, for a tensor of N bytes in a group of P ranks (what an ideal ring
or pairwise exchange puts on the wire; the chunk a rank keeps is not counted):
    all_to_all      N (P-1)/P        N = this rank's input
    all_reduce      2 N (P-1)/P      reduce-scatter + all-gather
    all_gather      N (P-1)/P        N = the gathered output
    reduce_scatter  N (P-1)/P        N = the full input
    p2p             N                N = each tensor sent to another pipeline stage
                                     (activations forward, their gradients backward;
                                     torch.distributed.pipelining issues these, counted
                                     in `count_p2p`)
    ring            N                N = each tensor passed to the next rank of the ring
                                     (ring attention's key/value blocks and gradients)
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megaulysses.parallel.dims import DP_SP, TP


# torch 2.13 renamed these; the old names still work but warn.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


OTHER_GROUP = "other"  # CommStats' group for collectives on a group that is no mesh dim
BYTE_KINDS = ("all_to_all", "all_reduce", "all_gather", "reduce_scatter", "p2p", "ring")


class CommStats:
    """Bytes sent by this rank per (group, collective kind), since the last `pop`. The
    group is the mesh dim name: it says which link the bytes cross (tools/plan.py)."""

    def __init__(self):
        self.bytes = defaultdict(int)  # (group, kind) -> bytes
        self.counting = True

    def add(self, kind: str, nbytes: float, group: str):
        if self.counting:
            self.bytes[(group, kind)] += int(nbytes)

    @contextlib.contextmanager
    def paused(self):
        """Collectives inside are not counted (e.g. evaluation between training steps)."""
        before, self.counting = self.counting, False
        try:
            yield
        finally:
            self.counting = before

    def pop(self, by_group: bool = False) -> dict:
        """Bytes per kind ({kind: bytes}), or with `by_group` per {(group, kind): bytes}."""
        out = dict(self.bytes)
        self.bytes.clear()
        if by_group:
            return out
        kinds = defaultdict(int)
        for (_, kind), n in out.items():
            kinds[kind] += n
        return dict(kinds)


class Comm:
    """`meshes`: ParallelDims.build_mesh()'s dict of named 1-D meshes, or None alone."""

    def __init__(self, meshes: dict | None = None):
        self.meshes = meshes or {}
        self.stats = CommStats()

    def size(self, dim: str) -> int:
        return self.meshes[dim].size() if dim in self.meshes else 1

    def rank(self, dim: str) -> int:
        return self.meshes[dim].get_local_rank() if dim in self.meshes else 0

    def group(self, dim: str):
        return self.meshes[dim].get_group()

    def mesh(self, dim: str):
        return self.meshes[dim]

    def counting_dtensor_collectives(self):
        """Context: count the collectives DTensor issues (tensor parallelism) in `stats`.

        DTensor calls torch's functional collectives from inside its dispatch; a dispatch
        mode sees them in forward and backward, so they land in the same ledger as ours.
        """
        return _FunctionalCollectiveCounter(self.stats, lambda g: self.dim_of_group(g, TP))

    # -- plain collectives (no autograd) --------------------------------------------------

    def all_reduce_sum(self, tensor: torch.Tensor, dim: str, async_op: bool = False):
        """In place. Sum, never ReduceOp.AVG: AVG has given wrong results on gloo."""
        p = self.size(dim)
        if p == 1:
            return None
        self.stats.add("all_reduce", 2 * _nbytes(tensor) * (p - 1) / p, dim)
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group(dim),
                               async_op=async_op)

    def all_reduce_max(self, tensor: torch.Tensor, dim: str):
        """In place: the elementwise max over the `dim` group (the vocab-parallel cross
        entropy's row maxima). Counted as an all-reduce."""
        p = self.size(dim)
        if p == 1:
            return
        self.stats.add("all_reduce", 2 * _nbytes(tensor) * (p - 1) / p, dim)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group(dim))

    def pair_sum(self, tensor: torch.Tensor, dim: str, peer: int):
        """In place: `tensor` + the same tensor of rank `peer` of the `dim` group (which
        calls this with us as its peer). Both end with bitwise equal sums: a + b == b + a.
        For the tied word embedding of the first and last pipeline stage."""
        group = self.group(dim)
        other = dist.get_global_rank(group, peer)
        received = torch.empty_like(tensor)
        self.stats.add("p2p", _nbytes(tensor), dim)
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
        return RingPass(dist.batch_isend_irecv(ops), received)

    def count_p2p(self, ops, dim: str):
        """Count the sends among torch.distributed.pipelining's P2POps (it issues them
        over the `dim` group)."""
        for op in ops:
            if op.op is dist.isend:
                self.stats.add("p2p", _nbytes(op.tensor), dim)

    def gather_object(self, obj, dim: str):
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
        return {k: v for k, v in zip(BYTE_KINDS, t.tolist()) if v}

    def barrier(self):
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

    def new_checkpoint_group(self, timeout: Optional[timedelta] = None):
        """A gloo group of all ranks for background checkpoint writes (DCP coordinates
        over it from its own thread, apart from the training collectives). Every rank
        must call it, at the same point; None alone."""
        return dist.new_group(backend="gloo", timeout=timeout) if self.meshes else None

    # -- all-to-all with autograd (Ulysses) ---------------------------------------------

    def all_to_all(self, x: torch.Tensor, dim: str, scatter_dim: int, gather_dim: int):
        """Split `x` into P chunks along `scatter_dim`, send chunk i to rank i, concatenate
        the received chunks along `gather_dim` in rank order. The backward pass is the
        same exchange with the two dims swapped."""
        if self.size(dim) == 1:
            return x
        return _AllToAll.apply(x, self, dim, scatter_dim, gather_dim)

    def _all_to_all_raw(self, x, dim: str, scatter_dim: int, gather_dim: int):
        p = self.size(dim)
        chunks = [c.contiguous() for c in x.chunk(p, dim=scatter_dim)]
        send = torch.stack(chunks)  # [P, ...chunk]: the chunk for rank i at index i
        recv = torch.empty_like(send)
        self.stats.add("all_to_all", _nbytes(send) * (p - 1) / p, dim)
        dist.all_to_all_single(recv, send, group=self.group(dim))
        return torch.cat(recv.unbind(0), dim=gather_dim)


    # -- all-gather / reduce-scatter with autograd (Megatron-style sequence parallel) -----

    def all_gather(self, x: torch.Tensor, dim: str, gather_dim: int):
        """Concatenate every rank's `x` along `gather_dim`; backward reduce-scatters."""
        if self.size(dim) == 1:
            return x
        return _AllGather.apply(x, self, dim, gather_dim)

    def reduce_scatter(self, x: torch.Tensor, dim: str, scatter_dim: int):
        """Sum `x` over ranks, keep this rank's chunk of `scatter_dim`; backward gathers."""
        if self.size(dim) == 1:
            return x
        return _ReduceScatter.apply(x, self, dim, scatter_dim)

    def _all_gather_raw(self, x, dim: str, gather_dim: int):
        p = self.size(dim)
        out = torch.empty((p * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype,
                          device=x.device)  # ranks' inputs stacked along dim 0
        self.stats.add("all_gather", _nbytes(out) * (p - 1) / p, dim)
        _ALL_GATHER(out, x.contiguous(), group=self.group(dim))
        return torch.cat(out.chunk(p, dim=0), dim=gather_dim)

    def _reduce_scatter_raw(self, x, dim: str, scatter_dim: int):
        p = self.size(dim)
        chunks = x.chunk(p, dim=scatter_dim)
        send = torch.cat([c.contiguous() for c in chunks], dim=0)  # chunk i for rank i
        out = torch.empty_like(chunks[0], memory_format=torch.contiguous_format)
        self.stats.add("reduce_scatter", _nbytes(send) * (p - 1) / p, dim)
        _REDUCE_SCATTER(out, send, op=dist.ReduceOp.SUM, group=self.group(dim))
        return out

    # -- ZeRO: collectives on flat buffers, and FSDP2's own collectives counted ----------

    def reduce_scatter_flat(self, out: torch.Tensor, inp: torch.Tensor, dim: str,
                            async_op: bool = False):
        """`out` = this rank's 1/P of the sum over ranks of the flat `inp` (P pieces)."""
        p = self.size(dim)
        self.stats.add("reduce_scatter", _nbytes(inp) * (p - 1) / p, dim)
        return _REDUCE_SCATTER(out, inp, op=dist.ReduceOp.SUM, group=self.group(dim),
                               async_op=async_op)

    def all_gather_flat(self, out: torch.Tensor, inp: torch.Tensor, dim: str,
                        async_op: bool = False):
        """`out` = every rank's flat `inp`, in rank order."""
        p = self.size(dim)
        self.stats.add("all_gather", _nbytes(out) * (p - 1) / p, dim)
        return _ALL_GATHER(out, inp, group=self.group(dim), async_op=async_op)

    def fsdp_collectives(self):
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


class RingPass:
    def __init__(self, works: list, received: list):
        self.works, self.received = works, received

    def wait(self) -> list:
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
        return _ALL_GATHER(output_tensor, input_tensor, group=group, async_op=async_op)


class _FsdpReduceScatter(_FsdpAllGather):
    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        p = group.size()
        self.stats.add("reduce_scatter", _nbytes(input_tensor) * (p - 1) / p,
                       self.dim_of_group(group.group_name))
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


class _FunctionalCollectiveCounter(TorchDispatchMode):
    """Bytes of `_c10d_functional` collectives, by the conventions of the module doc."""

    KINDS = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
             "all_reduce": "all_reduce", "all_to_all_single": "all_to_all"}

    def __init__(self, stats: CommStats, dim_of_group):
        super().__init__()
        self.stats, self.dim_of_group = stats, dim_of_group

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional":
            kind = self.KINDS.get(func.__name__.split(".")[0])
            if kind is not None:
                self._count(kind, args)
        return func(*args, **(kwargs or {}))

    def _count(self, kind: str, args):
        x, group_name = args[0], args[-1]
        p = dist.distributed_c10d._resolve_process_group(group_name).size()
        n = _nbytes(x)
        sent = {"all_gather": n * (p - 1), "reduce_scatter": n * (p - 1) / p,
                "all_reduce": 2 * n * (p - 1) / p, "all_to_all": n * (p - 1) / p}[kind]
        self.stats.add(kind, sent, self.dim_of_group(group_name))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class RowShard:
    """Rank `r`'s rows of a tensor cut along dim 0 among P ranks the way torch.chunk (and
    FSDP2, and DTensor's Shard(0)) cuts it: `chunk` = ceil(rows / P) rows each, the last
    ranks fewer or none. Collectives move `chunk` rows for every rank (zeros pad the end)."""

    shape: tuple
    ranks: int
    lo: int
    hi: int
    chunk: int

    @classmethod
    def of(cls, t: torch.Tensor, ranks: int, rank: int) -> "RowShard":
        rows = t.shape[0]
        chunk = -(-rows // ranks)
        lo, hi = min(rank * chunk, rows), min((rank + 1) * chunk, rows)
        return cls(tuple(t.shape), ranks, lo, hi, chunk)

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def numel(self) -> int:
        """Elements of this rank's rows."""
        return (self.hi - self.lo) * self.row_numel

    @property
    def padded_numel(self) -> int:
        """Elements every rank sends or receives for this tensor."""
        return self.chunk * self.row_numel

    def by_rank(self, t: torch.Tensor) -> torch.Tensor:
        """The whole tensor as `[P, padded_numel]`: row r holds rank r's rows, zero-padded."""
        flat = t.reshape(-1)
        pad = self.ranks * self.padded_numel - flat.numel()
        return F.pad(flat, (0, pad)).view(self.ranks, self.padded_numel)

    def mine(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the whole tensor `t` (a view)."""
        return t[self.lo:self.hi]

    def pad(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's `rows`, flat and zero-padded to `padded_numel` (what it sends)."""
        return F.pad(rows.reshape(-1), (0, self.padded_numel - self.numel))

    def unpack(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's rows from its padded piece `flat` (a view)."""
        return flat[:self.numel].view((self.hi - self.lo,) + self.shape[1:])


class GradReducer:
    """Sums gradients over a mesh dim while backward still runs (bucketed, async).

    Each parameter's post-accumulate hook counts it ready; when every parameter of a bucket
    is ready, the bucket is flattened and an async collective starts. `finish()` launches
    what is left (parameters that got no gradient count as zeros) and waits. Only the last
    micro-batch of a step reduces (`arm()` before its backward): earlier micro-batches just
    accumulate locally.

    `shards=None`: all-reduce; every rank's gradients become the sums (ZeRO stage 0).
    `shards={param: RowShard}`: reduce-scatter; rank r receives the sums of its rows of
    every parameter in `shard_grads` (ZeRO stage 1); `.grad` is freed once packed.
    `reduce_dtype`: the dtype on the wire (the sums come back in the gradients' dtype).
    `align(p)`: puts `p.grad` in its parameter's layout (tensor parallel) before packing.
    """

    def __init__(self, params: list, comm: Comm, dim: str, bucket_mb: float = 25.0,
                 shards: dict | None = None, reduce_dtype: torch.dtype | None = None,
                 align=None):
        self.comm, self.dim = comm, dim
        self.shards, self.reduce_dtype, self.align = shards, reduce_dtype, align
        self.buckets = _make_buckets([p for p in params if p.requires_grad], bucket_mb)
        self.where = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self.armed = False
        self.ready = [0] * len(self.buckets)
        self.launched: dict = {}  # bucket index -> (flat tensor, async work)
        self.shard_grads: dict = {}  # param -> its reduced rows (shards mode), after finish()
        for bucket in self.buckets:
            for p in bucket:
                p.register_post_accumulate_grad_hook(self._on_grad)

    def arm(self):
        self.armed = True
        self.ready = [0] * len(self.buckets)

    def _on_grad(self, p):
        if self.armed:
            if self.align is not None:
                self.align(p)
            i = self.where[id(p)]
            self.ready[i] += 1
            if self.ready[i] == len(self.buckets[i]):
                self._launch(i)

    def _launch(self, i: int):
        grads = [_local(q.grad) for q in self.buckets[i]]
        dtype = self.reduce_dtype or grads[0].dtype
        if self.shards is None:
            flat = torch.cat([g.reshape(-1) for g in grads]).to(dtype)
            self.launched[i] = (flat, self.comm.all_reduce_sum(flat, self.dim, async_op=True))
            return
        send = torch.cat([self.shards[q].by_rank(g) for q, g in zip(self.buckets[i], grads)],
                         dim=1).to(dtype)  # [P, sum of padded pieces]: row r for rank r
        for q in self.buckets[i]:
            q.grad = None  # copied into `send`; only the reduced rows are needed from here
        out = send.new_empty(send.shape[1])
        self.launched[i] = (out, self.comm.reduce_scatter_flat(out, send.view(-1), self.dim,
                                                               async_op=True))

    def finish(self):
        for i, bucket in enumerate(self.buckets):
            if i not in self.launched:
                for q in bucket:
                    if q.grad is None:
                        q.grad = torch.zeros_like(q)
                    elif self.align is not None:
                        self.align(q)
                self._launch(i)
        for i, (flat, work) in self.launched.items():
            if work is not None:
                work.wait()
            self._unpack(self.buckets[i], flat)
        self.launched.clear()
        self.armed = False

    def _unpack(self, bucket: list, flat: torch.Tensor):
        offset = 0
        for q in bucket:
            if self.shards is None:
                g = _local(q.grad)
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
            else:
                shard = self.shards[q]
                self.shard_grads[q] = shard.unpack(flat[offset:]).to(q.dtype)
                offset += shard.padded_numel


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _make_buckets(params: list, bucket_mb: float) -> list[list]:
    """Reverse registration order (roughly the order backward produces grads)."""
    buckets, current, size = [], [], 0
    limit = bucket_mb * 2 ** 20
    for p in reversed(params):
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= limit:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


# -- after a failed collective: who is gone ---------------------------------------------

ROLL_CALL_SECONDS = 5.0  # how long survivors wait for each other beyond a timeout
_ROLL_CALL = "megaulysses/roll_call/"


def roll_call(timeout_s: float, timed_out: bool) -> Optional[list[int]]:
    """After a collective failed on this rank: the ranks that do not answer on the job's
    key-value store (dead or hung), or None when the store itself is gone (it lives in
    rank 0's process unless torchrun hosts it).

    A rank that failed because a peer's connection closed may have survivors still
    blocked in a collective (gloo frees no peer until its process exits, or times out),
    each failing within the timeout: the call lasts `timeout_s` + 5 s from the first
    failure. Once any rank has failed by timing out, every survivor blocked since that
    step has timed out too: 5 s from then. Every rank waits alike, so all name the same
    ranks. O(1) store requests per poll: it scales to large jobs. Rank 0 stays 2 s
    longer: the others read the store it may host."""
    store = dist.distributed_c10d._get_default_store()
    me, world = dist.get_rank(), dist.get_world_size()
    try:
        store.set(_key(str(me)), "1")
        if store.add(_key("count"), 1) == 1:  # the first failure sets the longest deadline
            store.set(_key("deadline"), repr(time.time() + timeout_s + ROLL_CALL_SECONDS))
        if timed_out and store.add(_key("timed_out"), 1) == 1:
            store.set(_key("timed_out_deadline"), repr(time.time() + ROLL_CALL_SECONDS))
        while store.add(_key("count"), 0) < world and time.time() < _deadline(store):
            time.sleep(0.5)
        return [r for r in range(world) if not store.check([_key(str(r))])]
    except (RuntimeError, OSError, ValueError):  # the store's host is gone
        return None
    finally:
        if me == 0:
            time.sleep(2.0)


def _key(name: str) -> str:
    return _ROLL_CALL + name


def _deadline(store) -> float:
    """The roll call's end: the first failure's, or sooner once a rank timed out."""
    deadline = float(store.get(_key("deadline")))
    if store.check([_key("timed_out_deadline")]):
        deadline = min(deadline, float(store.get(_key("timed_out_deadline"))))
    return deadline
