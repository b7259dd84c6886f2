"""Ring attention over the "cp" mesh dim, inside Ulysses: Ulysses x Ring (USP).

The sequence degree is U * C: U Ulysses ranks (all-to-all, heads) times C ring ranks. The
sequence is cut into 2C chunks; ring rank c holds chunks c and 2C-1-c (zigzag), so under the
causal mask every ring rank has the same work: its early chunk attends little, its late
chunk much. Within a ring rank's S/C tokens the U Ulysses ranks hold consecutive slices;
Ulysses' all-to-all gives each of them all S/C tokens for hq/(tp U) heads, and the ring
then runs over the C ranks that hold the same heads.

Forward: C steps. At step t rank c holds the keys/values of ring rank (c - t) mod C, passes
them on to c + 1 while it computes its queries against them (model/block_attention.py:
only the blocks the mask reaches, in global positions, so causal, window, documents and
sparse layouts skip whole blocks here too), and merges the partial results by their
log-sum-exp (online softmax). Backward is the flash-attention decomposition over the same
steps: each step's key/value gradients travel with an accumulator that arrives back at its
owner after C passes.

Bytes sent per rank per layer (counted as "ring"), k and v `[b, S/(U C), hkv/?, d]` after
Ulysses, i.e. kv = b * (S/C) * (hkv_local) * d elements per tensor:
    forward   (C-1) * 2 * kv * element size         keys and values, C-1 passes
    backward  (C-1) * 2 * kv * element size + C * 2 * kv * 4 (fp32 gradient accumulators)
A rank never holds more than two ring steps' keys and values at once. Memory: one step's
partial (forward) or gradient shares (backward) at a time; the partials merge in place into
the running fp32 out, which is saved (and returned) in q's dtype with the fp32 lse; the
key/value gradients travel as partial_backward makes them (contiguous, no send copies).
"""

from __future__ import annotations

import torch

from megaulysses.model.attention import AttentionMask
from megaulysses.model.block_attention import (attention_block_size, merge, partial_backward,
                                               partial_forward)
from megaulysses.parallel.comm import Comm
from megaulysses.parallel.dims import CP


def zigzag_positions(seq: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions of ring rank `rank`'s tokens: chunks rank and 2cp-1-rank of 2cp."""
    if cp == 1:
        return torch.arange(seq, device=device)
    n = seq // (2 * cp)
    first = torch.arange(rank * n, (rank + 1) * n, device=device)
    second = torch.arange((2 * cp - 1 - rank) * n, (2 * cp - rank) * n, device=device)
    return torch.cat([first, second])


def local_positions(seq: int, cp: int, cp_rank: int, sp: int, sp_rank: int) -> torch.Tensor:
    """Global positions of the tokens this rank holds between attention layers: its
    Ulysses slice of its ring rank's zigzag chunks. (cp = 1: one contiguous slice.)"""
    mine = zigzag_positions(seq, cp, cp_rank)  # [S/C]
    n = len(mine) // sp
    return mine[sp_rank * n:(sp_rank + 1) * n]  # [S/(C U)]


def ring_bytes_per_layer(b: int, S: int, hkv_local: int, d: int, cp: int,
                         element_size: int) -> tuple[int, int]:
    """(forward, backward) bytes one rank sends per layer (module doc); hkv_local: kv heads
    one rank attends with after Ulysses."""
    kv = b * (S // cp) * hkv_local * d
    return (cp - 1) * 2 * kv * element_size, (cp - 1) * 2 * kv * element_size + cp * 2 * kv * 4


class RingAttention:
    """An attention core `(q, k, v, dropout_p, mask) -> out` over the ring rank's S/C
    tokens (its two zigzag chunks, in order), for whatever heads it is given."""

    def __init__(self, comm: Comm, dim: str = CP):
        self.comm, self.dim = comm, dim

    def __call__(self, q, k, v, dropout_p: float = 0.0, mask=None):  # [b, S/C, h, d]
        if dropout_p:
            raise ValueError("ring attention has no attention dropout")
        return _Ring.apply(q, k, v, mask or AttentionMask(), self.comm, self.dim)


def _setup(q, mask: AttentionMask, comm: Comm, dim: str):
    C, c = comm.size(dim), comm.rank(dim)
    S = q.shape[1] * C
    layout_block = mask.layout.block if mask.layout is not None else None
    block = attention_block_size(S // (2 * C), layout_block=layout_block)
    return C, c, S, block, zigzag_positions(S, C, c, q.device)


class _Ring(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, mask: AttentionMask, comm: Comm, dim: str):
        C, c, S, block, qi = _setup(q, mask, comm, dim)
        out = lse = None
        kv = [k, v]
        for step in range(C):
            passing = comm.ring_pass(kv, dim) if step < C - 1 else None
            kj = zigzag_positions(S, C, (c - step) % C, q.device)
            o, l = partial_forward(q, kv[0], kv[1], mask, qi, kj, block)  # [b, S/C, h, d] fp32
            # the first partial becomes the running out, merged into in place
            out, lse = (o, l) if out is None else merge(out, lse, o, l)
            del o, l  # this step's partial: gone before the next one is computed
            if passing is not None:
                kv = passing.wait()
            del passing
        del kv
        # Saved in q's dtype (fp32: the merged out itself), the very tensor returned: the
        # fp32 out goes under a half dtype; backward's delta takes its values in fp32.
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.comm, ctx.dim = mask, comm, dim
        return out

    @staticmethod
    def backward(ctx, dout):  # dout [b, S/C, hq, d]
        q, k, v, out, lse = ctx.saved_tensors
        mask, comm, dim = ctx.mask, ctx.comm, ctx.dim
        C, c, S, block, qi = _setup(q, mask, comm, dim)
        dout = dout.float()
        delta = (dout * out).sum(-1).transpose(1, 2)  # [b, hq, S/C], out's values in fp32
        dq = None
        kv, grads = [k, v], None
        for step in range(C):
            passing = comm.ring_pass(kv, dim) if step < C - 1 else None
            kj = zigzag_positions(S, C, (c - step) % C, q.device)
            # fp32, contiguous: dk_t and dv_t are sent as they are (no copies)
            dq_t, dk_t, dv_t = partial_backward(q, kv[0], kv[1], out, lse, dout, delta, mask,
                                                qi, kj, block)
            dq = dq_t if dq is None else dq.add_(dq_t)
            del dq_t
            if grads is not None:  # the accumulator of this step's keys, from the last rank
                dk_acc, dv_acc = grads.wait()
                dk_t += dk_acc
                dv_t += dv_acc
                del dk_acc, dv_acc
            grads = comm.ring_pass([dk_t, dv_t], dim)  # after C passes: back at the owner
            del dk_t, dv_t  # the send holds them until the next step's wait
            if passing is not None:
                kv = passing.wait()
            del passing
        del kv
        dk, dv = grads.wait()
        del grads
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def apply_context_parallel(model, comm: Comm, dim: str = CP):
    """Swap every block's attention core for ring attention (before Ulysses wraps it)."""
    if comm.size(dim) == 1:
        return model
    for layer in model.layers.values():
        if layer is not None:
            layer.attn.core = RingAttention(comm, dim)
    return model
