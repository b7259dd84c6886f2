"""Explicit causal attention by query blocks, for plain causal masks only:
`block_causal_attention` skips the blocks above the diagonal and keeps the softmax
probabilities for backward (no recomputation), which makes it faster than SDPA's CPU kernel
for moderate lengths: `cpu_attention` (kernels.py) picks it on CPU for fp32 without
dropout up to `CPU_BLOCK_MAX_SEQ`. Its result equals the plain PyTorch formulation up to
fp32 rounding (tests/model/test_fused_ops.py).
"""

from __future__ import annotations

import torch

BLOCK_ROWS = 64  # query rows per block (the memory plan counts its probabilities by them)


class _BlockCausalAttention(torch.autograd.Function):
    """softmax(q k^T / sqrt(d), causal) v with batched matmuls, one block of queries at a time.

    Query block [i0, i1) only needs keys [0, i1): the blocks above the diagonal are never
    computed, and each row's softmax is complete within its block (no online rescaling as
    in flash attention). The probabilities are kept for backward, so backward is plain
    matmuls too. Inputs are grouped for GQA: q `[N, s * rep, d]` with rows ordered
    (position, head in group), k and v `[N, s, d]`, N = batch * kv heads.
    """

    @staticmethod
    def forward(ctx, q, k, v, rep: int, block: int):
        n, s, d = k.shape
        q = q * d ** -0.5  # scaling q (s * rep * d) is cheaper than scaling the scores
        # Row (t, head) of a diagonal block sees keys <= t: its upper triangle is masked.
        upper = torch.ones(block, block, dtype=torch.bool, device=q.device).triu_(1)
        upper = upper.repeat_interleave(rep, dim=0)  # [block * rep, block]
        outs, probs = [], []
        for i0 in range(0, s, block):
            i1 = min(i0 + block, s)
            r0, r1 = i0 * rep, i1 * rep
            scores = torch.bmm(q[:, r0:r1], k[:, :i1].transpose(1, 2))  # [N, (i1-i0)*rep, i1]
            scores[:, :, i0:].masked_fill_(upper[:r1 - r0, :i1 - i0], float("-inf"))
            p = torch.softmax(scores, dim=-1)
            outs.append(torch.bmm(p, v[:, :i1]))  # [N, (i1-i0)*rep, d]
            probs.append(p)
        # (bmm into a slice of a preallocated output falls back to one matmul per batch.)
        out = torch.cat(outs, dim=1)  # [N, s * rep, d]
        ctx.save_for_backward(q, k, v, out, *probs)
        ctx.rep, ctx.block = rep, block
        return out

    @staticmethod
    def backward(ctx, dout):  # dout [N, s * rep, d]
        q, k, v, out, *probs = ctx.saved_tensors  # q is already scaled
        rep, block = ctx.rep, ctx.block
        n, s, d = k.shape
        dout = dout.contiguous()
        # Softmax backward needs rowsum(dP * P), which equals rowsum(dO * O).
        delta = (dout * out).sum(-1, keepdim=True)  # [N, s * rep, 1]
        dqs = []
        dk = torch.zeros_like(k)
        dv = torch.zeros_like(v)
        for n_blk, i0 in enumerate(range(0, s, block)):
            i1 = min(i0 + block, s)
            r0, r1 = i0 * rep, i1 * rep
            p, do = probs[n_blk], dout[:, r0:r1]  # [N, rows, i1], [N, rows, d]
            dv[:, :i1] += torch.bmm(p.transpose(1, 2), do)
            dp = torch.bmm(do, v[:, :i1].transpose(1, 2))  # [N, rows, i1]
            ds = dp.sub_(delta[:, r0:r1]).mul_(p)  # d scores, in place
            dqs.append(torch.bmm(ds, k[:, :i1]))
            dk[:, :i1] += torch.bmm(ds.transpose(1, 2), q[:, r0:r1])
        dq = torch.cat(dqs, dim=1).mul_(d ** -0.5)  # [N, s * rep, d]
        return dq, dk, dv, None, None


def block_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           block: int = BLOCK_ROWS) -> torch.Tensor:
    """Causal attention core on `[b, s, h, d]` (GQA: hq % hkv == 0), no dropout.

    Keeps softmax probabilities of about b * hq * s^2 / 2 elements per layer for backward,
    so it is meant for moderate s; `cpu_attention` picks it.
    """
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    rep = hq // hkv
    # q head j * rep + r belongs to kv head j (as in math_attention's repeat_interleave).
    qg = q.view(b, s, hkv, rep, d).transpose(1, 2).reshape(b * hkv, s * rep, d)
    kg = k.transpose(1, 2).reshape(b * hkv, s, d)
    vg = v.transpose(1, 2).reshape(b * hkv, s, d)
    out = _BlockCausalAttention.apply(qg, kg, vg, rep, block)  # [b * hkv, s * rep, d]
    return out.view(b, hkv, s, rep, d).transpose(1, 2).reshape(b, s, hq, d)
