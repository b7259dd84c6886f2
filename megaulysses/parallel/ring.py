"""Ring attention over the "cp" mesh dim, inside Ulysses: Ulysses x Ring (USP).

The sequence degree is U * C: U Ulysses ranks (all-to-all, heads) times C ring ranks. The
sequence is cut into 2C chunks; ring rank c holds chunks c and 2C-1-c (zigzag), so under the
causal mask every ring rank has the same work: its early chunk attends little, its late
chunk much. Within a ring rank's S/C tokens the U Ulysses ranks hold consecutive slices;
Ulysses' all-to-all gives each of them all S/C tokens for hq/(tp U) heads, and the ring
then runs over the C ranks that hold the same heads.

Forward: C steps. At step t rank c holds the keys/values of ring rank (c - t) mod C, passes
them on to c + 1 while it computes its queries against them, and merges the partial results
by their log-sum-exp (online softmax, `merge`, exact to fp32 rounding). A step runs on
  - a fused kernel with lse (model/attention/fused.py: flash-attn or torch's fused SDPA ops)
    when the mask is plain causal or full: under the zigzag every causal step is then one
    causal square (its own keys) or one full rectangle (`fused_step`), one kernel call,
    chosen from Python integers (no host sync);
  - else the block kernel (model/attention/block.py: only the blocks the mask reaches, in
    global positions, so windows, documents and sparse layouts skip whole blocks here too),
    and always under attention dropout: the mask of model/attention/dropout.py, a hash of
    global head and positions, so the ring drops exactly what one process drops. Each
    partial is dropped after its row sum (lse of the undropped softmax), so the merge by
    lse stays exact.
Backward is the flash-attention decomposition over the same steps (each kernel's backward
given the final out and lse returns its key set's share): each step's key/value gradients
travel with an accumulator that arrives back at its owner after C passes.

Bytes sent per rank per layer (counted as "ring"), k and v `[b, S/(U C), hkv/?, d]` after
Ulysses, i.e. kv = b * (S/C) * (hkv_local) * d elements per tensor:
    forward   (C-1) * 2 * kv * element size         keys and values, C-1 passes
    backward  (C-1) * 2 * kv * element size + C * 2 * kv * 4 (fp32 gradient accumulators)
A rank never holds more than two ring steps' keys and values at once. Memory: one step's
partial (forward) or gradient shares (backward) at a time; the partials merge in place into
the running fp32 out (fused steps' half-dtype partials cast to fp32 first), which is saved
(and returned) in q's dtype with the fp32 lse; each step's key/value shares are added into
the fp32 accumulators that arrive (step 0 starts them), which are sent on as they are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from megaulysses.model.attention import AttentionMask
from megaulysses.model.attention.block import (attention_block_size, merge, partial_backward,
                                               partial_forward, plain_fused_kernel)
from megaulysses.model.attention.dropout import AttentionDropout, DropoutArg, as_dropout
from megaulysses.model.attention.fused import FusedKernel
from megaulysses.parallel.blocks import blocks
from megaulysses.parallel.comm import Comm
from megaulysses.parallel.dims import CP

if TYPE_CHECKING:
    from megaulysses.model.gpt import GPT


def zigzag_positions(seq: int, cp: int, rank: int,
                     device: Optional[torch.device] = None) -> torch.Tensor:
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

    def __call__(self, q, k, v, dropout_p: DropoutArg = 0.0, mask=None):  # [b, S/C, h, d]
        return _Ring.apply(q, k, v, mask or AttentionMask(), self.comm, self.dim,
                           as_dropout(dropout_p))


def _setup(q, mask: AttentionMask, comm: Comm, dim: str):
    C, c = comm.size(dim), comm.rank(dim)
    S = q.shape[1] * C
    layout_block = mask.layout.block if mask.layout is not None else None
    block = attention_block_size(S // (2 * C), layout_block=layout_block)
    return C, c, S, block, zigzag_positions(S, C, c, q.device)


class _Ring(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, mask: AttentionMask, comm: Comm, dim: str,
                dropout: Optional[AttentionDropout]):
        # dropout: the block kernel's positional mask (the fused kernels cannot apply it)
        kernel = plain_fused_kernel(q, k, v, mask) if dropout is None else None
        step = _steps(q, mask, comm, dim, kernel, dropout)
        out, lse = None, None
        kv = [k, v]
        for t in range(step.C):
            passing = comm.ring_pass(kv, dim) if t < step.C - 1 else None
            rows, o, l = step.forward(t, kv)  # this step's partial, its rows only
            out, lse = _merge_rows(out, lse, rows, o, l)
            del o, l  # this step's partial: gone before the next one is computed
            if passing is not None:
                kv = passing.wait()
            del passing
        del kv
        # Saved in q's dtype (fp32: the merged out itself), the very tensor returned: the
        # fp32 out goes under a half dtype (the fused kernels' backward takes q's dtype; the
        # block kernel's delta takes out's values in fp32).
        assert out is not None, "a ring has at least one step"
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.comm, ctx.dim, ctx.kernel = mask, comm, dim, kernel
        ctx.dropout = dropout  # backward draws the same masks again
        return out

    @staticmethod
    def backward(ctx, dout):  # dout [b, S/C, hq, d]
        q, k, v, out, lse = ctx.saved_tensors
        mask, comm, dim, kernel = ctx.mask, ctx.comm, ctx.dim, ctx.kernel
        step = _steps(q, mask, comm, dim, kernel, ctx.dropout)
        step.start_backward(dout, out, lse)
        dq = None
        kv, grads = [k, v], None
        for t in range(step.C):
            passing = comm.ring_pass(kv, dim) if t < step.C - 1 else None
            rows, dq_t, keys, dk_t, dv_t = step.backward(t, kv)
            dq = dq_t.float() if dq is None else _add_rows(dq, rows, dq_t)  # step 0: all rows
            del dq_t
            if grads is None:  # step 0: the shares of all the rank's own keys start the sums
                dk_acc, dv_acc = dk_t.float(), dv_t.float()
            else:  # the sums for this step's keys, from the last rank: add this rank's share
                dk_acc, dv_acc = grads.wait()
                del grads  # its works hold the sums sent last step: they go now
                _add_rows(dk_acc, keys, dk_t)
                _add_rows(dv_acc, keys, dv_t)
            del dk_t, dv_t
            grads = comm.ring_pass([dk_acc, dv_acc], dim)  # after C passes: back at the owner
            del dk_acc, dv_acc  # the send holds them until the next step's wait
            if passing is not None:
                kv = passing.wait()
            del passing
        del kv
        dk, dv = grads.wait()
        del grads
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


ALL = slice(None)


def _steps(q, mask: AttentionMask, comm: Comm, dim: str, kernel: Optional[FusedKernel],
           dropout: Optional[AttentionDropout] = None):
    return (_FusedSteps(q, mask, comm, dim, kernel) if kernel is not None
            else _BlockSteps(q, mask, comm, dim, dropout))


def _merge_rows(out, lse, rows: slice, o, l):
    """Merge a step's partial (o `[b, rows, hq, d]`, l `[b, hq, rows]`) into the running fp32
    out and lse by their lse, in place; the first partial (all rows) starts them."""
    o = o.float()  # fp32 partials under a half dtype: the merge stays exact to fp32
    if out is None:
        return o, l
    if rows == ALL:
        return merge(out, lse, o, l)
    lse_rows = merge(out[:, rows], lse[:, :, rows], o, l)[1]  # out's rows merged in place
    lse[:, :, rows] = lse_rows
    return out, lse


def _add_rows(acc: torch.Tensor, rows: slice, x: torch.Tensor) -> torch.Tensor:
    """acc[:, rows] += x in place (fp32 acc, x in any dtype: cast as it is read); acc."""
    acc[:, rows].add_(x)
    return acc


def fused_step(causal: bool, c: int, src: int, n: int) -> tuple[slice, slice, bool]:
    """(query rows, key rows, causal) of ring rank c's step against ring rank src's keys
    (n = S/(2C) positions per zigzag chunk): the part of the mask that is not empty, one
    causal square or one full rectangle. Causal:
        src == c  both chunks against both: causal (positions increase along the rows)
        src <  c  all queries against src's early chunk, which precedes both of c's: full
                  (src's late chunk follows both of c's: skipped)
        src >  c  c's late chunk against both of src's chunks, which precede it: full
                  (c's early chunk precedes both: its rows get nothing from src)
    A full mask: everything against everything at every step."""
    if not causal:
        return ALL, ALL, False
    if src == c:
        return ALL, ALL, True
    if src < c:
        return ALL, slice(0, n), False
    return slice(n, None), ALL, False


class _FusedSteps:
    """Ring steps on a fused kernel (model/attention/fused.py): one call each, the step's
    rectangle from Python integers alone (no host sync)."""

    def __init__(self, q, mask: AttentionMask, comm: Comm, dim: str, kernel: FusedKernel):
        self.q, self.kernel, self.causal = q, kernel, mask.causal
        self.C, self.c = comm.size(dim), comm.rank(dim)
        self.n, self.scale = q.shape[1] // 2, q.shape[-1] ** -0.5

    def _plan(self, t: int) -> tuple[slice, slice, bool]:
        return fused_step(self.causal, self.c, (self.c - t) % self.C, self.n)

    def forward(self, t: int, kv):
        rows, keys, causal = self._plan(t)
        o, l = self.kernel.forward(self.q[:, rows], kv[0][:, keys], kv[1][:, keys], causal,
                                   self.scale)  # [b, rows, hq, d] q's dtype, [b, hq, rows]
        return rows, o, l

    def start_backward(self, dout, out, lse):
        self.dout, self.out, self.lse = dout.contiguous(), out, lse

    def backward(self, t: int, kv):
        rows, keys, causal = self._plan(t)
        dq, dk, dv = self.kernel.backward(
            self.dout[:, rows], self.q[:, rows], kv[0][:, keys], kv[1][:, keys],
            self.out[:, rows], self.lse[:, :, rows], causal, self.scale)  # q's dtype
        return rows, dq, keys, dk, dv


class _BlockSteps:
    """Ring steps on the block kernel (model/attention/block.py): only the blocks the mask
    reaches, in global positions, for any mask; attention dropout by the positional mask
    of the queries' and keys' global positions (model/attention/dropout.py), so each
    (query, key) pair is dropped as in one process whichever step meets it."""

    def __init__(self, q, mask: AttentionMask, comm: Comm, dim: str,
                 dropout: Optional[AttentionDropout] = None):
        self.q, self.mask, self.dropout = q, mask, dropout
        self.C, self.c, self.S, self.block, self.qi = _setup(q, mask, comm, dim)

    def _keys(self, t: int) -> torch.Tensor:
        return zigzag_positions(self.S, self.C, (self.c - t) % self.C, self.q.device)

    def forward(self, t: int, kv):
        o, l = partial_forward(self.q, kv[0], kv[1], self.mask, self.qi, self._keys(t),
                               self.block, dropout=self.dropout)  # [b, S/C, hq, d] fp32
        return ALL, o, l

    def start_backward(self, dout, out, lse):
        self.dout = dout.float()
        self.out, self.lse = out, lse
        self.delta = (self.dout * out).sum(-1).transpose(1, 2)  # [b, hq, S/C], fp32

    def backward(self, t: int, kv):
        # fp32, contiguous: dk and dv become the accumulators sent on (no copies)
        dq, dk, dv = partial_backward(self.q, kv[0], kv[1], self.out, self.lse, self.dout,
                                      self.delta, self.mask, self.qi, self._keys(t),
                                      self.block, self.dropout)
        return ALL, dq, ALL, dk, dv


def apply_context_parallel(model: GPT, comm: Comm, dim: str = CP) -> GPT:
    """Swap every block's attention core for ring attention (before Ulysses wraps it)."""
    if comm.size(dim) == 1:
        return model
    for layer in blocks(model):
        layer.attn.core = RingAttention(comm, dim)
    return model
