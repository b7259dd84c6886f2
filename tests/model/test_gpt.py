"""The plain GPT against independent references: init, attention, rotary, loss, styles."""

import math

import pytest
import torch
import torch.nn.functional as F

from megaulysses.model.attention import math_attention, sdpa_attention
from megaulysses.model.gpt import GPT, build_model, count_parameters
from megaulysses.model.rope import apply_rotary, rotary_angles
from helpers import llama_config

FP32_RTOL = 1e-5  # fp32 reorderings (fused kernels vs einsum) stay well inside this


def llama(**kw):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                seq_length=32, vocab_size=300, make_vocab_size_divisible_by=128)
    base.update(kw)
    return llama_config(**base)


def gpt2(**kw):
    return llama(position_embedding_type="learned_absolute", normalization="LayerNorm",
                 swiglu=False, add_bias_linear=True, num_query_groups=None, **kw)


def close(a, b, rtol=FP32_RTOL):
    torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * b.abs().max().item())


def test_init_is_a_function_of_seed_name_and_shape_only():
    a = build_model(llama(num_layers=2), sdpa_attention, seed=7)
    b = build_model(llama(num_layers=2), sdpa_attention, seed=7)
    c = build_model(llama(num_layers=2), sdpa_attention, seed=8)
    for (name, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(p, q), name
        if p.ndim == 2:
            assert not torch.equal(p, r), name
    # Same name and shape in a deeper model: the same values (out projections are scaled
    # by 1/sqrt(2L), so compare a parameter whose std does not depend on depth).
    deep = build_model(llama(num_layers=4), sdpa_attention, seed=7)
    name = "layers.1.attn.q.weight"
    assert torch.equal(dict(a.named_parameters())[name], dict(deep.named_parameters())[name])
    # Materialized directly (no meta device) and initialized: identical too.
    direct = GPT(llama(num_layers=2))
    direct.init_weights(7)
    for p, q in zip(a.parameters(), direct.parameters(), strict=True):
        assert torch.equal(p, q)


def test_megatron_init_statistics():
    cfg = gpt2(num_layers=4, hidden_size=256, num_attention_heads=4)
    m = build_model(cfg, sdpa_attention, seed=0)
    p = dict(m.named_parameters())
    assert abs(p["layers.0.attn.q.weight"].std().item() - 0.02) < 1e-3
    out_std = 0.02 / math.sqrt(2 * 4)
    assert abs(p["layers.2.mlp.fc2.weight"].std().item() - out_std) < 1e-3 * out_std / 0.02 * 5
    assert abs(p["layers.2.attn.out.weight"].std().item() - out_std) < 5e-4
    assert torch.equal(p["layers.0.attn_norm.weight"], torch.ones(256))
    assert torch.equal(p["layers.0.attn_norm.bias"], torch.zeros(256))
    assert torch.equal(p["layers.0.mlp.fc1.bias"], torch.zeros(4 * 256))


def reference_attention(q, k, v):
    """Per-head loop with an explicit causal mask: independent of both backends."""
    b, s, hq, d = q.shape
    rep = hq // k.shape[2]
    out = torch.empty_like(q)
    mask = torch.full((s, s), float("-inf")).triu(1)
    for h in range(hq):
        kh, vh = k[:, :, h // rep], v[:, :, h // rep]  # q head h reads kv head h // rep
        scores = q[:, :, h] @ kh.transpose(1, 2) / math.sqrt(d) + mask  # [b, s, s]
        out[:, :, h] = scores.softmax(-1) @ vh
    return out


@pytest.mark.parametrize("core", [math_attention, sdpa_attention], ids=["math", "sdpa"])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (4, 1)])
def test_attention_cores_match_reference(core, hq, hkv):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 16, hq, 8, generator=g, requires_grad=True)
    k = torch.randn(2, 16, hkv, 8, generator=g, requires_grad=True)
    v = torch.randn(2, 16, hkv, 8, generator=g, requires_grad=True)
    grad = torch.randn(2, 16, hq, 8, generator=g)
    out = core(q, k, v, 0.0)
    ref = reference_attention(q, k, v)
    close(out, ref)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(got, want, strict=True):
        close(a, b)


def _angles(positions, d, base=10000.0):
    cfg = llama_config(hidden_size=d, num_attention_heads=1, rotary_base=base)
    return rotary_angles(positions, cfg)


def _rotate(x, positions, base=10000.0):
    return apply_rotary(x, *_angles(positions, x.shape[-1], base))


def test_rotary_scores_depend_on_relative_position_only():
    d = 16
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, 1, d, generator=g), torch.randn(1, 1, 1, d, generator=g)

    def score(m, n):
        qm = _rotate(q, torch.tensor([[m]]))
        kn = _rotate(k, torch.tensor([[n]]))
        return (qm * kn).sum().item()
    assert score(5, 2) == pytest.approx(score(40, 37), rel=1e-5)
    assert score(5, 2) != pytest.approx(score(5, 3), rel=1e-3)
    # Position 0 is the identity.
    assert torch.equal(_rotate(q, torch.tensor([[0]])), q)


def test_rotary_with_global_positions_equals_slicing_the_full_sequence():
    """What Ulysses relies on: rotating a sequence shard with its global positions."""
    x = torch.randn(2, 32, 3, 8)
    full = _rotate(x, torch.arange(32).expand(2, 32), 500000.0)
    pos = torch.arange(16, 32).expand(2, 16)
    assert torch.equal(_rotate(x[:, 16:], pos, 500000.0), full[:, 16:])


def test_rotary_angles_equal_a_table_of_every_position():
    """Angles computed from the positions are, bit for bit, the rows of a whole table
    (fp32 outer product, as Megatron-LM and transformers build it)."""
    d, n, base = 64, 4096, 10000.0
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    table = torch.outer(torch.arange(n, dtype=torch.float32), inv_freq)
    pos = torch.randint(0, n, (2, 300))
    cos, sin = _angles(pos, d, base)
    assert cos.shape == (2, 300, 1, d // 2) and cos.dtype == torch.float32
    assert torch.equal(cos.squeeze(2), table.cos()[pos])
    assert torch.equal(sin.squeeze(2), table.sin()[pos])


@pytest.mark.parametrize("make", [llama, gpt2], ids=["llama", "gpt2"])
def test_losses_equal_cross_entropy_of_logits(make):
    m = build_model(make(), sdpa_attention, seed=0)
    tokens = torch.randint(0, 300, (2, 32))
    labels = torch.randint(0, 300, (2, 32))
    logits = m(tokens)
    assert logits.shape == (2, 32, 384)  # 300 padded to a multiple of 128
    losses = m(tokens, labels=labels)
    ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    close(losses, ref.view(2, 32))


@pytest.mark.parametrize("make", [llama, gpt2], ids=["llama", "gpt2"])
def test_math_and_sdpa_models_agree_forward_and_backward(make):
    a = build_model(make(), math_attention, seed=3)
    b = build_model(make(), sdpa_attention, seed=3)
    tokens = torch.randint(0, 300, (2, 32))
    la, lb = a(tokens, labels=tokens).mean(), b(tokens, labels=tokens).mean()
    close(la, lb)
    la.backward()
    lb.backward()
    # Some gradients are ~0 by symmetry (e.g. a bias before a norm): compare each against
    # the scale of the largest gradient, not its own.
    scale = max(p.grad.abs().max().item() for p in b.parameters())
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5 * scale, msg=name)


def test_causality_future_tokens_do_not_change_past_logits():
    m = build_model(llama(), sdpa_attention, seed=0)
    t1 = torch.randint(0, 300, (1, 32))
    t2 = t1.clone()
    t2[0, 20:] = (t2[0, 20:] + 1) % 300
    close(m(t1)[0, :20], m(t2)[0, :20])


def test_parameter_count_and_styles():
    cfg = llama()
    m = build_model(cfg, sdpa_attention, seed=0)
    h, f, V = 64, cfg.ffn_size, cfg.padded_vocab_size
    kv = 2 * (64 // 4)
    per_layer = h * h * 2 + 2 * h * kv + 3 * h * f + 2 * h
    assert count_parameters(m) == V * h + 2 * per_layer + h  # tied: no output weight
    assert f == 128  # 8h/3 = 170.7 -> rounded down to a multiple of 64 (Megatron-LM)
    untied = build_model(llama(untie_embeddings_and_output_weights=True), sdpa_attention, 0)
    assert count_parameters(untied) == count_parameters(m) + V * h
    g = build_model(gpt2(), sdpa_attention, seed=0)
    names = dict(g.named_parameters())
    assert "embed.position.weight" in names and "layers.0.mlp.fc1.bias" in names
    assert "layers.0.mlp.gate.weight" not in names
    assert isinstance(g.layers["0"].attn_norm, torch.nn.LayerNorm)


def test_tied_output_layer_gets_gradient_from_both_uses():
    m = build_model(llama(), sdpa_attention, seed=0)
    tokens = torch.randint(0, 300, (2, 32))
    m(tokens, labels=tokens).mean().backward()
    grad = m.embed.word.weight.grad
    # Rows of tokens never seen as input still get gradient through the output layer.
    unseen = sorted(set(range(300)) - set(tokens.flatten().tolist()))[0]
    assert grad[unseen].abs().sum() > 0
