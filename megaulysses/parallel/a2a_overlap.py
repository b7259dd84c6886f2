"""Ulysses' all-to-all hidden behind compute: an exchange issued now, waited for at use,
with autograd whose backward is issued and waited for the same way.

`start(comm, x, dim, scatter_dim, gather_dim)` issues `Comm.all_to_all`'s exchange of `x`
(comm.py's `all_to_all_start`, asynchronous) and returns an `Exchange`; its `wait()`
returns the very tensor `comm.all_to_all` would, bit for bit (an exchange moves bytes,
computes nothing), with the same bytes counted. What runs between the two calls runs while
the exchange is in flight.

Autograd: two nodes, `_Start` (x -> an empty token) and `_Finish` (token -> the result).
Backward reaches `_Finish` first, which issues the gradient's exchange and returns at
once; `_Start`, reached later, waits for it and hands x its gradient. The engine runs
nodes in reverse order of creation, so whatever was created between the forward's issue
and wait (the core of the group before, parallel/head_groups.py) runs backward between
the gradient's issue and wait: the overlap mirrored. The token is a 0-element tensor, so
a checkpoint that keeps it as an input keeps nothing.

Who uses it:
  UlyssesAttention (G = 1)   q, k and v issued together, waited in order (k and v in
                             flight while q is waited for and unpacked); their gradients
                             likewise. Nothing computes between: the core needs all three,
                             the out-projection the output (exchanged blocking).
  HeadGroups (G > 1)         group g+1's q, k, v in flight while group g's core runs, and
                             group g's output while group g+1's core runs; backward, group
                             g-1's output gradient while group g's core runs backward, and
                             group g+1's input gradients. Not overlapped: the exchange of
                             each group's recomputation (right before its backward).
  ChunkedUlyssesAttention    one chunk ahead: chunk i+1's q (and backward dout) in flight
  (FPDT)                     while chunk i attends, chunk i's out (and dq) while chunk i+1
                             does; k and v, all exchanged before the first query chunk,
                             one ahead of each other only.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional, Sequence

import torch

from megaulysses.parallel.comm import Comm, PendingAllToAll


class Exchange:
    """An all-to-all in flight (`start`); `wait()` returns its result, once."""

    def __init__(self, comm: Comm, x: torch.Tensor, dim: str, scatter_dim: int,
                 gather_dim: int):
        self.comm, self.dim, self.dims = comm, dim, (scatter_dim, gather_dim)
        self.pending: Optional[PendingAllToAll] = None  # forward's exchange
        self.grad: Optional[PendingAllToAll] = None  # backward's
        if comm.size(dim) == 1:
            self.result: Optional[torch.Tensor] = x
        elif torch.is_grad_enabled() and x.requires_grad:
            self.result = None
            self.token = _Start.apply(x, self)
        else:  # no autograd: the exchange alone
            self.result, self.token = None, None
            self.pending = comm.all_to_all_start(x, dim, scatter_dim, gather_dim)

    def wait(self) -> torch.Tensor:
        if self.result is not None:  # P = 1
            out, self.result = self.result, None
            return out
        if self.token is None:
            return self.take_pending().wait()
        token, self.token = self.token, None
        return _Finish.apply(token, self)

    def take_pending(self) -> PendingAllToAll:
        """The forward's exchange, handed over once."""
        pending, self.pending = self.pending, None
        if pending is None:
            raise RuntimeError("Exchange.wait() called twice: its result is given once")
        return pending


def start(comm: Comm, x: torch.Tensor, dim: str, scatter_dim: int,
          gather_dim: int) -> Exchange:
    """Issue `comm.all_to_all(x, dim, scatter_dim, gather_dim)`; `.wait()` at use."""
    return Exchange(comm, x, dim, scatter_dim, gather_dim)


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ex: Exchange):
        ctx.ex = ex
        ex.pending = ex.comm.all_to_all_start(x, ex.dim, *ex.dims)
        return x.new_empty(0)  # the token: nothing kept, nothing sent

    @staticmethod
    def backward(ctx, _):
        ex = ctx.ex
        assert ex.grad is not None, "_Finish.backward runs first and issues it"
        grad, ex.grad = ex.grad.wait(), None  # issued by _Finish.backward
        return grad, None


class _Finish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token, ex: Exchange):
        ctx.ex = ex
        return ex.take_pending().wait()

    @staticmethod
    def backward(ctx, grad):
        ex = ctx.ex
        scatter_dim, gather_dim = ex.dims  # the inverse exchange: the dims swapped
        ex.grad = ex.comm.all_to_all_start(grad.contiguous(), ex.dim, gather_dim, scatter_dim)
        return grad.new_empty(0), None  # the token's (nothing); x's comes from _Start


def one_ahead(starts: Sequence[Callable[[], PendingAllToAll]]) -> Iterator[torch.Tensor]:
    """The results of raw exchanges (`Comm.all_to_all_start` calls, no autograd) in order,
    each yielded with the next one already issued: one in flight while the caller works
    on the current (FPDT's chunks, inside its own autograd Function)."""
    if not starts:
        return
    pending = starts[0]()
    for i in range(len(starts)):
        nxt = starts[i + 1]() if i + 1 < len(starts) else None
        yield pending.wait()
        if nxt is not None:  # None after the last one only
            pending = nxt
