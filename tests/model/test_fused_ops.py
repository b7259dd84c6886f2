"""Each fused op against the plain PyTorch formulation it replaces, forward and backward.

Tolerances: fp32 results must agree to 1e-5 relative to the largest magnitude of the
reference (a few ulps of accumulated rounding; the ops reorder sums, never approximate);
bf16 (and fp16) results to 3e-2, a few bf16 ulps.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megaulysses.model.attention import (CPU_BLOCK_MAX_SEQ, cpu_attention, math_attention,
                                         sdpa_attention, select_backend)
from megaulysses.model.attention.block_causal import block_causal_attention
from megaulysses.model.gpt import build_model
from megaulysses.model.layers import build_norm
from megaulysses.model.ops import cross_entropy, norms, onednn
from helpers import llama_config

FP32_TOL = 1e-5
BF16_TOL = 3e-2


def assert_close(actual, expected, tol=FP32_TOL):
    scale = expected.detach().abs().max().item() or 1.0
    torch.testing.assert_close(actual.float(), expected.float(), rtol=0, atol=tol * scale)


def grads(fn, inputs, grad_out):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    return (out, *torch.autograd.grad(out, inputs, grad_out))


# ---- linear layers -------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(bias):
    torch.manual_seed(0)
    x, w = torch.randn(3, 10, 48), torch.randn(80, 48)
    b = torch.randn(80) if bias else None
    g = torch.randn(3, 10, 80)
    ins = (x, w) + ((b,) if bias else ())
    got = grads(lambda *t: onednn.linear(*t), ins, g)
    ref = grads(lambda *t: F.linear(*t), ins, g)
    assert got[0].shape == (3, 10, 80)
    for a, r in zip(got, ref, strict=True):
        assert_close(a, r)


def test_linear_onednn_is_used_on_cpu_fp32():
    if not onednn.ONEDNN_LINEAR:
        pytest.skip("this torch build has no oneDNN linear")
    x = torch.randn(4, 8, requires_grad=True)
    y = onednn.linear(x, torch.randn(3, 8))
    assert type(y.grad_fn).__name__ == "ViewBackward0"
    assert type(y.grad_fn.next_functions[0][0]).__name__ == "_OneDNNLinearBackward"


def test_linear_bf16_autocast_is_f_linear():
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, ref = onednn.linear(x, w), F.linear(x, w)
    assert got.dtype == torch.bfloat16 and torch.equal(got, ref)


def test_linear_does_not_cache_weights():
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    onednn.linear(x, w)
    w.add_(1.0)  # as an optimizer step does
    assert_close(onednn.linear(x, w), F.linear(x, w))


# ---- output layer + cross entropy -------------------------------------------------------


def plain_linear_ce(x, w, labels):
    logits = F.linear(x, w).float()
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten(),
                           reduction="none").view(labels.shape)


@pytest.mark.parametrize("rows", [7, 16, 1000])  # ragged chunks, even chunks, one chunk
def test_linear_cross_entropy_matches_plain(monkeypatch, rows):
    monkeypatch.setattr(cross_entropy, "_rows_per_chunk", lambda *_: rows)
    torch.manual_seed(0)
    x = torch.randn(3, 20, 32)
    w = torch.randn(300, 32) * 0.5
    labels = torch.randint(0, 300, (3, 20))
    labels[0, 0] = labels[1, 4] = labels[2, 19] = -100  # ignored: loss 0, no gradient
    g = torch.rand(3, 20)
    got = grads(lambda a, b: cross_entropy.linear_cross_entropy(a, b, labels), (x, w), g)
    ref = grads(lambda a, b: plain_linear_ce(a, b, labels), (x, w), g)
    assert got[0].dtype == torch.float32 and got[0].shape == (3, 20)
    assert got[0][1, 4] == 0 and got[1][1, 4].abs().max() == 0
    for a, b in zip(got, ref, strict=True):
        assert_close(a, b)


def test_linear_cross_entropy_frozen_weight():
    torch.manual_seed(0)
    x, w, labels = torch.randn(6, 8), torch.randn(20, 8), torch.randint(0, 20, (6,))
    xg = x.clone().requires_grad_()
    cross_entropy.linear_cross_entropy(xg, w, labels).sum().backward()  # w needs no gradient
    xr = x.clone().requires_grad_()
    plain_linear_ce(xr, w, labels).sum().backward()
    assert_close(xg.grad, xr.grad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("rows", [16, 1000])  # chunks recomputed, one chunk kept
def test_linear_cross_entropy_autocast(monkeypatch, dtype, rows):
    """Under autocast the matmuls run in 16 bits (as F.linear's), the softmax in fp32:
    losses and both gradients against the plain op under the same autocast, to BF16_TOL."""
    monkeypatch.setattr(cross_entropy, "_rows_per_chunk", lambda *_: rows)
    torch.manual_seed(0)
    x, w = torch.randn(64, 32), torch.randn(256, 32) * 0.3
    labels = torch.randint(0, 256, (64,))
    labels[5] = -100
    g = torch.rand(64)
    with torch.autocast("cpu", dtype=dtype):
        got = grads(lambda a, b: cross_entropy.linear_cross_entropy(a, b, labels), (x, w), g)
        ref = grads(lambda a, b: plain_linear_ce(a, b, labels), (x, w), g)
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.float32
    for a, b in zip(got, ref, strict=True):
        assert_close(a, b, BF16_TOL)


@pytest.mark.parametrize("rows", [4, 2])  # one chunk (its exps kept), two (recomputed)
def test_linear_cross_entropy_second_backward(monkeypatch, rows):
    """Zero-bubble pipelines run backward twice (inputs, then weights) with the same
    gradient: the second gives bitwise the same gradients. Nothing is consumed, so a
    different gradient works too."""
    monkeypatch.setattr(cross_entropy, "_rows_per_chunk", lambda *_: rows)
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(16, 8, requires_grad=True)
    loss = cross_entropy.linear_cross_entropy(x, w, torch.tensor([0, 3, 15, 7])).sum()
    dx1, dw1 = torch.autograd.grad(loss, (x, w), retain_graph=True)
    dx2, dw2 = torch.autograd.grad(loss, (x, w), retain_graph=True)
    assert torch.equal(dx1, dx2) and torch.equal(dw1, dw2)
    xr = x.detach().clone().requires_grad_()
    wr = w.detach().clone().requires_grad_()
    plain_linear_ce(xr, wr, torch.tensor([0, 3, 15, 7])).sum().backward()
    assert_close(dx2, xr.grad)
    assert_close(dw2, wr.grad)
    dx3, dw3 = torch.autograd.grad(loss * 3, (x, w))
    assert_close(dx3, 3 * xr.grad)
    assert_close(dw3, 3 * wr.grad)


class LargestOutput(TorchDispatchMode):
    """The largest number of elements any op returns while active."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def largest_tensors(fn, x, w, labels):
    """(largest op output, largest tensor saved for backward), in elements, over forward
    and backward of fn(x, w, labels).sum()."""
    saved = []
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    with LargestOutput() as mode:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t,
                                                      lambda t: t):
            loss = fn(x, w, labels).sum()
        loss.backward()
    return mode.numel, max(saved)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_linear_cross_entropy_holds_one_chunk(monkeypatch, autocast):
    """T = 256 tokens, V = 512, chunks of 32 rows: no op in forward or backward returns
    more than one chunk of logits (32 x 512), nothing that size is saved for backward.
    (The plain op, measured the same way, makes and saves all T x V.)"""
    rows, t, v, h = 32, 256, 512, 16
    monkeypatch.setattr(cross_entropy, "_rows_per_chunk", lambda *_: rows)
    torch.manual_seed(0)
    x, w, labels = torch.randn(t, h), torch.randn(v, h), torch.randint(0, v, (t,))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        biggest, saved = largest_tensors(cross_entropy.linear_cross_entropy, x, w, labels)
        plain_biggest, plain_saved = largest_tensors(plain_linear_ce, x, w, labels)
    assert plain_biggest == plain_saved == t * v  # the probe sees what it should
    assert biggest == rows * v
    assert saved == max(v * h, t * h) < rows * v  # W (and x); no logits


# ---- attention by query blocks ----------------------------------------------------------


@pytest.mark.parametrize("hq,hkv,s,block", [
    (4, 4, 64, 16),  # MHA, even blocks
    (4, 4, 50, 16),  # ragged last block
    (8, 2, 40, 16),  # GQA
    (4, 1, 33, 8),   # MQA
    (2, 2, 10, 64),  # one block larger than the sequence
])
def test_block_causal_attention_matches_math(hq, hkv, s, block):
    torch.manual_seed(0)
    b, d = 2, 16
    q, k, v = torch.randn(b, s, hq, d), torch.randn(b, s, hkv, d), torch.randn(b, s, hkv, d)
    g = torch.randn(b, s, hq, d)
    got = grads(lambda *t: block_causal_attention(*t, block=block), (q, k, v), g)
    ref = grads(math_attention, (q, k, v), g)
    for a, r in zip(got, ref, strict=True):
        assert_close(a, r)


def test_block_causal_attention_bf16_forward():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 48, 4, 16, dtype=torch.bfloat16) for _ in range(3))
    assert_close(block_causal_attention(q, k, v, block=16), math_attention(q, k, v),
                 BF16_TOL)


def test_cpu_attention_dispatch():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 24, 4, 8), torch.randn(1, 24, 2, 8), torch.randn(1, 24, 2, 8)
    assert_close(cpu_attention(q, k, v), math_attention(q, k, v))
    # dropout (random, so only shapes) and 16-bit inputs go to SDPA
    assert cpu_attention(q, k, v, 0.5).shape == q.shape
    h = [t.bfloat16() for t in (q, k, v)]
    assert torch.equal(cpu_attention(*h), sdpa_attention(*h))
    assert CPU_BLOCK_MAX_SEQ >= 512


def test_select_backend_on_cpu():
    cpu = torch.device("cpu")
    assert select_backend("auto", cpu) == ("sdpa", cpu_attention)
    assert select_backend("sdpa", cpu) == ("sdpa", sdpa_attention)
    assert select_backend("math", cpu) == ("math", math_attention)


# ---- the whole model ---------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_gpt_fused_loss_matches_plain_model(monkeypatch, tied):
    """The model as trained on CPU (fused ops, `auto` attention) vs every op plain: F.linear,
    math attention, logits + F.cross_entropy."""
    cfg = llama_config(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                      seq_length=32, vocab_size=200, make_vocab_size_divisible_by=8,
                      untie_embeddings_and_output_weights=not tied)
    tokens = torch.randint(0, 200, (2, 32), generator=torch.Generator().manual_seed(0))
    labels = tokens.roll(-1, dims=1)
    fast = build_model(cfg, select_backend("auto", torch.device("cpu"))[1], seed=3)
    got = fast(tokens, labels=labels)
    got.mean().backward()

    monkeypatch.setattr(onednn, "ONEDNN_LINEAR", False)
    plain = build_model(cfg, math_attention, seed=3)
    logits = plain(tokens)
    ref = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                          reduction="none").view(2, 32)
    ref.mean().backward()
    assert_close(got, ref)
    for (name, p), q in zip(fast.named_parameters(), plain.parameters(), strict=True):
        assert p.grad is not None, name
        assert_close(p.grad, q.grad)


# ---- RMSNorm -----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(2, 7, 64), (5, 48)])
def test_rms_norm_matches_plain(shape):
    torch.manual_seed(0)
    x, g = torch.randn(*shape) * 3, torch.randn(*shape)
    w = torch.rand(shape[-1]) + 0.5
    got = grads(lambda a, b: norms.rms_norm(a, b, 1e-5), (x, w), g)
    ref = grads(lambda a, b: a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-5) * b,
                (x, w), g)
    for a, r in zip(got, ref, strict=True):
        assert_close(a, r)
    norm = build_norm("RMSNorm", shape[-1], 1e-5)  # the model's module: same parameter
    assert [n for n, _ in norm.named_parameters()] == ["weight"]
    assert_close(norm(x), torch.nn.functional.rms_norm(x, (shape[-1],), None, 1e-5))


def test_rms_norm_bf16_forward():
    x, w = torch.randn(4, 32), torch.rand(32) + 0.5
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    assert_close(norms.rms_norm(x.bfloat16(), w.bfloat16(), 1e-5), ref, BF16_TOL)
