"""--calculate-per-token-loss and Megatron-LM's default (each micro-batch's own token mean,
averaged over the micro-batches): each is what it says in one process, and every grid
trains like one process in both.

Packed documents of uneven lengths with --eod-mask-loss, so the micro-batches (and the
sequence slices of each) hold different numbers of loss tokens and the two modes differ
from the first gradient on. The model has zero-centered norms (--apply-layernorm-1p), so
their grids run too. Grids, 4 gloo ranks, one spawn for all, each in one mode (for time;
tests/parallel/test_attention_masks.py runs Megatron-LM's default mode with packed
documents on more grids): per micro-batch on pp2 x sp2 (the pipeline's loss function
weighs each micro-batch) and dp2 x ring cp2 (ZeRO-3; slices of uneven loss-token counts),
per token on dp2 x sp2 (ZeRO-2) and tp2 x sp2 (Megatron-SP). 2 steps of 4 one-sample
micro-batches, fp32: per-step losses and gradient norms.
"""

import copy
import math

import numpy as np
import pytest
import torch

from dist import run_ranks
from helpers import TINY, read_jsonl, train_losses

RTOL = 1e-5  # fp32, reduction order (as tests/parallel/test_attention_masks.py)
VOCAB = 250  # NullTokenizer: eod = 250
MODES = {"micro": [], "token": ["--calculate-per-token-loss"]}
FLAGS = ["--train-iters", "2", "--micro-batch-size", "1", "--global-batch-size", "4",
         "--eval-iters", "0", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
         "--split", "100,0,0", "--reset-position-ids", "--reset-attention-mask",
         "--eod-mask-loss", "--num-workers", "0",
         # the architecture, whatever the defaults: GPT-2 style, zero-centered norms
         "--position-embedding-type", "learned_absolute", "--normalization", "LayerNorm",
         "--apply-layernorm-1p", "--no-swiglu", "--add-bias-linear",
         "--hidden-dropout", "0", "--attention-dropout", "0"]
SP2, CP2 = ["--ds-sequence-parallel-size", "2"], ["--context-parallel-size", "2"]
GRIDS = {("micro", "pp2-sp2"): ["--pipeline-model-parallel-size", "2"] + SP2,
         ("micro", "dp2-cp2-zero3"): CP2 + ["--zero-stage", "3"],
         ("token", "dp2-sp2-zero2"): SP2 + ["--zero-stage", "2"],
         ("token", "tp2-sp2-megatron-sp"): ["--tensor-model-parallel-size", "2",
                                            "--sequence-parallel"] + SP2}


def write_documents(prefix: str):
    """Documents of 2-20 tokens, each ending with EOD: several per 32-token sample."""
    from megaulysses.data.indexed import IndexedDatasetWriter
    rng = np.random.default_rng(3)
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for _ in range(200):
            n = int(rng.integers(2, 20))
            w.add_document(np.append(rng.integers(0, VOCAB, n - 1), VOCAB))


def args_for(tmp, mode: str, name: str, flags=()) -> tuple[str, list]:
    path = str(tmp / f"{mode}-{name}.jsonl")
    return path, TINY + FLAGS + MODES[mode] + list(flags) + [
        "--data-path", str(tmp / "docs"), "--data-cache-path", str(tmp / "cache"),
        "--metrics-jsonl", path]


def train_all(rank, world, runs):
    from megaulysses.config import parse_args
    from megaulysses.training.trainer import Trainer
    for args in runs:
        Trainer(parse_args(args)).train()


def first_gradient_norm(trainer, mode: str) -> float:
    """The norm of the first step's gradient, from the definition of `mode`'s loss on a
    copy of the initial model: a plain loop, no weights from loss_weights.py."""
    model = copy.deepcopy(trainer.model)
    batches = trainer.train_data.micro_batches(0)
    sums = [(model(b["tokens"], b["position_ids"], b["labels"], b.get("documents"))
             * b["loss_mask"]).sum() for b in batches]
    counts = [b["loss_mask"].sum() for b in batches]
    if mode == "token":
        loss = sum(sums) / sum(counts)
    else:
        loss = sum(s / c for s, c in zip(sums, counts, strict=True)) / len(batches)
    loss.backward()
    return math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters()))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from megaulysses.config import parse_args
    from megaulysses.training.trainer import Trainer
    tmp = tmp_path_factory.mktemp("per_token")
    write_documents(str(tmp / "docs"))
    ref, direct = {}, {}
    for mode in MODES:  # one process: the reference
        path, args = args_for(tmp, mode, "one")
        trainer = Trainer(parse_args(args))
        direct[mode] = first_gradient_norm(trainer, mode)
        counts = [float(b["loss_mask"].sum()) for b in trainer.train_data.micro_batches(0)]
        trainer.train()
        ref[mode] = read_jsonl(path)
    cases = {(mode, grid): args_for(tmp, mode, grid, flags)
             for (mode, grid), flags in GRIDS.items()}
    run_ranks(train_all, 4, [args for _, args in cases.values()], timeout=600)
    got = {key: read_jsonl(path) for key, (path, _) in cases.items()}
    return ref, direct, counts, got


def grad_norms(records) -> dict:
    return {r["iteration"]: r["grad_norm"] for r in records if "grad_norm" in r}


def test_each_mode_is_its_definition(runs):
    """One process: the first gradient is that of the mode's loss, written out; the
    micro-batches do hold different token counts; the logged loss is the per-token mean
    in both, so the first step logs the same loss and the second (after different
    updates) does not."""
    ref, direct, counts, _ = runs
    assert len(set(counts)) > 1, counts
    for mode in MODES:
        assert grad_norms(ref[mode])[1] == pytest.approx(direct[mode], rel=RTOL), mode
    assert direct["micro"] != pytest.approx(direct["token"], rel=1e-3)
    micro, token = train_losses(ref["micro"]), train_losses(ref["token"])
    assert micro[1] == token[1]
    assert micro[2] != pytest.approx(token[2], rel=1e-6)


@pytest.mark.parametrize("mode,grid", list(GRIDS), ids=[f"{m}-{g}" for m, g in GRIDS])
def test_grid_equals_one_process(runs, mode, grid):
    ref, _, _, got = runs
    want, have = train_losses(ref[mode]), train_losses(got[(mode, grid)])
    assert sorted(have) == [1, 2]
    want_norm, have_norm = grad_norms(ref[mode]), grad_norms(got[(mode, grid)])
    for it in want:
        assert have[it] == pytest.approx(want[it], rel=RTOL), (it, have[it], want[it])
        assert have_norm[it] == pytest.approx(want_norm[it], rel=RTOL), it


def test_weights_from_the_masks():
    """loss_weights on one process: per token 1 / all tokens, per micro-batch
    1 / (its tokens * micro-batches); a micro-batch without loss tokens weighs as if it
    had one (its sum is 0: Megatron-LM's clamp), never a division by zero."""
    from megaulysses.parallel.comm import Comm
    from megaulysses.training.loss_weights import micro_batch_weights
    masks = [torch.tensor([[1.0, 1.0, 0.0]]), torch.tensor([[1.0, 0.0, 0.0]]),
             torch.zeros(1, 3)]
    batches = [{"loss_mask": m} for m in masks]
    cpu = torch.device("cpu")
    assert micro_batch_weights(batches, Comm(), cpu, True) == ([1 / 3] * 3, 3.0)
    assert micro_batch_weights(batches, Comm(), cpu, False) == ([1 / 6, 1 / 3, 1 / 3], 3.0)
