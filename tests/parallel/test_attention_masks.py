"""The mask matrix: causal, packed documents, sliding window and both block-sparse layouts
train to the same losses on every sequence grid as one process with the plain math
backend and the same mask.

Grids (8 gloo ranks, one spawn for all of them): Ulysses sp4, ring cp4 (with selective
recomputation), hybrid sp2 x cp2, tp2 x sp2 x cp2 (Megatron-SP in tp, full recomputation),
and sp2 x cp4 (sequence degree 8 with 2 kv heads, ZeRO-3); packed documents also on
pp2 x sp2 x cp2. Left to tests elsewhere (ELSEWHERE): the plain causal mask on the
three sequence grids (test_ulysses.py, test_ring.py, test_dtype_matrix.py); the window
and bigbird masks on ring cp4 and sp2 x cp2, which test_ring.py checks at the attention
core, forward and backward; the fixed layout on tp2 x sp2 x cp2 (bigbird's code path
there). A GQA model (8 heads, 2 kv heads), fp32, on a dataset of short documents
(several per sample) written here in Megatron's format; 2 steps, in which each rank runs
one micro-batch of 1 sample (`samples`), against one process on the same samples.
"""

import numpy as np
import pytest

from dist import run_ranks
from helpers import LLAMA, parsed, read_jsonl, train_losses

LOSS_RTOL = 1e-5
VOCAB = 250  # NullTokenizer: eod = 250
MODEL = LLAMA + ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8",
         "--group-query-attention", "--num-query-groups", "2", "--seq-length", "128",
         "--micro-batch-size", "1", "--train-iters", "2",
         "--lr", "3e-3", "--lr-warmup-iters", "0", "--log-interval", "1",
         "--eval-interval", "1000", "--generate", "0", "--seed", "5", "--peak-tflops", "1",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--split", "100,0,0"]
MASKS = {
    "causal": [],
    "documents": ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"],
    "window": ["--window-size", "24"],
    "fixed": ["--attention-sparsity", "fixed", "--sparse-block-size", "8",
              "--sparse-local-blocks", "4", "--sparse-global-blocks", "1"],
    "bigbird": ["--attention-sparsity", "bigbird", "--sparse-block-size", "8",
                "--sparse-local-blocks", "2", "--sparse-global-blocks", "1",
                "--sparse-random-blocks", "2"],
}
SP, CP, TP = "--ds-sequence-parallel-size", "--context-parallel-size", \
    "--tensor-model-parallel-size"
GRIDS = {  # every one on 8 ranks (dp fills the rest); recomputation changes no loss
    "sp4": [SP, "4"],
    "cp4-selective": [CP, "4", "--recompute-activations"],
    "sp2-cp2": [SP, "2", CP, "2"],
    "tp2-sp2-cp2-megatron-sp-full": [TP, "2", SP, "2", CP, "2", "--sequence-parallel",
                                     "--recompute-granularity", "full"],
    "sp2-cp4-zero3": [SP, "2", CP, "4", "--zero-stage", "3"],
}
EXTRA = {("documents", "pp2-sp2-cp2"): ["--pipeline-model-parallel-size", "2", SP, "2",
                                          CP, "2"]}
# (mask, grid) pairs other tests check, as the module doc says
ELSEWHERE = ({("causal", g) for g in ("sp4", "cp4-selective", "sp2-cp2")}
             | {(m, g) for m in ("window", "bigbird") for g in ("cp4-selective", "sp2-cp2")}
             | {("fixed", "tp2-sp2-cp2-megatron-sp-full")})
CASES = [(mask, grid, flags) for mask in MASKS for grid, flags in GRIDS.items()
         if (mask, grid) not in ELSEWHERE] + [
    (mask, grid, flags) for (mask, grid), flags in EXTRA.items()]


def samples(flags) -> int:
    """A grid's global batch on 8 ranks: one micro-batch of 1 sample per dp rank and step
    (the masks do not depend on how many micro-batches a rank sums, and a grid's cost is
    about their count: 4 samples a step took the module 1.5x the time of 2); two under
    pp2, where one would leave the pipeline nothing in flight."""
    degree = 1
    for i, flag in enumerate(flags):
        if flag.endswith("-parallel-size"):
            degree *= int(flags[i + 1])
    return 8 // degree * (2 if "--pipeline-model-parallel-size" in flags else 1)


SIZE = {(mask, grid): samples(flags) for mask, grid, flags in CASES}


def write_documents(prefix: str, seed: int = 0):
    """Documents of 3-60 tokens, each ending with EOD: ~4 per 128-token sample."""
    from megaulysses.data.indexed import IndexedDatasetWriter
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for _ in range(300):
            n = int(rng.integers(3, 60))
            w.add_document(np.append(rng.integers(0, VOCAB, n - 1), VOCAB))


SAVED = ("documents", "sp2-cp2")  # saves at iteration 1: loaded at cp 1 below


def args_for(tmp, mask: str, name: str, flags, size: int) -> tuple[str, list]:
    """(metrics path, arguments) of a run of `size` samples a step."""
    path = str(tmp / f"{mask}-{name}.jsonl")
    save = ["--save", str(tmp / "ck"), "--save-interval", "1"] if (mask, name) == SAVED else []
    return path, MODEL + MASKS[mask] + list(flags) + save + [
        "--global-batch-size", str(size),
        "--data-path", str(tmp / "docs"), "--data-cache-path", str(tmp / "cache"),
        "--metrics-jsonl", path]


def train_all(rank, world, configs):
    """One Trainer per Config (helpers.parsed), one after the other."""
    from megaulysses.training.trainer import Trainer
    for cfg in configs:
        Trainer(cfg).train()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("masks")
    write_documents(str(tmp / "docs"))
    ref = {}  # one process, the math backend: the reference, per (mask, batch)
    needed = {(mask, 2) for mask in MASKS} | {(mask, n) for (mask, _), n in SIZE.items()}
    for mask, size in sorted(needed):
        path, args = args_for(tmp, mask, f"ref{size}", ["--attention-backend", "math"], size)
        train_all(0, 1, parsed([args]))
        ref[mask, size] = read_jsonl(path)
    cases = [args_for(tmp, mask, grid, flags, SIZE[mask, grid]) for mask, grid, flags in CASES]
    run_ranks(train_all, 8, parsed(args for _, args in cases), timeout=900)
    got = {(mask, grid): read_jsonl(path)
           for (mask, grid, _), (path, _) in zip(CASES, cases, strict=True)}
    # The checkpoint saved at sp2 x cp2 loads in one process and goes on like it.
    path, args = args_for(tmp, "documents", "resumed", ["--attention-backend", "math",
                                                        "--load", str(tmp / "ck" / "iter_0000001")],
                          SIZE[SAVED])
    train_all(0, 1, parsed([args]))
    got[("documents", "resumed")] = read_jsonl(path)
    return ref, got


def test_ring_checkpoint_loads_in_one_process(runs):
    ref, got = runs
    want = train_losses(ref["documents", SIZE[SAVED]])
    have = train_losses(got[("documents", "resumed")])
    assert sorted(have) == [2]
    assert have[2] == pytest.approx(want[2], rel=LOSS_RTOL)


@pytest.mark.parametrize("mask,grid", [(m, g) for m, g, _ in CASES],
                         ids=[f"{m}-{g}" for m, g, _ in CASES])
def test_grid_equals_one_process(runs, mask, grid):
    ref, got = runs
    want, have = train_losses(ref[mask, SIZE[mask, grid]]), train_losses(got[(mask, grid)])
    assert sorted(have) == [1, 2]
    for it in want:
        assert have[it] == pytest.approx(want[it], rel=LOSS_RTOL), (it, have[it], want[it])


def test_masks_change_the_loss(runs):
    """Each mask is really applied: its reference differs from plain causal's by more than
    fp32 noise (a 2-layer model at initialization leans little on attention: at 2 samples
    a step the masks move the second loss by 1.3e-4 (fixed) to 9e-4 (bigbird) relative)."""
    ref, _ = runs
    causal = train_losses(ref["causal", 2])[2]
    for mask in MASKS:
        if mask != "causal":
            assert train_losses(ref[mask, 2])[2] != pytest.approx(causal, rel=5e-6), mask
