"""The parity matrix: every grid trains the same model to the same losses as one process.

Same tiny GPT, same data, same seed, dropout 0, fp32, 10 steps of 8 samples (so dp2 also
accumulates 2 micro-batches per rank). Losses must agree per step within 1e-5 relative;
final parameters within 5e-5 absolute (Adam divides by sqrt(v): gradients that differ in
their last bits move a parameter by up to ~lr * 1e-3 per step, and weights are ~0.02).
"""

import os
import subprocess
import sys

import pytest
import torch

from dist import free_port, run_ranks
from helpers import REPO, TINY, read_jsonl, train_losses

LOSS_RTOL = 1e-5
PARAM_ATOL = 5e-5
STEPS = ["--train-iters", "10", "--global-batch-size", "8", "--eval-interval", "5"]
GPT2 = ["--position-embedding-type", "learned_absolute", "--normalization", "LayerNorm",
        "--no-swiglu", "--add-bias-linear"]
STYLES = {"llama-gqa": [], "gpt2": GPT2,
          "llama-untied": ["--untie-embeddings-and-output-weights"]}
TP2 = ["--tensor-model-parallel-size", "2"]
SP2 = ["--ds-sequence-parallel-size", "2"]


def train(rank, world, args):
    from megaulysses.config import parse_args
    from megaulysses.training.trainer import Trainer
    trainer = Trainer(parse_args(args))
    trainer.train()
    # Whole parameters (gathering tensor-parallel shards is a collective: every rank).
    full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p
            for n, p in trainer.model.named_parameters()}
    if rank != 0:
        return None
    return {n: p.detach().numpy().copy() for n, p in full.items()}


def run_args(tmp_path, name, style_flags, extra=(), steps=STEPS):
    path = str(tmp_path / f"{name}.jsonl")
    return path, TINY + list(steps) + list(style_flags) + list(extra) + [
        "--metrics-jsonl", path, "--data-cache-path", str(tmp_path / "cache")]


def one_process_runs(tmp, styles: dict, params_of, steps=STEPS) -> dict:
    """Per model style: (the --metrics-jsonl records, final parameters) of one process;
    `params_of(args)` trains and returns the parameters."""
    out = {}
    for style, flags in styles.items():
        path, args = run_args(tmp, style, flags, steps=steps)
        params = params_of(args)
        out[style] = (read_jsonl(path), params)
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return one_process_runs(tmp_path_factory.mktemp("ref"), STYLES,
                            lambda args: train(0, 1, args))


def assert_same_run(records, ref_records, params=None, ref_params=None, iters=10):
    got, want = train_losses(records), train_losses(ref_records)
    assert sorted(got) == list(range(1, iters + 1))
    for it in want:
        assert got[it] == pytest.approx(want[it], rel=LOSS_RTOL), (it, got[it], want[it])
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    ref_evals = [r["eval_loss"] for r in ref_records if "eval_loss" in r]
    assert evals == pytest.approx(ref_evals, rel=LOSS_RTOL)
    if params is not None:
        assert params.keys() == ref_params.keys()
        for name in params:
            torch.testing.assert_close(torch.from_numpy(params[name]),
                                       torch.from_numpy(ref_params[name]), rtol=0,
                                       atol=PARAM_ATOL, msg=name)


# dp2, sp4 (P % kv heads == 0), dp2 x sp2 and dp2 x tp2 x sp2 of this model run in
# tests/parallel/test_zero.py, at ZeRO stage 0 next to stages 1-3 in the same ranks;
# tp2 x sp2 also in test_pipeline.py (pp2 x tp2 x sp2).
GRIDS = [  # (style, world, flags)
    ("llama-gqa", 2, ["--ds-sequence-parallel-size", "2"]),  # sp2: kv heads split
    ("gpt2", 2, ["--ds-sequence-parallel-size", "2"]),
    ("llama-gqa", 2, TP2),  # one kv head per tensor rank
    ("llama-gqa", 2, TP2 + ["--sequence-parallel"]),  # Megatron-SP, the paper's baseline
    ("gpt2", 2, TP2 + ["--sequence-parallel"]),  # learned positions, biases, LayerNorm
    ("llama-untied", 4, TP2 + SP2 + ["--sequence-parallel"]),  # vocab-parallel output layer
]


@pytest.mark.parametrize("style,world,flags", GRIDS,
                         ids=["sp2", "gpt2-sp2", "tp2", "tp2-megatron-sp",
                              "gpt2-tp2-megatron-sp", "untied-tp2-sp2-megatron-sp"])
def test_grid_equals_one_process(reference, tmp_path, style, world, flags):
    path, args = run_args(tmp_path, "grid", STYLES[style], flags)
    params = run_ranks(train, world, args)[0]
    ref_records, ref_params = reference[style]
    assert_same_run(read_jsonl(path), ref_records, params, ref_params)


# tests/test_convergence.py runs sp2 x dp2 and tp2 x dp2 through torchrun as well.
@pytest.mark.parametrize("world,flags", [(2, SP2)], ids=["sp2"])
def test_torchrun_cli_equals_one_process(reference, tmp_path, world, flags):
    """The real command line: torchrun -> pretrain_gpt.py -> --metrics-jsonl."""
    path, args = run_args(tmp_path, "cli", STYLES["llama-gqa"], flags)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           str(world), "--master-port", str(free_port()),
                           os.path.join(REPO, "pretrain_gpt.py"), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_same_run(read_jsonl(path), reference["llama-gqa"][0])
    tp = 2 if "--tensor-model-parallel-size" in flags else 1
    assert f"dp {world // 2 // tp} x tp {tp} x pp 1 x sp 2" in proc.stdout
    comm = [r for r in read_jsonl(path) if "loss" in r][-1]
    assert comm["comm_bytes_a2a"] > 0 and comm["comm_bytes_all_reduce"] > 0


def test_ulysses_degree_is_an_alias():
    from megaulysses.config import parse_args
    assert parse_args(["--ulysses-degree", "2"]).parallel.ds_sequence_parallel_size == 2
