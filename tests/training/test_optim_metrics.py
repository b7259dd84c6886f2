"""Optimizer pieces and the FLOPs formula against independent computations."""

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megaulysses.config import ModelConfig, TrainConfig
from megaulysses.model.attention import math_attention
from megaulysses.model.gpt import build_model
from megaulysses.training.metrics import flops_per_iteration
from megaulysses.parallel.grad_norm import GradPart, unscale_and_clip
from megaulysses.training.optim import LossScaler, LRSchedule, param_groups


def grad_parts(params) -> list:
    return [GradPart(p.grad) for p in params if p.grad is not None]


def schedule(**kw):
    base = dict(lr=1.0, min_lr=0.1, train_iters=100, lr_warmup_iters=10)
    base.update(kw)
    return LRSchedule(TrainConfig(**base))


def test_warmup_then_cosine():
    s = schedule()
    assert s(0) == pytest.approx(0.1) and s(9) == pytest.approx(1.0)
    assert s(10) == pytest.approx(1.0)
    assert s(55) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the decay
    assert s(100) == pytest.approx(0.1) and s(500) == pytest.approx(0.1)


def test_linear_and_constant_and_decay_iters():
    lin = schedule(lr_decay_style="linear", lr_decay_iters=50)
    assert lin(30) == pytest.approx(0.1 + 0.9 * (1 - 20 / 40))
    assert lin(60) == pytest.approx(0.1)
    const = schedule(lr_decay_style="constant")
    assert const(5) == pytest.approx(0.6) and const(99) == pytest.approx(1.0)


def test_no_weight_decay_on_norms_and_biases():
    m = build_model(ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2,
                                vocab_size=100, normalization="LayerNorm",
                                add_bias_linear=True), math_attention, 0)
    decay, no_decay = param_groups(m, 0.1)
    names = {id(p): n for n, p in m.named_parameters()}
    assert all(names[id(p)].endswith("weight") and p.ndim == 2 for p in decay["params"])
    assert {names[id(p)] for p in no_decay["params"]} == {
        n for n, p in m.named_parameters() if n.endswith("bias") or "norm" in n}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0


def test_clipping_matches_torch():
    g = torch.Generator().manual_seed(0)
    a = [torch.nn.Parameter(torch.zeros(5, 3)) for _ in range(3)]
    b = [torch.nn.Parameter(torch.zeros(5, 3)) for _ in range(3)]
    for p, q in zip(a, b):
        p.grad = torch.randn(5, 3, generator=g) * 4
        q.grad = p.grad.clone()
    ours = unscale_and_clip(grad_parts(a), 1.0, max_norm=1.0)
    ref = torch.nn.utils.clip_grad_norm_(b, max_norm=1.0)
    assert ours == pytest.approx(ref.item(), rel=1e-6)
    for p, q in zip(a, b):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_unscale_and_non_finite_norm():
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), 8.0)
    assert unscale_and_clip(grad_parts([p]), 0.5, 0.0) == pytest.approx(8.0)  # ||[4,4,4,4]||
    p.grad = torch.tensor([1.0, float("inf"), 0.0, 0.0])
    assert not math.isfinite(unscale_and_clip(grad_parts([p]), 1.0, 1.0))


def test_dynamic_loss_scaler():
    s = LossScaler(TrainConfig(initial_loss_scale=1024.0, hysteresis=2, loss_scale_window=3))
    s.update(overflow=True)
    assert s.scale == 1024.0  # first overflow absorbed by hysteresis
    s.update(overflow=True)
    assert s.scale == 512.0
    for _ in range(3):
        s.update(overflow=False)
    assert s.scale == 1024.0
    static = LossScaler(TrainConfig(loss_scale=64.0))
    static.update(overflow=True)
    assert static.scale == 64.0


@pytest.mark.parametrize("kw", [
    dict(),  # Llama style, MHA
    dict(num_query_groups=2, untie_embeddings_and_output_weights=True),
    dict(swiglu=False, position_embedding_type="learned_absolute", normalization="LayerNorm"),
], ids=["mha", "gqa-untied", "gpt2"])
def test_flops_formula_matches_counted_matmuls(kw, monkeypatch):
    """Megatron's formula == FLOPs torch's FlopCounterMode counts in one fwd+bwd
    (math attention: explicit s x s matmuls, counted in full as the formula assumes;
    plain aten matmuls, which the counter knows, instead of the oneDNN linear op)."""
    from megaulysses.model import fused
    monkeypatch.setattr(fused, "ONEDNN_LINEAR", False)
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                      vocab_size=256, **kw)
    m = build_model(cfg, math_attention, 0)
    tokens = torch.randint(0, 256, (3, 32))
    with FlopCounterMode(display=False) as counter:
        m(tokens, labels=tokens).sum().backward()
    # The embedding lookup's input gradient is never formed (tokens are ints), so the
    # first layer's input-gradient matmuls are still counted: nothing to subtract.
    assert counter.get_total_flops() == flops_per_iteration(cfg, global_batch_size=3)
