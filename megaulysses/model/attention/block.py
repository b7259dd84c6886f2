"""The block kernel: masked attention by blocks of queries and keys, flash-style, in plain
torch ops.

The sequence is cut into blocks of `block` positions. `AttentionMask.block_kinds` classes
every (query block, key block) pair as SKIP, PARTIAL or FULL from the blocks' position
ranges alone. For each query block, the key blocks that are not SKIP are taken (a view of
k and v when they form one range, else gathered) and its scores against them computed in
one matmul; the element mask is built (and applied) only when one of them is PARTIAL.
Skipped pairs cost nothing: a sliding window of w tokens computes about
(w / block + 1) key blocks per query block whatever the length.

Each query block sees all its keys at once, so its softmax is complete within the step
(no online rescaling). Forward keeps, per query row, only the output and
lse = logsumexp of its scaled scores over the allowed keys (fp32). Backward recomputes a
query block's probabilities from them, P = exp(S / sqrt(d) - lse), and with
delta = rowsum(dO * O) (which equals rowsum(dP * P)) gets dS = P * (dO V^T - delta), so
nothing of size [s, s] is ever kept: saved are q, k, v, out and lse. At most one query
block's scores, [b * hq, block, keys attended], exist at a time (backward: its P and dS),
each dropped before the next block's are made. Outputs and gradients are accumulated
block by block into tensors already laid out as returned (contiguous `[b, s, h, d]`;
the whole-sequence kernel's out in q's dtype), so nothing is ungrouped by a copy and the
saved out is the very tensor the out projection reads.

The same steps serve the ring attention (`parallel/ring.py`), where a rank holds only some
positions: `partial_forward` attends a set of query rows to one set of keys (positions
`qi`, `kj`), `merge` combines the partials of several key sets by their lse (in place), and
`partial_backward`, given the final out and lse, returns one key set's share of the
gradients (the shares over a partition of the keys sum to the full gradient).

A plain causal or full mask needs no blocks: `masked_block_attention` and the ring run it
on a fused kernel with lse (fused.py, `plain_fused_kernel`), one call each way, where one
exists for the device and dtype; the blocks serve every other mask.

Attention dropout (`dropout`, dropout.py) runs on the blocks only: each query block's
mask is hashed from the global positions of its rows and keys and the global heads, after
the row sums are taken (lse stays the undropped softmax's, so partials merge exactly), and
hashed again in backward (nothing of it is kept). Its rows, keys and heads are the same
wherever the pair is computed, so the ring's steps and FPDT's chunk pairs drop what the
whole-sequence kernel drops.

GQA: q is viewed as `[b, hkv, s * rep, d]` with rows ordered (position, head in group), so a
block of positions is a contiguous range of rows served by one kv head, as in
block_causal.py's `block_causal_attention`; the element mask is repeated `rep` times along
the rows. Scores, softmax statistics, partial outputs and gradients are fp32 whatever the
input dtype (the whole-sequence kernel casts each output block as it stores it); the
matmuls run in the input dtype.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterator, Optional, Union

import torch

from megaulysses.model.attention.dropout import AttentionDropout
from megaulysses.model.attention.fused import FusedKernel, fused_kernel
from megaulysses.model.attention.mask import PARTIAL, SKIP, AttentionMask

Keys = Union[slice, torch.Tensor]  # the selected keys: a range, or gathered row indices


def attention_block_size(*lengths: int, layout_block: Optional[int] = None,
                         default: int = 64) -> int:
    """The largest power of two <= `default` dividing every length (and `layout_block`)."""
    block = 1 << (max(int(default), 1).bit_length() - 1)
    while block > 1 and any(n % block for n in (*lengths, layout_block or block)):
        block //= 2
    return block


# ---- grouping: [b, s, h, d] -> [b, hkv, s * rep, d] ---------------------------------------


def _group_q(x: torch.Tensor, hkv: int) -> torch.Tensor:  # [b, s, hq, d] -> [b, hkv, s*rep, d]
    b, s, hq, d = x.shape
    return x.reshape(b, s, hkv, hq // hkv, d).transpose(1, 2).reshape(b, hkv, -1, d)


def _group_rows(x: torch.Tensor, hkv: int) -> torch.Tensor:  # [b, hq, s] -> [b, hkv, s*rep]
    b, hq, s = x.shape
    return x.reshape(b, hkv, hq // hkv, s).transpose(2, 3).reshape(b, hkv, -1)


def _by_group(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """[b, s, hq, ...] (contiguous) -> a view `[b, hkv, s, rep, ...]` of it: a query block's
    rows of the grouped layout, `[b, hkv, block * rep, ...]`, are `[:, :, positions]` of it."""
    b, s, hq = x.shape[:3]
    return x.view(b, s, hkv, hq // hkv, *x.shape[3:]).transpose(1, 2)


def _group_kv(x: torch.Tensor) -> torch.Tensor:  # [b, s, hkv, d] -> [b, hkv, s, d]
    return x.transpose(1, 2).contiguous()


# ---- the plan: which key blocks each query block computes ---------------------------------


def _per_sample(mask: AttentionMask, batch: int) -> Iterator[tuple[slice, AttentionMask]]:
    """(samples, their mask): the whole batch at once, or one sample at a time when the
    documents (and so the block kinds) differ between samples."""
    docs = mask.documents
    if docs is None or docs.shape[0] == 1:
        yield slice(None), mask
        return
    if docs.shape[0] != batch:
        raise ValueError(f"documents of {docs.shape[0]} samples for a batch of {batch}")
    for i in range(batch):
        yield slice(i, i + 1), mask.with_documents(docs[i:i + 1])


def _plan(mask: AttentionMask, qi: torch.Tensor, kj: torch.Tensor, block: int, batch: int,
          rep: int) -> Iterator[tuple[slice, int, Keys, Optional[torch.Tensor]]]:
    """Yields (samples, query block, keys, allowed) for every query block with a key block
    to compute; allowed: bool `[1, 1, block * rep, keys]` or None where all are FULL."""
    for samples, smask in _per_sample(mask, batch):
        kinds = smask.block_kinds(qi, kj, block)[0].cpu()  # [nq, nk]
        # A kept block pair passed the layout rule whole (block divides the layout block),
        # so the element mask needs only the other rules.
        elements = replace(smask, layout=None)
        for qb in range(kinds.shape[0]):
            picked = (kinds[qb] > SKIP).nonzero().flatten()  # [n] key block indices
            if len(picked) == 0:
                continue
            keys = _keys(picked, block, kj.device)
            allowed = None
            if bool((kinds[qb, picked] == PARTIAL).any()):
                q_pos = qi[qb * block:(qb + 1) * block]
                allowed = elements.allows(q_pos, kj[keys])  # [1, block, K]
                allowed = allowed.repeat_interleave(rep, dim=1).unsqueeze(1)  # [1, 1, R, K]
            yield samples, qb, keys, allowed


def _keys(picked: torch.Tensor, block: int, device) -> Keys:
    lo, hi = int(picked[0]), int(picked[-1]) + 1
    if hi - lo == len(picked):
        return slice(lo * block, hi * block)
    offsets = torch.arange(block)
    return (picked.view(-1, 1) * block + offsets).flatten().to(device)  # [n * block]


def computed_pairs(mask: AttentionMask, qi: torch.Tensor, kj: torch.Tensor, block: int,
                   batch: int = 1) -> int:
    """(query block, key block) pairs the kernels compute, summed over the per-sample
    passes (one pass for the whole batch without documents)."""
    return sum(_count(keys, block)
               for _, _, keys, _ in _plan(mask, qi, kj, block, batch, rep=1))


def _count(keys: Keys, block: int) -> int:
    n = keys.stop - keys.start if isinstance(keys, slice) else len(keys)
    return n // block


def _take(x: torch.Tensor, keys: Keys) -> torch.Tensor:  # [b, hkv, s, d] -> [b, hkv, K, d]
    return x[:, :, keys] if isinstance(keys, slice) else x.index_select(2, keys)


def _put(dst: torch.Tensor, keys: Keys, src: torch.Tensor) -> None:  # dst[:, :, keys] += src
    if isinstance(keys, slice):
        dst[:, :, keys] += src
    else:
        dst.index_add_(2, keys, src)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in b's dtype, fp32 result."""
    return torch.matmul(a.to(b.dtype), b).float()


def _scores(q: torch.Tensor, k: torch.Tensor, allowed: Optional[torch.Tensor]) -> torch.Tensor:
    """fp32 `[b', hkv, R, K]` scores of (scaled) q `[b', hkv, R, d]` against k `[b', hkv, K, d]`,
    -inf where not allowed."""
    scores = _mm(q, k.transpose(2, 3))
    if allowed is not None:
        scores.masked_fill_(~allowed, float("-inf"))
    return scores


def _dropped(dropout: AttentionDropout, samples: slice, b: int, hkv: int, rep: int,
             q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """bool `[b', hkv, block * rep, K]`, True where dropped: the grouped rows of positions
    q_pos for the samples, against key positions k_pos (global: block.py's callers' qi, kj)."""
    idx = torch.arange(b, device=q_pos.device)[samples]  # [b'] sample indices
    return dropout.dropped(dropout.grouped_rows(idx, hkv, rep, q_pos), k_pos)


# ---- partials ----------------------------------------------------------------------------


def partial_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask,
                    qi: torch.Tensor, kj: torch.Tensor, block: int,
                    out_dtype: torch.dtype = torch.float32,
                    dropout: Optional[AttentionDropout] = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q rows (positions qi) over one key set (positions kj), no autograd.

    q `[b, sq, hq, d]`, k and v `[b, sk, hkv, d]`. Returns out `[b, sq, hq, d]` (contiguous,
    `out_dtype`: each block's fp32 result cast as it is stored), normalized over this set's
    allowed keys (0 for rows with none), and lse `[b, hq, sq]` fp32 (-inf for rows with
    none). One query block's scores are alive at a time (under a half dtype also their
    cast for the matmul, the fp32 ones freed first).

    `dropout`: the probabilities are dropped after their row sum is taken (lse is that of
    the undropped softmax), so partials over disjoint key sets still merge exactly."""
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    rep = hq // hkv
    qg = _group_q(q, hkv) * d ** -0.5  # [b, hkv, sq*rep, d], scaled
    kg, vg = _group_kv(k), _group_kv(v)  # [b, hkv, sk, d]
    # written block by block through grouped views: no ungrouping copy at the end
    out = torch.zeros(q.shape, dtype=out_dtype, device=q.device)  # [b, sq, hq, d]
    lse = torch.full((b, hq, sq), float("-inf"), dtype=torch.float32, device=q.device)
    out_g = _by_group(out, hkv)  # [b, hkv, sq, rep, d]
    lse_g = lse.view(b, hkv, rep, sq).transpose(2, 3)  # [b, hkv, sq, rep]
    for samples, qb, keys, allowed in _plan(mask, qi, kj, block, b, rep):
        rows = slice(qb * block * rep, (qb + 1) * block * rep)
        pos = slice(qb * block, (qb + 1) * block)
        scores = _scores(qg[samples, :, rows], _take(kg[samples], keys), allowed)  # [b', hkv, R, K]
        top = scores.amax(dim=-1, keepdim=True)  # [b', hkv, R, 1]
        top.masked_fill_(top == float("-inf"), 0.0)  # rows with no key: exp(-inf) = 0 below
        p = scores.sub_(top).exp_()  # [b', hkv, R, K], unnormalized
        total = p.sum(dim=-1, keepdim=True)  # [b', hkv, R, 1]: >= 1 (the max) or 0
        if dropout is not None:  # after the sum: the softmax's normalizer is undropped
            dropout.apply_(p, _dropped(dropout, samples, b, hkv, rep, qi[pos], kj[keys]))
        vb = _take(vg[samples], keys)  # [b', hkv, K, d]
        p = p.to(vb.dtype)  # the matmul's operand; the fp32 probabilities go (half dtype)
        del scores
        o = torch.matmul(p, vb).float().div_(total.clamp_min(1.0))  # [b', hkv, R, d]
        n = o.shape[0]
        out_g[samples, :, pos] = o.view(n, hkv, block, rep, d)
        lse_g[samples, :, pos] = (top + total.log()).view(n, hkv, block, rep)  # log 0 = -inf
        del p, o, vb, top, total  # before the next block's scores
    return out, lse


def partial_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, dout: torch.Tensor, delta: Optional[torch.Tensor],
                     mask: AttentionMask, qi: torch.Tensor, kj: torch.Tensor,
                     block: int, dropout: Optional[AttentionDropout] = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This key set's share of the gradients, fp32 and contiguous: (dq `[b, sq, hq, d]`, dk
    and dv `[b, sk, hkv, d]`).

    out `[b, sq, hq, d]` and lse `[b, hq, sq]` are the final ones over all keys; dout
    `[b, sq, hq, d]`; delta `[b, hq, sq]` = rowsum(dout * out) (computed from out if None).
    P = exp(S / sqrt(d) - lse), dV = P^T dO, dS = P (dO V^T - delta), dQ = dS K / sqrt(d),
    dK = dS^T Q / sqrt(d). One query block's P and dS are alive at a time (P freed once dS
    is made; under a half dtype dS is cast once for both matmuls, the fp32 one freed).

    With `dropout` (the forward's, so the same mask is drawn again) and D its scaled keep
    mask: O = (P * D) V, so dV = (P * D)^T dO and dS = P (D (dO V^T) - delta); delta =
    rowsum(dO * O) still equals rowsum(P * D (dO V^T))."""
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    rep = hq // hkv
    if delta is None:  # out's fp32 values on the fly: no fp32 copy of it
        delta = (dout.float() * out).sum(-1).transpose(1, 2)  # [b, hq, sq]
    qg = _group_q(q, hkv) * d ** -0.5  # [b, hkv, sq*rep, d], scaled
    kg, vg = _group_kv(k), _group_kv(v)  # [b, hkv, sk, d]
    dog = _group_q(dout, hkv)  # [b, hkv, sq*rep, d]
    lseg = _group_rows(lse.float(), hkv).unsqueeze(-1)  # [b, hkv, sq*rep, 1]
    lseg = lseg.masked_fill(lseg == float("-inf"), float("inf"))  # no key at all: P = 0
    deltag = _group_rows(delta.float(), hkv).unsqueeze(-1)  # [b, hkv, sq*rep, 1]
    # accumulated through grouped views of the returned layout: no copies at the end
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # [b, sq, hq, d]
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)  # [b, sk, hkv, d]
    dv = torch.zeros_like(dk)
    dq_g = _by_group(dq, hkv)  # [b, hkv, sq, rep, d]
    dk_g, dv_g = dk.transpose(1, 2), dv.transpose(1, 2)  # [b, hkv, sk, d]
    for samples, qb, keys, allowed in _plan(mask, qi, kj, block, b, rep):
        rows = slice(qb * block * rep, (qb + 1) * block * rep)
        pos = slice(qb * block, (qb + 1) * block)
        qb_, do = qg[samples, :, rows], dog[samples, :, rows]  # [b', hkv, R, d]
        kb, vb = _take(kg[samples], keys), _take(vg[samples], keys)  # [b', hkv, K, d]
        p = _scores(qb_, kb, allowed).sub_(lseg[samples, :, rows]).exp_()  # [b', hkv, R, K]
        if dropout is None:
            _put(dv_g[samples], keys, _mm(p.transpose(2, 3), do))  # [b', hkv, K, d]
            dp = _mm(do, vb.transpose(2, 3))  # [b', hkv, R, K]
        else:
            dropped = _dropped(dropout, samples, b, hkv, rep, qi[pos], kj[keys])
            kept = dropout.apply_(p.clone(), dropped)  # P * D
            _put(dv_g[samples], keys, _mm(kept.transpose(2, 3), do))  # [b', hkv, K, d]
            del kept
            dp = dropout.apply_(_mm(do, vb.transpose(2, 3)), dropped)  # D * (dO V^T)
            del dropped
        ds = dp.sub_(deltag[samples, :, rows]).mul_(p)  # [b', hkv, R, K]
        del p, dp
        if kb.dtype == qb_.dtype:  # cast once for both matmuls (half: the fp32 dS goes)
            ds = ds.to(kb.dtype)
        n = ds.shape[0]
        dq_g[samples, :, pos] = _mm(ds, kb).view(n, hkv, block, rep, d)
        _put(dk_g[samples], keys, _mm(ds.transpose(2, 3), qb_))  # q already scaled
        del ds, qb_, do, kb, vb  # before the next block's scores
    dq.mul_(d ** -0.5)
    return dq, dk, dv


def merge(out: torch.Tensor, lse: torch.Tensor, out_i: torch.Tensor,
          lse_i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax merge of two partials over disjoint key sets: out `[b, sq, hq, d]`,
    lse `[b, hq, sq]`, fp32. Rows where both lse are -inf stay out 0, lse -inf.

    In place, no temporary of out's size: both outs are consumed (the caller owns them),
    each scaled by its weight, the sum left in `out`, which is returned with the new lse."""
    new = torch.logaddexp(lse, lse_i)  # [b, hq, sq]; -inf where both are
    base = new.masked_fill(new == float("-inf"), 0.0)
    w = (lse - base).exp_().transpose(1, 2).unsqueeze(-1)  # [b, sq, hq, 1]
    w_i = (lse_i - base).exp_().transpose(1, 2).unsqueeze(-1)
    return out.mul_(w).add_(out_i.mul_(w_i)), new


# ---- whole-sequence core -----------------------------------------------------------------


class _MaskedBlockAttention(torch.autograd.Function):
    """One partial over the whole sequence (qi = kj = 0..s-1): its out and lse are final.
    Saves q, k, v, out, lse; backward recomputes the scores block by block."""

    @staticmethod
    def forward(ctx, q, k, v, mask: AttentionMask, block: int,
                dropout: Optional[AttentionDropout]):
        pos = torch.arange(q.shape[1], device=q.device)
        # out in q's dtype (each block cast as it is stored), contiguous: saved here, it is
        # the very tensor the out projection reads
        out, lse = partial_forward(q, k, v, mask, pos, pos, block, out_dtype=q.dtype,
                                   dropout=dropout)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.block, ctx.dropout = mask, block, dropout  # the mask is drawn again
        return out  # [b, s, hq, d]

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        pos = torch.arange(q.shape[1], device=q.device)
        dq, dk, dv = partial_backward(q, k, v, out, lse, dout, None, ctx.mask, pos, pos,
                                      ctx.block, ctx.dropout)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


class _FusedAttention(torch.autograd.Function):
    """A plain causal or full mask on a fused kernel (fused.py): one call each way. Saves
    q, k, v, out, lse, as the block kernel does."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, kernel: FusedKernel):
        scale = q.shape[-1] ** -0.5
        out, lse = kernel.forward(q, k, v, causal, scale)  # [b, s, hq, d] contiguous
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.kernel, ctx.scale = causal, kernel, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.kernel.backward(dout.contiguous(), q, k, v, out, lse, ctx.causal,
                                         ctx.scale)
        return dq, dk, dv, None, None


def plain_fused_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       mask: AttentionMask) -> Optional[FusedKernel]:
    """The fused kernel for a plain causal or full mask (no window, layout or documents)
    and inputs of one dtype, else None."""
    if mask.window is not None or mask.layout is not None or mask.documents is not None:
        return None
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return None
    return fused_kernel(q)


def masked_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           mask: AttentionMask,
                           dropout: Optional[AttentionDropout] = None) -> torch.Tensor:
    """Attention core for any mask: q `[b, s, hq, d]`, k and v `[b, s, hkv, d]` -> `[b, s,
    hq, d]` in q's dtype. A plain causal or full mask without dropout runs on the fused
    kernel where there is one (on CPU, forward + backward at s = 1024-4096: 1.5-1.6x the
    blocks' speed in fp32, 2.5-2.8x in bf16; benchmarks/ring_step.py's causal step is this
    call), every other mask, and any with `dropout` (dropout.py's positional mask, which
    the fused kernels cannot apply), on the blocks."""
    kernel = plain_fused_kernel(q, k, v, mask) if dropout is None else None
    if kernel is not None:
        return _FusedAttention.apply(q, k, v, mask.causal, kernel)
    layout_block = mask.layout.block if mask.layout is not None else None
    block = attention_block_size(q.shape[1], layout_block=layout_block)
    return _MaskedBlockAttention.apply(q, k, v, mask, block, dropout)
