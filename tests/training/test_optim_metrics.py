"""Optimizer pieces and the FLOPs formula against independent computations."""

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megaulysses.config import TrainConfig
from megaulysses.model.attention import math_attention
from megaulysses.model.gpt import build_model
from megaulysses.training.metrics import flops_per_iteration
from megaulysses.parallel.grad_norm import GradPart, unscale_and_clip
from megaulysses.training.optim import LossScaler, LRSchedule, param_groups
from helpers import llama_config


def grad_parts(params) -> list:
    return [GradPart(p.grad) for p in params if p.grad is not None]


def schedule(**kw):
    base = dict(lr=1.0, min_lr=0.1, train_iters=100, lr_warmup_iters=10)
    base.update(kw)
    return LRSchedule(TrainConfig(**base))


def test_warmup_then_cosine():
    """Megatron-LM's OptimizerParamScheduler: a step runs at the value where it starts, so
    the first warmup step has --lr-warmup-init (0: no update)."""
    s = schedule()
    assert s(0) == 0.0 and s(9) == pytest.approx(0.9)
    assert s(10) == pytest.approx(1.0)
    assert schedule(lr_warmup_init=0.5)(4) == pytest.approx(0.5 + 0.5 * 4 / 10)
    assert s(55) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the decay
    assert s(100) == pytest.approx(0.1) and s(500) == pytest.approx(0.1)


def test_linear_and_constant_and_decay_iters():
    lin = schedule(lr_decay_style="linear", lr_decay_iters=50)
    assert lin(30) == pytest.approx(0.1 + 0.9 * (1 - 20 / 40))
    assert lin(60) == pytest.approx(0.1)
    const = schedule(lr_decay_style="constant")
    assert const(5) == pytest.approx(0.5) and const(99) == pytest.approx(1.0)


def test_no_weight_decay_on_norms_and_biases():
    m = build_model(llama_config(num_layers=1, hidden_size=32, num_attention_heads=2,
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
    for p, q in zip(a, b, strict=True):
        p.grad = torch.randn(5, 3, generator=g) * 4
        q.grad = p.grad.clone()
    ours = unscale_and_clip(grad_parts(a), 1.0, max_norm=1.0)
    ref = torch.nn.utils.clip_grad_norm_(b, max_norm=1.0)
    assert ours == pytest.approx(ref.item(), rel=1e-6)
    for p, q in zip(a, b, strict=True):
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
    from megaulysses.model.ops import onednn as fused
    monkeypatch.setattr(fused, "ONEDNN_LINEAR", False)
    cfg = llama_config(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                      vocab_size=256, **kw)
    m = build_model(cfg, math_attention, 0)
    tokens = torch.randint(0, 256, (3, 32))
    with FlopCounterMode(display=False) as counter:
        m(tokens, labels=tokens).sum().backward()
    # The embedding lookup's input gradient is never formed (tokens are ints), so the
    # first layer's input-gradient matmuls are still counted: nothing to subtract.
    assert counter.get_total_flops() == flops_per_iteration(cfg, global_batch_size=3)


# -- the GPU peak table: the most specific entry, by whole tokens of the device name ---------

BF16, FP32 = torch.bfloat16, torch.float32


@pytest.mark.parametrize("name,dtype,tf32,peak", [
    ("NVIDIA H100 80GB HBM3", BF16, True, 989.4),  # SXM5
    ("NVIDIA H100 PCIe", BF16, True, 756.5),
    ("NVIDIA H100 PCIe", FP32, True, 378.0),
    ("NVIDIA H100 PCIe", FP32, False, 51.2),
    ("NVIDIA H100 NVL", BF16, True, 835.5),
    ("NVIDIA H100 80GB HBM3", FP32, True, 494.7),
    ("NVIDIA H100 80GB HBM3", FP32, False, 66.9),
    ("NVIDIA H200", BF16, True, 989.4),
    ("NVIDIA H200 NVL", BF16, True, 835.5),
    ("NVIDIA GH200 480GB", BF16, True, 989.4),
    ("NVIDIA A100-SXM4-80GB", BF16, True, 312.0),
    ("NVIDIA A100 80GB PCIe", FP32, True, 156.0),
    ("NVIDIA A100-SXM4-40GB", FP32, False, 19.5),
    ("NVIDIA L40", BF16, True, 181.05),  # not L4's
    ("NVIDIA L40S", BF16, True, 362.05),  # not L40's
    ("NVIDIA L4", BF16, True, 121.0),
    ("NVIDIA L4", FP32, True, 60.0),
    ("NVIDIA A10", torch.float16, True, 125.0),
    ("NVIDIA A40", BF16, True, 149.7),
    ("Tesla V100-SXM2-16GB", torch.float16, True, 125.0),
    ("Tesla V100-PCIE-32GB", FP32, True, 14.0),  # no TF32 on Volta: tf32 = fp32
    ("NVIDIA B200", BF16, True, 2250.0),
    ("NVIDIA A10G", BF16, True, None),  # not A10's: unknown, measured
    ("NVIDIA GeForce RTX 4090", BF16, True, None),
    ("NVIDIA H1000", BF16, True, None),
])
def test_gpu_peak_table(name, dtype, tf32, peak):
    from megaulysses.training.metrics import gpu_peak_tflops
    assert gpu_peak_tflops(name, dtype, tf32) == peak


def test_peak_tflops_on_cuda_reads_the_table_and_the_tf32_state(monkeypatch):
    """peak_tflops as the trainer calls it, the device name and TF32 state faked."""
    from megaulysses.training import metrics
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    monkeypatch.setattr(metrics, "tf32_active", lambda: True)
    assert metrics.peak_tflops(cuda, BF16, None) == 756.5
    assert metrics.peak_tflops(cuda, FP32, None) == 378.0
    monkeypatch.setattr(metrics, "tf32_active", lambda: False)
    assert metrics.peak_tflops(cuda, FP32, None) == 51.2
    assert metrics.peak_tflops(cuda, FP32, 123.0) == 123.0  # --peak-tflops wins
    assert metrics.peak_tflops(cuda, BF16, None, name="NVIDIA L40S") == 362.05


def test_no_two_table_entries_tie():
    """Every entry is the most specific for its own name: no two match with the same
    number of tokens."""
    from megaulysses.training.metrics import GPU_PEAKS, gpu_peak
    for key in GPU_PEAKS:
        assert gpu_peak("NVIDIA " + " ".join(key))[0] == key
