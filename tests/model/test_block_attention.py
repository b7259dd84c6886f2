"""The block attention backend (model/attention/block.py) against math_attention, forward and
backward, for every kind of mask; its partials composed as the ring composes them.

Tolerance: fp32 results agree to 1e-5 relative to the largest magnitude of the reference
(the kernels reorder sums, never approximate); bf16 to 3e-2. The fused kernel with lse
(model/attention/fused.py, which plain causal and full masks take) is held to the same:
bf16 against an fp32 reference measured at most 1.5e-2 (out 3.9e-3, dq 1.1e-2, dk 1.5e-2,
dv 1.3e-2 over 20 seeds x MHA/GQA/MQA x s 64, 256 x causal/full; its ring decomposition
8.7e-3 over 5 seeds).
"""

import pytest
import torch

from helpers import host_syncs

from megaulysses.model.attention import AttentionMask, SparseLayout, math_attention
from megaulysses.model.attention import block as ba
from megaulysses.model.attention import fused as fused_attention
from megaulysses.model.attention.block import (attention_block_size, computed_pairs,
                                               masked_block_attention, merge,
                                               partial_backward, partial_forward)
from megaulysses.model.attention.fused import fused_kernel
from megaulysses.parallel.ring import fused_step

FP32_TOL = 1e-5
BF16_TOL = 3e-2

DOCS = torch.tensor([[0] * 20 + [1] * 30 + [2] * 14,  # b=2, s=64: different boundaries,
                     [0] * 5 + [1] * 58 + [2] * 1])   # a document of length 1
FIXED = SparseLayout("fixed", block=16, local=2, global_=1)
BIGBIRD = SparseLayout("bigbird", block=16, local=2, global_=1, random=1, seed=3)


MASKS = {  # name: mask for sequence length s (documents: s = 64)
    "causal": lambda s: AttentionMask(),  # these two: the fused kernel
    "full": lambda s: AttentionMask(causal=False),
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
    for g, w, what in zip(got, want, ("out", "dq", "dk", "dv"), strict=True):
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
        got = grads(lambda *t, mask=mask: masked_block_attention(*t, mask), q, k, v, dout)
        want = grads(lambda *t, mask=mask: math_attention(*t, mask=mask), q, k, v, dout)
        for g, w in zip(got, want, strict=True):
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
    for g, w in zip(got, want, strict=True):
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
    for g, w in zip(got, want, strict=True):
        assert_close(g, w)


def test_computed_pairs_per_sample_documents():
    # documents: each sample its own pass, pairs counted per sample
    pos = torch.arange(64)
    mask = AttentionMask(documents=DOCS)
    n = computed_pairs(mask, pos, pos, 16, batch=2)
    per_sample = sum(computed_pairs(mask.with_documents(DOCS[i:i + 1]), pos, pos, 16)
                     for i in range(2))
    assert n == per_sample < 2 * 10  # less than causal's 10 pairs per sample


# ---- the fused kernel with lse (model/attention/fused.py) ---------------------------------


def explicit_step(q, k, v, causal, dout):
    """Reference step in fp32: explicit scores over all of k (causal: j <= i, square);
    (out, lse, dq, dk, dv) by autograd."""
    q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(rep, dim=2))
    scores = scores / q.shape[-1] ** 0.5
    if causal:
        keep = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v.repeat_interleave(rep, dim=2))
    return (out.detach(), scores.logsumexp(-1).detach(),
            *torch.autograd.grad(out, (q, k, v), dout.float()))


STEPS = {"causal square": (slice(None), slice(None), True),  # (query rows, keys, causal)
         "full": (slice(None), slice(None), False),
         "late rows x all keys": (slice(32, None), slice(None), False),
         "all rows x early keys": (slice(None), slice(0, 32), False)}


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hq{h[0]}-hkv{h[1]}")
@pytest.mark.parametrize("step", list(STEPS))
def test_fused_step_matches_explicit_attention(step, heads):
    """Forward (out, lse) and backward of one step on slices of q and k, as the ring's
    steps take them."""
    rows, keys, causal = STEPS[step]
    q, k, v, dout = qkv(2, 64, *heads, d=16)
    q, k, v, dout = q[:, rows], k[:, keys], v[:, keys], dout[:, rows]
    kernel = fused_kernel(q)
    out, lse = kernel.forward(q, k, v, causal, 16 ** -0.5)
    got = (out, lse, *kernel.backward(dout, q, k, v, out, lse, causal, 16 ** -0.5))
    want = explicit_step(q, k, v, causal, dout)
    for g, w, what in zip(got, want, ("out", "lse", "dq", "dk", "dv"), strict=True):
        assert g.shape == w.shape and g.dtype == torch.float32, what
        assert_close(g, w)


def test_fused_step_bf16():
    q, k, v, dout = qkv(2, 64, 4, 2, d=16, dtype=torch.bfloat16)
    kernel = fused_kernel(q)
    out, lse = kernel.forward(q, k, v, True, 0.25)
    got = (out, lse, *kernel.backward(dout, q, k, v, out, lse, True, 0.25))
    want = explicit_step(q, k, v, True, dout)
    assert lse.dtype == torch.float32
    for g, w in zip(got, want, strict=True):
        assert_close(g, w, BF16_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("ranks", [2, 4])
def test_fused_ring_decomposition(ranks, causal, dtype):
    """The ring's fused steps (`fused_step`'s rectangles of the zigzag chunks) merged by
    their lse, and their backward shares given the final out and lse, sum to attention over
    the whole sequence."""
    s = 64
    mask = AttentionMask(causal=causal)
    q, k, v, dout = qkv(2, s, 4, 2, d=8, dtype=dtype)
    want = grads(lambda *t: math_attention(*t, mask=mask), *(t.float() for t in (q, k, v, dout)))
    held = zigzag(s, ranks)
    kernel = fused_kernel(q)
    dq, dk, dv = (torch.zeros(t.shape) for t in (q, k, v))
    for c, qi in enumerate(held):
        steps = [fused_step(causal, c, src, s // (2 * ranks)) for src in range(ranks)]
        out, lse = torch.zeros(q[:, qi].shape), torch.full((2, 4, len(qi)), float("-inf"))
        for (rows, keys, square), kj in zip(steps, held, strict=True):
            o, l = kernel.forward(q[:, qi][:, rows], k[:, kj][:, keys], v[:, kj][:, keys],
                                  square, 8 ** -0.5)
            lse[:, :, rows] = merge(out[:, rows], lse[:, :, rows], o.float(), l)[1]
        assert_close(out, want[0][:, qi], BF16_TOL if dtype == torch.bfloat16 else FP32_TOL)
        out = out.to(dtype)
        for (rows, keys, square), kj in zip(steps, held, strict=True):
            shares = kernel.backward(dout[:, qi][:, rows], q[:, qi][:, rows],
                                     k[:, kj][:, keys], v[:, kj][:, keys], out[:, rows],
                                     lse[:, :, rows], square, 8 ** -0.5)
            dq[:, qi[rows]] += shares[0]
            dk[:, kj[keys]] += shares[1]  # back to the rank holding these keys
            dv[:, kj[keys]] += shares[2]
    for g, w in zip((dq, dk, dv), want[1:], strict=True):
        assert_close(g, w, BF16_TOL if dtype == torch.bfloat16 else FP32_TOL)


def test_plain_masks_take_the_fused_kernel_others_the_blocks():
    """The block backend: one fused call each way for plain causal and full masks (no
    Python loop over blocks), none for a window."""
    q, k, v, dout = qkv(1, 128, 2, 1, d=8)
    for mask, fused in ((AttentionMask(), 1), (AttentionMask(causal=False), 1),
                        (AttentionMask(window=16), 0)):
        fused_attention.CALLS.clear()
        grads(lambda *t, mask=mask: masked_block_attention(*t, mask), q, k, v, dout)
        name = fused_kernel(q).name
        assert fused_attention.CALLS[(name, "forward")] == fused, mask
        assert fused_attention.CALLS[(name, "backward")] == fused, mask
    # float64: no fused kernel takes it; the blocks do
    assert fused_kernel(q.double()) is None
    got = grads(lambda *t: masked_block_attention(*t, AttentionMask()),
                *(t.double() for t in (q, k, v, dout)))
    want = grads(lambda *t: math_attention(*t), q, k, v, dout)
    for g, w in zip(got, want, strict=True):
        assert_close(g, w)


def test_the_fused_path_makes_no_host_sync():
    q, k, v, dout = qkv(1, 128, 2, 1, d=8)
    for mask, fused in ((AttentionMask(), True), (AttentionMask(window=16), False)):
        with host_syncs() as syncs:
            grads(lambda *t, mask=mask: masked_block_attention(*t, mask), q, k, v, dout)
        assert (syncs.n == 0) == fused, (mask, syncs.n)  # the blocks' plan reads the mask


# ---- the CUDA kernels' plumbing, on CPU fakes of their ops --------------------------------
# No GPU here: each fake runs torch's CPU flash op behind the CUDA op's signature and
# layout (what the module's docstring states), so the argument order, transposes, lse
# padding and GQA handling of the CUDA paths run and are checked against explicit attention.

_CPU_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _expand_heads(q, k):  # [b, h, s, d] kv to q's heads (the CPU op has GQA, checked apart)
    return k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)


def _fake_efficient(q, k, v, bias, lse_wanted, p, causal, *, scale):
    assert bias is None and lse_wanted and p == 0 and k.shape[1] == q.shape[1]  # no GQA
    out, lse = _CPU_FWD(q, k, v, 0.0, causal, scale=scale)
    return out, torch.nn.functional.pad(lse, (0, -q.shape[2] % 32)), None, None


def _fake_efficient_bwd(dout, q, k, v, bias, out, lse, seed, offset, p, want, causal, *,
                        scale):
    assert lse.shape[2] % 32 == 0 and want == [True, True, True, False]
    return (*_CPU_BWD(dout, q, k, v, out, lse[:, :, :q.shape[2]], 0.0, causal, scale=scale),
            None)


def _fake_flash(q, k, v, p, causal, debug, *, scale):
    out, lse = _CPU_FWD(q, _expand_heads(q, k), _expand_heads(q, v), p, causal, scale=scale)
    return out, lse, None, None, q.shape[2], k.shape[2], None, None, None


def _fake_flash_bwd(dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, p, causal, rng,
                    unused, *, scale):
    assert cum_q is None and (max_q, max_k) == (q.shape[2], k.shape[2]) and lse.is_contiguous()
    rep = q.shape[1] // k.shape[1]
    dq, dk, dv = _CPU_BWD(dout, q, _expand_heads(q, k), _expand_heads(q, v), out, lse, p,
                          causal, scale=scale)
    b, h, s, d = dk.shape  # the kernel sums GQA groups itself
    return dq, *(x.view(b, h // rep, rep, s, d).sum(2) for x in (dk, dv))


def _fa_forward_26(q, k, v, dropout_p, softmax_scale, causal, window_size_left,
                   window_size_right, softcap, alibi_slopes, return_softmax):
    assert (window_size_left, window_size_right, softcap) == (-1, -1, 0.0)
    out, lse = _CPU_FWD(*(x.transpose(1, 2) for x in (q, k, v)), dropout_p, causal,
                        scale=softmax_scale)
    return out.transpose(1, 2), lse, None, None


def _fa_backward_26(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
                    causal, window_size_left, window_size_right, softcap, alibi_slopes,
                    deterministic, rng_state=None):
    assert softmax_lse.is_contiguous() and window_size_left == -1
    grads = _CPU_BWD(*(x.transpose(1, 2) for x in (dout, q, k, v, out)), softmax_lse,
                     dropout_p, causal, scale=softmax_scale)
    for into, g in zip((dq, dk, dv), grads, strict=True):
        into.copy_(g.transpose(1, 2))


def _fa_forward_25(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                   return_softmax):
    assert window_size == (-1, -1)
    out, lse, *_ = _fa_forward_26(q, k, v, dropout_p, softmax_scale, causal, -1, -1, 0.0,
                                  alibi_slopes, return_softmax)
    return out, q, k, v, out, lse, None, None


def _fa_backward_25(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
                    causal, window_size, alibi_slopes, deterministic, rng_state=None):
    _fa_backward_26(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
                    causal, -1, -1, 0.0, alibi_slopes, deterministic, rng_state)


@pytest.mark.parametrize("name", ["torch-efficient", "torch-flash", "flash_attn 2.6",
                                  "flash_attn 2.5"])
def test_cuda_kernels_plumbing_on_cpu_fakes(name, monkeypatch):
    fa = fused_attention
    if name.startswith("flash_attn"):
        fakes = ((_fa_forward_26, _fa_backward_26) if name.endswith("2.6")
                 else (_fa_forward_25, _fa_backward_25))
        monkeypatch.setattr(fa, "_flash_attn_ops", lambda: fakes)
        kernel = fa.FusedKernel(name, fa._fa_forward, fa._fa_backward)
    elif name == "torch-efficient":
        monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_efficient_attention",
                            _fake_efficient)
        monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_efficient_attention_backward",
                            _fake_efficient_bwd)
        kernel = fa.FusedKernel(name, fa._efficient_forward, fa._efficient_backward)
    else:
        monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention", _fake_flash)
        monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_backward",
                            _fake_flash_bwd)
        kernel = fa.FusedKernel(name, fa._torch_flash_forward, fa._torch_flash_backward)
    q, k, v, dout = qkv(2, 40, 4, 2, d=8)  # 40 rows: the efficient kernel's lse is padded
    for rows, keys, causal in STEPS.values():
        args = (q[:, rows], k[:, keys], v[:, keys], causal)
        out, lse = kernel.forward(*args, 8 ** -0.5)
        got = (out, lse, *kernel.backward(dout[:, rows], *args[:3], out, lse, causal,
                                          8 ** -0.5))
        for g, w in zip(got, explicit_step(*args, dout[:, rows]), strict=True):
            assert g.shape == w.shape
            assert_close(g, w)
