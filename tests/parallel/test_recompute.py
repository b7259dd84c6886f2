"""Activation recomputation (Megatron-LM's --recompute-* flags) changes what backward keeps,
never what a step computes.

One process, fp32, dropout on (the RNG is restored before each recomputation): every
setting gives bit-identical losses to the run without recomputation (the same arithmetic
in the same order). The grids (tp2 x sp2 x dp2 at ZeRO 1-3, pp2) run recomputation in
tests/parallel/test_zero.py and tests/parallel/test_pipeline.py against one process.

What backward keeps is measured from the live tensor bytes of a forward pass, per layer:
full recomputation keeps only each block's input; selective keeps less than none (the
attention core's internals are dropped).
"""

import pytest
import torch

from helpers import run_inprocess, train_losses

DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
SETTINGS = {
    "selective": ["--recompute-activations"],
    "full-uniform-1": ["--recompute-granularity", "full"],
    "full-uniform-2": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                       "--recompute-num-layers", "2"],
    "full-block-1": ["--recompute-granularity", "full", "--recompute-method", "block",
                     "--recompute-num-layers", "1"],
}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return train_losses(run_inprocess(DROPOUT, tmp_path_factory.mktemp("plain"), "plain"))


@pytest.mark.parametrize("name", list(SETTINGS))
def test_recompute_gives_identical_losses(plain, tmp_path, name):
    got = train_losses(run_inprocess(DROPOUT + SETTINGS[name], tmp_path, name))
    assert sorted(got) == sorted(plain) == list(range(1, 7))
    assert got == plain  # bit for bit: same ops, same order, same dropout masks


def test_layer_groups():
    from megaulysses.parallel.recompute import layer_groups
    assert layer_groups(5, "uniform", 2) == [(0, 2, True), (2, 4, True), (4, 5, True)]
    assert layer_groups(4, "block", 1) == [(0, 1, True), (1, 4, False)]
    assert layer_groups(2, "block", 2) == [(0, 1, True), (1, 2, True)]


def _kept_bytes_per_layer(recompute: list, layers: int, cfg_args: list) -> float:
    """Live tensor bytes a forward pass leaves for backward, per layer: the difference
    between 2 and 1 layers (the embedding, head and loss cancel out)."""
    from megaulysses.config import parse_args, resolve
    from megaulysses.model.attention import select_backend
    from megaulysses.model.gpt import build_model
    from megaulysses.parallel.recompute import apply_recompute
    from megaulysses.training.live_bytes import LiveBytes
    kept = []
    for n in (layers, 2 * layers):
        cfg = resolve(parse_args(cfg_args + ["--num-layers", str(n)] + recompute), 1, 512)
        _, core = select_backend("auto", torch.device("cpu"))
        model = build_model(cfg.model, core, seed=0)
        m = cfg.memory
        apply_recompute(model, m.recompute_granularity, m.recompute_method,
                        m.recompute_num_layers)
        tokens = torch.randint(0, 512, (2, cfg.model.seq_length))
        with LiveBytes() as live:
            losses = model(tokens, labels=tokens)
            kept.append(live.current - losses.numel() * 4)
        losses.sum().backward()
    return (kept[1] - kept[0]) / layers


def test_kept_activations_per_layer_fall():
    """b=2, s=64, h=64, 4 heads (the CPU block kernel keeps its softmax probabilities):
    full keeps exactly each block's fp32 input [b, s, h]; selective keeps less than none."""
    base = ["--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--vocab-size", "512", "--tokenizer-type", "NullTokenizer"]
    none = _kept_bytes_per_layer([], 1, base)
    selective = _kept_bytes_per_layer(["--recompute-activations"], 1, base)
    full = _kept_bytes_per_layer(["--recompute-granularity", "full"], 1, base)
    block_input = 2 * 64 * 64 * 4
    assert full == block_input, (full, block_input)
    probs = 2 * 4 * 64 * 65 // 2 * 4  # the block kernel's causal probabilities, fp32
    assert selective <= none - probs, (selective, none, probs)
    assert none > 10 * full
