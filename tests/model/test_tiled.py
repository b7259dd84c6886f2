"""The tiled MLP (`apply_tiled_mlp`) against the same model untiled.

fp32 with dropout on (same seed): losses bitwise equal (the MLP is per token; the RNG
draws are untouched by the checkpoints), parameter gradients within GRAD_TOL of the
largest reference magnitude (the weight gradients are summed over tokens chunk by chunk,
a different fp32 order). bf16 autocast within BF16_TOL. Memory: nothing `[tokens, ffn]`
is saved for backward, and no op makes an `[tokens, ffn]` tensor of more than one chunk.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megaulysses.model.attention import sdpa_attention
from megaulysses.model.gpt import build_model
from megaulysses.model.tiling import TiledMLP, apply_tiled_mlp
from helpers import llama_config

GRAD_TOL = 1e-6
BF16_TOL = 3e-2
FFN = 96  # a width no other tensor of this model has: [..., FFN] are MLP intermediates


def tiny(**kw):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                ffn_hidden_size=FFN, seq_length=64, vocab_size=128, hidden_dropout=0.1,
                attention_dropout=0.1)
    base.update(kw)
    return llama_config(**base)


def batch(cfg, b=2):
    tokens = torch.randint(0, cfg.vocab_size, (b, cfg.seq_length),
                           generator=torch.Generator().manual_seed(0))
    return tokens, tokens.roll(-1, dims=1)


def losses_and_grads(cfg, chunks, dtype=torch.float32):
    model = apply_tiled_mlp(build_model(cfg, sdpa_attention, seed=1), chunks)
    tokens, labels = batch(cfg)
    torch.manual_seed(0)  # the dropout masks
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        losses = model(tokens, labels=labels)
    losses.mean().backward()
    return model, losses.detach(), {n: p.grad for n, p in model.named_parameters()}


def rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("chunks", [2, 8])
def test_tiled_mlp_matches_untiled_with_dropout(chunks):
    cfg = tiny()
    _, ref_losses, ref_grads = losses_and_grads(cfg, 1)
    model, losses, grads = losses_and_grads(cfg, chunks)
    assert all(isinstance(block.mlp_part, TiledMLP) for block in model.layers.values())
    assert torch.equal(losses, ref_losses)
    for name, g in ref_grads.items():
        assert rel(grads[name], g) < GRAD_TOL, name
    # Without autograd (evaluation) the chunks run as they are: equal outputs.
    model.eval()
    untiled = build_model(cfg, sdpa_attention, seed=1).eval()
    tokens, labels = batch(cfg)
    with torch.no_grad():
        assert torch.equal(model(tokens, labels=labels), untiled(tokens, labels=labels))


def test_tiled_mlp_one_chunk_changes_nothing():
    model = build_model(tiny(), sdpa_attention, seed=1)
    apply_tiled_mlp(model, 1)
    assert all("mlp_part" not in vars(block) for block in model.layers.values())


def test_tiled_mlp_bf16_autocast():
    cfg = tiny()
    _, ref_losses, ref_grads = losses_and_grads(cfg, 1, torch.bfloat16)
    _, losses, grads = losses_and_grads(cfg, 4, torch.bfloat16)
    assert rel(losses, ref_losses) < BF16_TOL
    for name, g in ref_grads.items():
        assert rel(grads[name], g) < BF16_TOL, name


class WidestMLPRows(TorchDispatchMode):
    """The most rows (elements / FFN) of any `[..., FFN]` tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == FFN:
                self.rows = max(self.rows, t.numel() // FFN)
        return out


def mlp_memory(chunks):
    """(elements of [..., FFN] tensors saved for backward, most [..., FFN] rows made)."""
    cfg = tiny(hidden_dropout=0.0, attention_dropout=0.0)
    model = apply_tiled_mlp(build_model(cfg, sdpa_attention, seed=1), chunks)
    tokens, labels = batch(cfg, b=4)  # 256 tokens; fc2.weight's gradient is [32, FFN]
    saved = []

    def pack(t):
        if t.dim() >= 2 and t.shape[-1] == FFN:
            saved.append(t.numel())
        return t

    with WidestMLPRows() as widest:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(tokens, labels=labels).mean()
        loss.backward()
    return sum(saved), widest.rows


def test_tiled_mlp_keeps_no_ffn_activations():
    tokens, chunks = 4 * 64, 4
    saved, rows = mlp_memory(1)
    assert saved >= 2 * tokens * FFN and rows == tokens  # untiled: kept, all tokens at once
    saved, rows = mlp_memory(chunks)
    assert saved == 0 and rows == tokens // chunks
