"""The block attention backend (model/block_attention.py) against math_attention, forward and
backward, for every kind of mask; its partials composed as the ring composes them.

Tolerance: fp32 results agree to 1e-5 relative to the largest magnitude of the reference
(the kernels reorder sums, never approximate); bf16 to 3e-2.
"""

import pytest
import torch

import megaulysses.model.block_attention as ba
from megaulysses.model.attention import AttentionMask, SparseLayout, math_attention
from megaulysses.model.block_attention import (attention_block_size, computed_pairs,
                                               masked_block_attention, merge,
                                               partial_backward, partial_forward)

FP32_TOL = 1e-5
BF16_TOL = 3e-2

DOCS = torch.tensor([[0] * 20 + [1] * 30 + [2] * 14,  # b=2, s=64: different boundaries,
                     [0] * 5 + [1] * 58 + [2] * 1])   # a document of length 1
FIXED = SparseLayout("fixed", block=16, local=2, global_=1)
BIGBIRD = SparseLayout("bigbird", block=16, local=2, global_=1, random=1, seed=3)


MASKS = {  # name: mask for sequence length s (documents: s = 64)
    "causal": lambda s: AttentionMask(),
    "window24": lambda s: AttentionMask(window=24),
    "window1": lambda s: AttentionMask(window=1),
    "documents": lambda s: AttentionMask(documents=DOCS),
    "fixed": lambda s: AttentionMask(layout=FIXED),
    "bigbird": lambda s: AttentionMask(layout=BIGBIRD),
    "window+documents": lambda s: AttentionMask(window=24, documents=DOCS),
    "bigbird+documents": lambda s: AttentionMask(layout=BIGBIRD, documents=DOCS),
}
HEADS = [(4, 4), (4, 2), (4, 1)]  # (hq, hkv): MHA, GQA, MQA


def assert_close(actual, expected, tol=FP32_TOL):
    scale = expected.detach().abs().max().item() or 1.0
    torch.testing.assert_close(actual.float(), expected.float(), rtol=0, atol=tol * scale)


def qkv(b, s, hq, hkv, d, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, hq, d, generator=gen)
    k = torch.randn(b, s, hkv, d, generator=gen)
    v = torch.randn(b, s, hkv, d, generator=gen)
    dout = torch.randn(b, s, hq, d, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype), dout.to(dtype)


def grads(fn, q, k, v, dout):
    inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*inputs)
    return (out, *torch.autograd.grad(out, inputs, dout))


# ---- whole sequence ----------------------------------------------------------------------


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hq{h[0]}-hkv{h[1]}")
@pytest.mark.parametrize("name", list(MASKS))
def test_matches_math_attention(name, heads):
    s = 64 if "documents" in name else 128
    mask = MASKS[name](s)
    q, k, v, dout = qkv(2, s, *heads, d=16)
    got = grads(lambda *t: masked_block_attention(*t, mask), q, k, v, dout)
    want = grads(lambda *t: math_attention(*t, mask=mask), q, k, v, dout)
    for g, w, what in zip(got, want, ("out", "dq", "dk", "dv")):
        assert g.dtype == w.dtype, what
        assert torch.isfinite(g).all(), what
        assert_close(g, w)


def test_block_sizes_smaller_than_default():
    # s = 96: block 32; layout block 8 forces 8; s = 40: block 8 (three key blocks each)
    for s, layout, block in ((96, None, 32), (64, SparseLayout("fixed", 8, 2, 1), 8),
                             (40, None, 8)):
        assert attention_block_size(s, layout_block=layout and layout.block) == block
        mask = AttentionMask(window=10, layout=layout)
        q, k, v, dout = qkv(1, s, 2, 1, d=8)
        got = grads(lambda *t: masked_block_attention(*t, mask), q, k, v, dout)
        want = grads(lambda *t: math_attention(*t, mask=mask), q, k, v, dout)
        for g, w in zip(got, want):
            assert_close(g, w)


def test_attention_block_size():
    assert attention_block_size(1024) == 64
    assert attention_block_size(1024, 96) == 32
    assert attention_block_size(100, default=64) == 4
    assert attention_block_size(7) == 1
    assert attention_block_size(128, layout_block=16) == 16
    assert attention_block_size(512, default=100) == 64


def test_bf16():
    mask = AttentionMask(window=24, documents=DOCS)
    q, k, v, dout = qkv(2, 64, 4, 2, d=16, dtype=torch.bfloat16)
    got = grads(lambda *t: masked_block_attention(*t, mask), q, k, v, dout)
    want = grads(lambda *t: math_attention(*t, mask=mask), q.float(), k.float(), v.float(),
                 dout.float())
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16
        assert_close(g, w, BF16_TOL)


# ---- partials, composed as the ring composes them ----------------------------------------


def zigzag(s, ranks):
    """Positions held by each rank: chunks c and 2C-1-c of the 2C chunks."""
    chunks = torch.arange(s).view(2 * ranks, -1)
    return [torch.cat([chunks[c], chunks[2 * ranks - 1 - c]]) for c in range(ranks)]


RING_MASKS = {
    "causal": AttentionMask(),
    "window": AttentionMask(window=24),
    "documents": AttentionMask(documents=DOCS),
    "bigbird+documents": AttentionMask(layout=BIGBIRD, documents=DOCS),
}


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("name", list(RING_MASKS))
def test_ring_decomposition(name, ranks):
    mask = RING_MASKS[name]
    s = 64
    q, k, v, dout = qkv(2, s, 4, 2, d=8)
    ref_out, ref_dq, ref_dk, ref_dv = grads(lambda *t: math_attention(*t, mask=mask),
                                            q, k, v, dout)
    held = zigzag(s, ranks)
    block = attention_block_size(s // (2 * ranks), layout_block=16)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for qi in held:  # one rank's queries against every rank's keys
        out = lse = None
        for kj in held:
            part = partial_forward(q[:, qi], k[:, kj], v[:, kj], mask, qi, kj, block)
            out, lse = part if out is None else merge(out, lse, *part)
        assert_close(out, ref_out[:, qi])
        delta = (dout[:, qi] * out).sum(-1).transpose(1, 2)  # [b, hq, sq]
        for kj in held:
            dq_i, dk_i, dv_i = partial_backward(q[:, qi], k[:, kj], v[:, kj], out, lse,
                                                dout[:, qi], delta, mask, qi, kj, block)
            dq[:, qi] += dq_i
            dk[:, kj] += dk_i  # back to the rank holding these keys
            dv[:, kj] += dv_i
    assert_close(dq, ref_dq)
    assert_close(dk, ref_dk)
    assert_close(dv, ref_dv)


def dense_partial(q, k, v, mask, qi, kj):
    """Reference partial: explicit scores over the allowed keys of kj; out 0 and lse -inf
    for rows with none."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~mask.allows(qi, kj).unsqueeze(1), float("-inf"))
    lse = scores.logsumexp(-1)  # [b, h, sq]
    probs = (scores - lse.unsqueeze(-1)).exp().nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v), lse


def test_rows_without_keys():
    q, k, v, _ = qkv(2, 16, 4, 2, d=8)
    qi, kj = torch.arange(16), torch.arange(16)
    # every key later than every query: all blocks skipped
    out, lse = partial_forward(q, k, v, AttentionMask(), qi, kj + 16, 8)
    assert (out == 0).all() and (lse == float("-inf")).all()
    # a computed (PARTIAL) block where some rows have no key: queries 8..15, keys 4..11,
    # window 2: rows 13..15 see none of these keys
    mask = AttentionMask(window=2)
    qi, kj = torch.arange(8, 16), torch.arange(4, 12)
    q, k, v = q[:, :8], k[:, :8], v[:, :8]
    out, lse = partial_forward(q, k, v, mask, qi, kj, 4)
    want_out, want_lse = dense_partial(q, k, v, mask, qi, kj)
    assert torch.isfinite(out).all() and not lse.isnan().any()
    assert (lse[:, :, 5:] == float("-inf")).all() and (out[:, 5:] == 0).all()
    assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    # merging two empty partials: still 0 and -inf, no NaN
    empty = (torch.zeros_like(out), torch.full_like(lse, float("-inf")))
    m_out, m_lse = merge(*empty, *empty)
    assert (m_out == 0).all() and (m_lse == float("-inf")).all()
    m_out, m_lse = merge(*empty, out, lse)
    assert torch.equal(m_out, out) and torch.equal(m_lse, lse)
    # backward of a partial whose rows have no key anywhere: zero gradients, no NaN
    dout = torch.randn_like(out)
    grads_ = partial_backward(q, k, v, out, lse, dout, None, mask, qi, kj, 4)
    assert all(torch.isfinite(g).all() for g in grads_)
    assert (grads_[0][:, 5:] == 0).all()


def test_gathered_key_blocks():
    # fixed layout, kernel block 8 < layout block 16: the summary blocks are not one range
    mask = AttentionMask(layout=SparseLayout("fixed", 16, 2, 1))
    pos = torch.arange(128)
    q, k, v, dout = qkv(2, 128, 2, 2, d=8)
    out, lse = partial_forward(q, k, v, mask, pos, pos, 8)
    want_out, want_lse = dense_partial(q, k, v, mask, pos, pos)
    assert_close(out, want_out)
    assert_close(lse, want_lse)


# ---- skipped blocks cost nothing ---------------------------------------------------------


def test_skipped_blocks_are_not_computed(monkeypatch):
    s, block = 1024, 64
    mask = AttentionMask(window=16)
    pos = torch.arange(s)
    pairs = computed_pairs(mask, pos, pos, block)
    assert pairs == 2 * (s // block) - 1  # the diagonal and the one before it
    assert pairs < 3 * (s // block)
    # and the kernels compute exactly those: count the key columns scored
    scored = []
    real = ba._scores

    def counting(q, k, allowed):
        scored.append(k.shape[2])
        return real(q, k, allowed)

    monkeypatch.setattr(ba, "_scores", counting)
    q, k, v, dout = qkv(1, s, 1, 1, d=8)
    got = grads(lambda *t: masked_block_attention(*t, mask), q, k, v, dout)
    assert sum(scored) == 2 * pairs * block  # forward and backward
    assert max(scored) == 2 * block
    want = grads(lambda *t: math_attention(*t, mask=mask), q, k, v, dout)
    for g, w in zip(got, want):
        assert_close(g, w)


def test_computed_pairs_per_sample_documents():
    # documents: each sample its own pass, pairs counted per sample
    pos = torch.arange(64)
    mask = AttentionMask(documents=DOCS)
    n = computed_pairs(mask, pos, pos, 16, batch=2)
    per_sample = sum(computed_pairs(mask.with_documents(DOCS[i:i + 1]), pos, pos, 16)
                     for i in range(2))
    assert n == per_sample < 2 * 10  # less than causal's 10 pairs per sample
