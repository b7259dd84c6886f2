"""--torch-compile (parallel/compile.py): compiled blocks and loss train like eager ones.

One process: the tiny GQA model compiled whole (one graph shared by both blocks, one for
the loss; `fullgraph=True`, so no break), over steps whose count of micro-batches changes
(--rampup-batch-size): the same losses and gradient norms as eager within
test_dtype_matrix.py's fp32 tolerances, two graphs in all (nothing recompiles per step),
the start line and the compile time logged once. (An evaluation compiles each graph once
more, for eval mode without grad: measured, left out for time.) A combination that cannot compile yet (the distributed optimizer's gradient-
accumulation fusion) says so in one line and trains eagerly.

Four gloo ranks, one spawn, each grid eager then compiled in the same processes:
    tp2 (Megatron-SP) x sp2, ZeRO-3, packed documents, full recomputation: the Ulysses
        core eager between graphs (DTensor in them, FSDP2's hooks around them, checkpoints
        around the block); the only graph break is the one before the core, and a new
        document layout each step recompiles nothing.
    pp2 x tp2: pipeline stages of blocks compiled whole, through DTensor.

Measured deviations of compiled from eager (fp32, 2 cores): losses <= 1e-7 relative,
gradient norms <= 1e-7; held to the dtype matrix's 1e-6 and 2e-6.
"""

import logging

import numpy as np
import pytest

from dist import run_ranks
from helpers import TINY, read_jsonl
from test_dtype_matrix import GRAD_NORM_RTOL, LOSS_RTOL

MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512"]
STEPS = ["--micro-batch-size", "1", "--global-batch-size", "4", "--eval-iters", "0"]
EAGER_CORE_BREAK = "SelfAttention.attend"  # the one graph break: the eager attention core


def write_documents(prefix: str) -> None:
    """Documents of 3-20 tokens, each ending with EOD (NullTokenizer's eod = vocab 250)."""
    from megaulysses.data.indexed import IndexedDatasetWriter
    rng = np.random.default_rng(1)
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for _ in range(200):
            n = int(rng.integers(3, 20))
            w.add_document(np.append(rng.integers(0, 250, n - 1), 250))


def train_runs(rank, world, runs) -> list:
    """Each run's (dynamo's graph count, its graph breaks' reasons, the --torch-compile
    log lines), one Trainer after another in these ranks."""
    from torch._dynamo.utils import counters

    from megaulysses.config import parse_args
    from megaulysses.training.trainer import Trainer
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("megaulysses.parallel")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    out = []
    for args in runs:
        counters.clear()
        lines.clear()
        Trainer(parse_args(args)).train()
        breaks = sorted(reason for reason in counters["graph_break"])
        out.append((counters["stats"]["unique_graphs"], breaks,
                    [line for line in lines if line.startswith("--torch-compile")]))
    return out


def steps(records) -> dict:
    return {r["iteration"]: (r["loss"], r["grad_norm"]) for r in records if "loss" in r}


def assert_same(compiled, eager) -> None:
    got, want = steps(compiled), steps(eager)
    assert sorted(got) == sorted(want) and want
    for i, (loss, norm) in want.items():
        assert abs(got[i][0] - loss) <= LOSS_RTOL["fp32"] * abs(loss), (i, got[i], loss)
        assert abs(got[i][1] - norm) <= GRAD_NORM_RTOL["fp32"] * abs(norm), (i, got[i], norm)


def eager_and_compiled(tmp, name: str, args: list) -> list:
    return [args + flag + ["--metrics-jsonl", str(tmp / f"{name}-{kind}.jsonl"),
                           "--data-cache-path", str(tmp / "cache")]
            for kind, flag in (("eager", []), ("compiled", ["--torch-compile"]))]


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory):
    """Inductor's caches in one directory for this file's tests and their ranks (a kernel
    the one-process test compiled, the grids find built: gcc is most of the time); each
    rank compiles in its own process (no pool of compile workers per rank: 4 ranks share
    2 cores)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
        mp.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
        yield


def test_one_process_compiles_whole_without_recompiling(tmp_path, inductor_cache):
    # micro-batches per step: 2, 2, 4, 4 (the global batch ramps up)
    ramp = TINY + MOCK + STEPS + ["--train-iters", "4", "--rampup-batch-size", "2", "2", "8"]
    blocked = ["--bf16", "--use-distributed-optimizer", "--train-iters", "2"]
    runs = (eager_and_compiled(tmp_path, "ramp", ramp)
            + eager_and_compiled(tmp_path, "blocked", TINY + MOCK + STEPS + blocked))
    results = run_ranks(train_runs, 1, runs, timeout=600)[0]
    (graphs, breaks, lines), (blocked_graphs, _, blocked_lines) = results[1], results[3]
    assert_same(read_jsonl(tmp_path / "ramp-compiled.jsonl"),
                read_jsonl(tmp_path / "ramp-eager.jsonl"))
    assert breaks == []  # fullgraph=True: it would have raised
    assert graphs == 2  # one for both blocks, one for the loss: nothing recompiled
    assert lines[0] == ("--torch-compile: 2 transformer blocks compiled whole (one graph "
                        "shared by all); the loss compiled")
    assert len(lines) == 2 and lines[1].endswith("s (the first forward and backward)")
    # a combination that cannot compile yet: one line, and the run trains eagerly
    assert blocked_graphs == 0 and len(blocked_lines) == 1
    assert blocked_lines[0].startswith("--torch-compile: the model runs eagerly (the "
                                       "distributed optimizer's gradient-accumulation fusion")
    assert_same(read_jsonl(tmp_path / "blocked-compiled.jsonl"),
                read_jsonl(tmp_path / "blocked-eager.jsonl"))


def test_grids_compile_like_eager(tmp_path, inductor_cache):
    write_documents(str(tmp_path / "docs"))
    docs = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "250", "--split", "100,0,0",
            "--data-path", str(tmp_path / "docs"), "--reset-position-ids",
            "--reset-attention-mask", "--eod-mask-loss"]
    grids = {
        "tp2-sp2-zero3-docs-full": docs + ["--tensor-model-parallel-size", "2",
                                           "--sequence-parallel",
                                           "--ds-sequence-parallel-size", "2",
                                           "--zero-stage", "3", "--recompute-granularity",
                                           "full", "--train-iters", "3"],
        "pp2-tp2": MOCK + ["--pipeline-model-parallel-size", "2",
                           "--tensor-model-parallel-size", "2", "--train-iters", "2"],
    }
    runs = [run for name, flags in grids.items()
            for run in eager_and_compiled(tmp_path, name, TINY + STEPS + flags)]
    ranks = run_ranks(train_runs, 4, runs, timeout=900)
    for name in grids:
        assert_same(read_jsonl(tmp_path / f"{name}-compiled.jsonl"),
                    read_jsonl(tmp_path / f"{name}-eager.jsonl"))
    # tp2 x sp2: the core eager, the one break before it; 3 graphs for the blocks (the
    # attention before and after the core, the rest), the loss eager (vocab-parallel):
    # three steps of new documents compiled nothing new
    for rank in ranks:
        graphs, breaks, lines = rank[1]
        assert len(breaks) == 1 and EAGER_CORE_BREAK in breaks[0], breaks
        assert graphs == 3, graphs
    assert "compiled around the attention core" in ranks[0][1][2][0]
    # pp2 x tp2: each stage's blocks one graph; no break
    for rank in ranks:
        graphs, breaks, lines = rank[3]
        assert breaks == [] and graphs == 1, (graphs, breaks)
        assert "compiled whole" in lines[0]
