"""One call of chunked Ulysses attention (parallel/fpdt.py): its chunk geometry, its
exchanges and its host copies.

Exchanges. Under P > 1 ranks each chunk crosses Ulysses' all-to-all (`Comm`); at P = 1 (one
rank, or dp / tp grids with sp = 1) the all-to-all is the identity, so no collective is
issued: the "exchange" hands the chunk back as a contiguous tensor (a copy only where the
slice is not contiguous already), and the chunk loop, kernels, merge and host copies run
unchanged: one GPU's attention kernels then work on a chunk pair, not the sequence.

Host copies (`offload`): what backward needs goes to the host once (pinned beside a GPU;
on a CPU a real copy, marked as host memory for the live-bytes tracker) and comes back
to the device only while in use. Synchronous: simple, not overlapped with compute.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator, Optional, Union

import torch

from megaulysses.model.attention import AttentionMask
from megaulysses.model.attention.block import attention_block_size, plain_fused_kernel
from megaulysses.model.attention.dropout import AttentionDropout
from megaulysses.parallel.a2a_overlap import one_ahead
from megaulysses.parallel.comm import PendingAllToAll
from megaulysses.parallel.host_memory import mark_host

if TYPE_CHECKING:
    from megaulysses.parallel.fpdt import ChunkedUlyssesAttention


class Local:
    """The exchange of one rank with itself (P = 1): `wait()` returns the chunk, as
    `PendingAllToAll.wait()` returns the exchanged one, once."""

    def __init__(self, t: torch.Tensor):
        self.t: Optional[torch.Tensor] = t

    def wait(self) -> torch.Tensor:
        if self.t is None:
            raise RuntimeError("Local.wait() called twice: its result is given once")
        # contiguous as an exchange's result is (a no-op where the slice already is)
        t, self.t = self.t.contiguous(), None
        return t


Pending = Union[PendingAllToAll, Local]  # an exchange issued: `.wait()` -> its result


class ChunkPlan:
    """One call's chunk geometry, exchanges and host copies."""

    def __init__(self, core: ChunkedUlyssesAttention, q: torch.Tensor, k: torch.Tensor,
                 mask: AttentionMask, dropout: Optional[AttentionDropout] = None):
        self.comm, self.dim, self.P, self.C = core.comm, core.dim, core.P, core.chunks
        self.offload, self.device, self.overlap = core.offload, q.device, core.overlap
        self.n = q.shape[1]  # S/P local tokens
        self.L = self.n // self.C
        layout_block = mask.layout.block if mask.layout is not None else None
        self.block = attention_block_size(self.L, layout_block=layout_block)
        # None: the block kernel; always under dropout (its positional mask, dropout.py)
        self.kernel = plain_fused_kernel(q, k, k, mask) if dropout is None else None
        self.dropout = dropout
        self.causal, self.scale = mask.causal, q.shape[-1] ** -0.5
        starts = torch.arange(self.P, device=q.device).view(-1, 1) * self.n  # [P, 1]
        t = torch.arange(self.L, device=q.device).view(1, -1)  # [1, L]
        self.pos = [(starts + c * self.L + t).flatten() for c in range(self.C)]  # [P*L] int64

    def rows(self, c: int) -> slice:
        """Chunk c's rows of a local `[b, S/P, ...]` tensor."""
        return slice(c * self.L, (c + 1) * self.L)

    def exchanged(self, starts: list) -> Iterator[torch.Tensor]:
        """The results of `starts` (each issues one exchange) in order: overlapped, the
        next one in flight while the caller works on the current; else one at a time."""
        return one_ahead(starts) if self.overlap else (s().wait() for s in starts)

    def heads(self, t: Callable[[], torch.Tensor]) -> Callable[[], Pending]:
        """The exchange of what `t()` makes `[b, L, h, d]` -> `[b, P*L, h/P, d]` (heads
        scattered, sequence gathered), to issue when called (`exchanged`)."""
        return lambda: self._exchange(t(), scatter_dim=2, gather_dim=1)

    def land(self, dst: torch.Tensor, pending: list, keep: int = 1) -> None:
        """`back`'s exchanges issued, [(rows, exchange)]: each written into its rows
        of `dst` `[b, S/P, h, d]`; overlapped, the newest `keep` left in flight."""
        while len(pending) > (keep if self.overlap else 0):
            rows, p = pending.pop(0)
            dst[:, rows] = p.wait()

    def back(self, t: torch.Tensor) -> Pending:  # [b, P*L, h/P, d] -> [b, L, h, d]
        return self._exchange(t, scatter_dim=1, gather_dim=2)

    def _exchange(self, t: torch.Tensor, scatter_dim: int, gather_dim: int) -> Pending:
        """The exchange, issued: no collective at P = 1 (the identity)."""
        if self.P == 1:
            return Local(t)
        return self.comm.all_to_all_start(t, self.dim, scatter_dim=scatter_dim,
                                          gather_dim=gather_dim)

    def keep(self, t: torch.Tensor) -> torch.Tensor:
        """What backward needs: `t` itself, or with offload its host copy (pinned beside a
        GPU; on a CPU a real copy, marked as host memory). Synchronous, for simplicity."""
        if not self.offload:
            return t
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
        host.copy_(t)
        return mark_host(host)

    def fetch(self, t: torch.Tensor) -> torch.Tensor:
        """A kept tensor on the device (with offload a fresh, unmarked copy)."""
        if not self.offload:
            return t
        return t.clone() if self.device.type == "cpu" else t.to(self.device)

    def add(self, kept: Optional[torch.Tensor], part: torch.Tensor) -> torch.Tensor:
        """kept += part (fp32 accumulators, on the host with offload: fetched, added on the
        device, written back); the first part starts it."""
        if kept is None:
            return self.keep(part)
        if not self.offload:
            return kept.add_(part)
        kept.copy_(self.fetch(kept).add_(part))
        return kept
