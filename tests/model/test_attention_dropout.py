"""Attention dropout by a positional hash (model/attention/dropout.py; issue 39, part 5):
the keep probability and its scale exact in expectation, masks independent of one another
across heads, positions and keys, reproducible from the seed, the block kernel equal to
the math reference with dropout for every mask (forward and backward), a slice of the
heads (a tensor-parallel rank, a group) drawing the whole layer's masks for its heads, and
recomputation giving the gradients of no recomputation. (Grids: tests/parallel/
test_attention_dropout_grid.py.)"""

import math

import pytest
import torch

from helpers import llama_config

B, S, D = 2, 64, 8
# block kernel vs math reference with the same masks, fp32, relative to the largest entry:
# rounding only, measured 1.9e-6 (dv, GQA)
FP32_TOL = 1e-5


def _masks():
    from megaulysses.model.attention import AttentionMask, SparseLayout
    docs = torch.tensor([[0] * 9 + [1] * 30 + [2] * 25, [0] * 40 + [1] + [2] * 23])
    return {"causal": AttentionMask(), "full": AttentionMask(causal=False),
            "window": AttentionMask(window=12), "documents": AttentionMask(documents=docs),
            "bigbird": AttentionMask(layout=SparseLayout("bigbird", 8, 2, 1, 1, seed=3))}


def _inputs(hq, hkv, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, S, h, D, generator=g) for h in (hq, hkv, hkv, hq)]  # q k v dy


def _run(core, q, k, v, dy, dropout, mask=None):
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    y = core(*ins, dropout, mask)
    return [y.detach()] + list(torch.autograd.grad(y, ins, dy))


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_probability_and_scale_are_exact_in_expectation(p):
    """Over n = 2 x 8 x 512 x 512 = 4.2M (sample, head, query, key) coordinates of one key:
    the dropped fraction is p within 6 standard deviations, sqrt(p (1-p) / n) (4.1e-4 at
    p = 0.5); the mean of the scaled keep mask (what multiplies each probability) is 1
    within 6 of its standard deviations, sqrt(p / (1-p) / n). Dropping is uncorrelated
    between neighbouring heads, queries and keys (|correlation| < 6 / sqrt(n'))."""
    from megaulysses.model.attention import AttentionDropout
    drop = AttentionDropout(p, key=987654321)
    pos = torch.arange(512)
    rows = drop.rows(torch.arange(2), torch.arange(8), pos)
    dropped = drop.dropped(rows, pos)  # [2, 8, 512, 512]
    n = dropped.numel()
    frac = dropped.double().mean().item()
    assert abs(frac - p) < 6 * math.sqrt(p * (1 - p) / n), frac
    scaled = (~dropped).double().mul(drop.scale).mean().item()
    assert abs(scaled - 1) < 6 * math.sqrt(p / (1 - p) / n), scaled
    x = dropped.double() - frac
    for a, b in ((x[:, 1:], x[:, :-1]), (x[:, :, 1:], x[:, :, :-1]),
                 (x[..., 1:], x[..., :-1]), (x[1:], x[:-1])):
        corr = (a * b).mean().item() / x.var().item()
        assert abs(corr) < 6 / math.sqrt(a.numel()), corr


def test_output_is_unbiased():
    """The mean over 400 draws of the dropped math attention tends to the undropped output:
    the largest deviation is within 6 standard errors of the mean (the per-element spread
    measured over the same draws). The draws: one sample repeated 400 times in a batch
    (each sample index hashes masks of its own)."""
    from megaulysses.model.attention import AttentionDropout, math_attention
    q, k, v, _ = _inputs(2, 2)
    q, k, v = (t[:1, :16].expand(400, -1, -1, -1) for t in (q, k, v))
    outs = math_attention(q, k, v, AttentionDropout(0.3, 99))  # [400, 16, 2, d]
    plain = math_attention(q[:1], k[:1], v[:1], 0.0)[0]
    err = (outs.mean(0) - plain).abs()
    stderr = outs.std(0) / math.sqrt(len(outs))
    assert bool((err <= 6 * stderr + 1e-6).all()), (err / (stderr + 1e-12)).max()


def test_the_seed_decides_the_masks():
    """A float dropout draws its key from torch's generator: the same seed gives the same
    output bit for bit, another seed another one; p = 0 is no dropout at all."""
    from megaulysses.model.attention import block_attention
    q, k, v, _ = _inputs(4, 2)
    outs = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        outs.append(block_attention(q, k, v, 0.1))
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])
    assert torch.equal(block_attention(q, k, v, 0.0), block_attention(q, k, v))


@pytest.mark.parametrize("mask", list(_masks()))
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (4, 1)])
def test_block_kernel_equals_math_with_dropout(mask, hq, hkv):
    """The block kernel (blocks of queries, dropped after their row sums, the mask drawn
    again in backward) == the math reference's dense dropout, out and gradients."""
    from megaulysses.model.attention import AttentionDropout, block_attention, math_attention
    q, k, v, dy = _inputs(hq, hkv)
    drop = AttentionDropout(0.2, key=2024)
    want = _run(math_attention, q, k, v, dy, drop, _masks()[mask])
    got = _run(block_attention, q, k, v, dy, drop, _masks()[mask])
    assert max(_rel(a, b) for a, b in zip(got, want, strict=True)) < FP32_TOL
    assert _rel(want[0], math_attention(q, k, v, 0.0, _masks()[mask])) > 0.05  # it dropped


def test_a_slice_of_the_heads_draws_the_layers_masks():
    """Heads 2..3 alone with the dropout shifted by 2 (a tensor-parallel rank's or a group's
    share) == those heads of the whole layer; unshifted, they would draw heads 0..1's."""
    from megaulysses.model.attention import AttentionDropout, math_attention
    q, k, v, _ = _inputs(4, 4)
    drop = AttentionDropout(0.3, key=77)
    whole = math_attention(q, k, v, drop)
    part = [t[:, :, 2:] for t in (q, k, v)]
    assert torch.equal(math_attention(*part, drop.shifted(2)), whole[:, :, 2:])
    assert not torch.equal(math_attention(*part, drop), whole[:, :, 2:])


def test_head_groups_equal_the_ungrouped_layer():
    """Head groups (one process, checkpointed groups) with dropout == the block kernel over
    all heads, forward and gradients: the groups' shifted keys draw the layer's masks."""
    from megaulysses.model.attention import block_attention
    from megaulysses.parallel.head_groups import HeadGroups
    q, k, v, dy = _inputs(4, 2)
    results = []
    for core in (block_attention, HeadGroups(block_attention, 2)):
        torch.manual_seed(9)
        results.append(_run(core, q, k, v, dy, 0.2))
    assert max(_rel(a, b) for a, b in zip(*results, strict=True)) < FP32_TOL


def _grads(recompute, seed=5, hidden_dropout=0.1):
    from megaulysses.model.attention import block_attention
    from megaulysses.model.gpt import build_model
    from megaulysses.parallel.recompute import apply_recompute
    cfg = llama_config(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=64,
                       vocab_size=64, attention_dropout=0.2, hidden_dropout=hidden_dropout)
    model = apply_recompute(build_model(cfg, block_attention, 0), recompute)
    model.train()
    tokens = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(seed)
    loss = model(tokens, labels=tokens).mean()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputation_draws_the_same_masks(recompute):
    """A 2-layer GPT with attention dropout 0.2 (and hidden dropout 0.1) on the block
    kernel: selective and full recomputation give the loss and every gradient of no
    recomputation, bit for bit (the recomputed forward draws the same masks); without
    hidden dropout, another seed gives other gradients (the attention dropout is on)."""
    loss, grads = _grads(None)
    loss_r, grads_r = _grads(recompute)
    assert loss == loss_r
    for name, g in grads.items():
        assert torch.equal(g, grads_r[name]), name
    attention_only = _grads(None, hidden_dropout=0.0)[1]
    other = _grads(None, seed=6, hidden_dropout=0.0)[1]
    assert any(not torch.equal(g, other[n]) for n, g in attention_only.items())


def test_sdpa_dropout_is_seeded_per_call_and_head():
    """SDPA's own dropout (its RNG, not the positional mask): with a call's AttentionDropout
    the generator is seeded from (key, first head) and restored, so the same key gives the
    same output, another first head (another tensor-parallel or Ulysses rank's heads) other
    masks, and the global generator's stream (hidden dropout's) does not move."""
    from megaulysses.model.attention import AttentionDropout, sdpa_attention
    q, k, v, _ = _inputs(4, 4)
    drop = AttentionDropout(0.3, key=4321)
    state = torch.get_rng_state()
    first = sdpa_attention(q, k, v, drop)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(sdpa_attention(q, k, v, drop), first)
    assert not torch.equal(sdpa_attention(q, k, v, drop.shifted(4)), first)
    assert _rel(first, sdpa_attention(q, k, v, 0.0)) > 0.05  # it dropped


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_draws_the_cpu_masks():
    """On CUDA the positional hash gives the CPU's masks (int64 arithmetic, no overflow):
    the block kernel there == the CPU's math reference, out and gradients (fp32, TF32 off:
    FP32_TOL); SDPA's own dropout there is reproducible per key and leaves the CUDA
    generator where it was."""
    from megaulysses.model.attention import (AttentionDropout, block_attention,
                                             math_attention, sdpa_attention)
    q, k, v, dy = _inputs(4, 2)
    drop = AttentionDropout(0.2, key=2024)
    want = _run(math_attention, q, k, v, dy, drop, _masks()["window"])
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        got = _run(block_attention, *(t.cuda() for t in (q, k, v, dy)), drop,
                   _masks()["window"])
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    assert max(_rel(a.cpu(), b) for a, b in zip(got, want, strict=True)) < FP32_TOL
    qc, kc, vc = (t.cuda() for t in _inputs(4, 4)[:3])
    state = torch.cuda.get_rng_state()
    first = sdpa_attention(qc, kc, vc, drop)
    assert torch.equal(torch.cuda.get_rng_state(), state)
    assert torch.equal(sdpa_attention(qc, kc, vc, drop), first)
