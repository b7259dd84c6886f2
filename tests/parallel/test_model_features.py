"""Issue 23's model features on every grid == one process: per-head q/k norms
(--qk-layernorm), q/k/v-only biases (--add-qkv-bias) and the RoPE scalings, on a
Qwen3-like tiny model (GQA, head dim 24 != 64/4 heads, no other biases).

Two models, each against its own one-process run: YaRN with RMSNorm, and llama3 scaling
with LayerNorm (whose q/k norms have biases too). YaRN scales from an original context of
8 positions, llama3 from 16 (wavelengths below 8 kept, 8 to 32 blended, above scaled), so
the 32-token sequences use scaled frequencies. Grids, all in one spawn of
4 gloo ranks (dp fills the rest): tp2 with ZeRO-1 (the q/k norms' gradients summed over
tp, the biases split with their rows), Ulysses sp2 with ZeRO-2, ring cp2, ZeRO-3 over dp4;
tp2 with Megatron-SP, and pp2. Two steps each: per step the loss and the gradient norm,
and the parameters after both steps, against one process (the tolerances of
test_parity.py).
"""

import pytest
import torch

from dist import run_ranks
from helpers import LLAMA, read_jsonl

LOSS_RTOL = 1e-5
# Parameters after 2 AdamW steps at lr 3e-3. AdamW moves an element by lr * m / (sqrt(v) +
# eps): where the gradient is near eps, the move is a step function of the gradient, and
# the fp32 summation order of a split matmul (tp2) tilts it. At Megatron-LM's eps 1e-8
# attn.v and attn.q of tp2-zero1 differed by up to 5.7e-5 here (and beyond 1e-4 on a
# loaded machine of the same kind: issue 42); the comparison, not the code, was
# ill-conditioned. At eps 1e-5 the update is smooth in the gradient: 8.9e-7 here.
ADAM_EPS = "1e-5"
PARAM_ATOL = 1e-5
MODEL = LLAMA + [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "24",
    "--qk-layernorm", "--add-qkv-bias", "--seq-length", "32", "--micro-batch-size", "1",
    "--global-batch-size", "4", "--train-iters", "2", "--lr", "3e-3", "--log-interval", "1",
    "--adam-eps", ADAM_EPS,
    "--eval-iters", "0", "--generate", "0", "--seed", "5", "--peak-tflops", "1",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255"]
STYLES = {
    "yarn": ["--rope-type", "yarn", "--rotary-scaling-factor", "4",
             "--original-max-position-embeddings", "8", "--mscale", "0.9",
             "--mscale-all-dim", "0.5"],
    "llama3-layernorm": ["--use-rope-scaling", "--rope-scaling-factor", "4",
                         "--rope-scaling-low-freq-factor", "0.5",
                         "--rope-scaling-high-freq-factor", "2",
                         "--original-max-position-embeddings", "16", "--normalization",
                         "LayerNorm"],
}
TP2, SP2, CP2 = (["--tensor-model-parallel-size", "2"], ["--ds-sequence-parallel-size", "2"],
                 ["--context-parallel-size", "2"])
GRIDS = [  # (style, name, flags) on 4 ranks
    ("yarn", "tp2-zero1", TP2 + ["--zero-stage", "1"]),
    ("yarn", "sp2-zero2", SP2 + ["--zero-stage", "2"]),
    ("yarn", "cp2-ring", CP2),
    ("yarn", "dp4-zero3", ["--zero-stage", "3"]),
    ("llama3-layernorm", "tp2-megatron-sp", TP2 + ["--sequence-parallel"]),
    ("llama3-layernorm", "pp2", ["--pipeline-model-parallel-size", "2"]),
]


def train_all(rank, world, runs):
    """One Trainer per command line, one after the other in these ranks; rank 0 returns
    each run's whole parameters after training."""
    from megaulysses.config import parse_args
    from megaulysses.parallel.pipeline import full_state_dict
    from megaulysses.training.trainer import Trainer
    out = []
    for args in runs:
        trainer = Trainer(parse_args(args))
        trainer.train()
        state = full_state_dict(trainer.model, trainer.comm)  # every rank takes part
        out.append(None if state is None else {k: v.numpy().copy() for k, v in state.items()})
    return out


def args_for(tmp, style: str, name: str, flags) -> tuple[str, list]:
    path = str(tmp / f"{style}-{name}.jsonl")
    return path, MODEL + STYLES[style] + list(flags) + [
        "--data-cache-path", str(tmp / "cache"), "--metrics-jsonl", path]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("features")
    ref = {}
    for style in STYLES:
        path, args = args_for(tmp, style, "one-process", [])
        params = train_all(0, 1, [args])[0]
        ref[style] = (read_jsonl(path), params)
    cases = [args_for(tmp, style, name, flags) for style, name, flags in GRIDS]
    params = run_ranks(train_all, 4, [args for _, args in cases], timeout=600)[0]
    got = {name: (read_jsonl(path), p)
           for (_, name, _), (path, _), p in zip(GRIDS, cases, params, strict=True)}
    return ref, got


@pytest.mark.parametrize("style,name", [(s, n) for s, n, _ in GRIDS],
                         ids=[n for _, n, _ in GRIDS])
def test_grid_equals_one_process(runs, style, name):
    ref, got = runs
    (want, want_params), (have, have_params) = ref[style], got[name]
    steps = lambda records: [r for r in records if "loss" in r]  # noqa: E731
    assert [r["iteration"] for r in steps(have)] == [1, 2]
    for a, b in zip(steps(have), steps(want), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=LOSS_RTOL), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=LOSS_RTOL), (a, b)
    assert have_params.keys() == want_params.keys()
    assert "layers.1.attn.k_norm.weight" in have_params and "layers.1.attn.v.bias" in have_params
    for key in have_params:
        torch.testing.assert_close(torch.from_numpy(have_params[key]),
                                   torch.from_numpy(want_params[key]), rtol=0, atol=PARAM_ATOL,
                                   msg=key)


def test_the_features_train(runs):
    """The q/k norm weights and the q/k/v biases moved from their initial 1 and 0 (their
    gradients are not zero), and there is no bias on out or the MLP."""
    ref, _ = runs
    for style, (_, params) in ref.items():
        for key in ("layers.0.attn.q_norm.weight", "layers.1.attn.k_norm.weight"):
            assert abs(params[key] - 1).max() > 1e-4, (style, key)
        for key in ("layers.0.attn.q.bias", "layers.1.attn.k.bias", "layers.0.attn.v.bias"):
            assert abs(params[key]).max() > 1e-4, (style, key)
        assert not any(k.endswith(".bias") and (".out." in k or ".mlp." in k) for k in params)
