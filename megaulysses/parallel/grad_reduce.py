"""Gradient reduction over a mesh dim, and the row layout ZeRO shards by.

`GradReducer` sums gradients while backward still runs: bucketed (`BUCKET_MB` per bucket,
in reverse registration order), one async all-reduce (ZeRO stage 0) or reduce-scatter onto
each rank's rows (ZeRO stage 1) per bucket, issued through `parallel.comm.Comm`.
`RowShard` is that row layout: a tensor cut along dim 0 the way torch.chunk (and FSDP2)
cuts it. Both are about who holds which gradient and optimizer rows, not collectives
themselves: comm.py holds those.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megaulysses.parallel.comm import Comm

BUCKET_BYTES = 25 * 2 ** 20  # GradReducer's default bucket (the memory plan counts it)
BUCKET_MB = BUCKET_BYTES / 2 ** 20


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
    `align([p])`: puts `p.grad` in its parameter's layout (tensor parallel) before packing.
    """

    def __init__(self, params: list, comm: Comm, dim: str, bucket_mb: float = BUCKET_MB,
                 shards: dict | None = None, reduce_dtype: torch.dtype | None = None,
                 align: Optional[Callable[[list], None]] = None):
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

    def arm(self) -> None:
        self.armed = True
        self.ready = [0] * len(self.buckets)

    def _on_grad(self, p):
        if self.armed:
            if self.align is not None:
                self.align([p])
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
        pieces = zip(self.buckets[i], grads, strict=True)
        send = torch.cat([self.shards[q].by_rank(g) for q, g in pieces],
                         dim=1).to(dtype)  # [P, sum of padded pieces]: row r for rank r
        for q in self.buckets[i]:
            q.grad = None  # copied into `send`; only the reduced rows are needed from here
        out = send.new_empty(send.shape[1])
        self.launched[i] = (out, self.comm.reduce_scatter_flat(out, send.view(-1), self.dim,
                                                               async_op=True))

    def finish(self) -> None:
        for i, bucket in enumerate(self.buckets):
            if i not in self.launched:
                for q in bucket:
                    if q.grad is None:
                        q.grad = torch.zeros_like(q)  # already in q's layout
                if self.align is not None:
                    self.align(bucket)
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


def bucket_bytes(par, numel: int, itemsize: int) -> int:
    """Bytes per bucket (`_make_buckets` closes a bucket once it holds this many) of a
    rank's `numel` parameters held in `itemsize`-byte gradients: Megatron-LM's
    --ddp-num-buckets (numel // it parameters each) over --ddp-bucket-size (parameters),
    else BUCKET_BYTES."""
    if par.ddp_num_buckets is not None:
        return itemsize * max(numel // par.ddp_num_buckets, 1)
    if par.ddp_bucket_size is not None:
        return itemsize * par.ddp_bucket_size
    return BUCKET_BYTES


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


def _storage_bytes(t, seen: set) -> int:
    """Bytes of `t`'s storage at its allocated size, 0 if `seen` holds it (then it does)."""
    if t is None:
        return 0
    storage = _local(t).untyped_storage()
    key = storage._cdata  # not data_ptr(): 0 for every meta or fake storage
    if storage.nbytes() == 0 or key in seen:
        return 0
    seen.add(key)
    return storage.nbytes()
