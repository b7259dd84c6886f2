"""The dtype x grid x ZeRO matrix: in every compute dtype, every grid at every ZeRO stage
trains like one process in that dtype.

{fp32, bf16, fp16, bf16 with --fp32-residual-connection} x {pp2 (x dp2), pp2 x sp2,
tp2 x sp2, dp2 x sp2 x cp2} x ZeRO {0, 1, 2, 3} in bf16 and {1, 3} in the other dtypes
(stages 0 and 1 share their precision code, the flat all-reduce or reduce-scatter of
fp32 gradients; stages 2 and 3 theirs, FSDP2's mixed precision, 3 resharding after
forward as well), each against one process with the same flags: the tiny GQA model of
test_parity.py, 2 steps, per-step losses and gradient norms. Every rank accumulates 2
micro-batches of 1 sample a step: 4 samples at dp2, 2 at dp1 (`batch`). One spawn per
world size runs every (dtype, grid, stage) of it, one Trainer after another.

Tolerances, per dtype, measured (`MEASURE=1 pytest -s` prints the worst deviations): what
ZeRO-1, which keeps fp32 parameters and rounds nothing differently from one process,
reaches on these grids, with headroom; every stage is held to the same number. A grid that
computes in another dtype than one process (before the fix: ZeRO-2/3 ran a 16-bit residual
stream while one process ran an fp32 one, and pp2 read bf16 bytes as fp32) fails it, below.

                  ZeRO-1, worst of 4 grids   all stages, worst      held to
    dtype         loss      grad norm        loss      grad norm    loss    grad norm
    fp32          3.7e-8    1.2e-7           3.7e-8    1.3e-7       1e-6    2e-6
    bf16          3.5e-5    2.0e-4           3.5e-5    2.5e-4       1e-4    1.5e-3
    fp16          2.9e-6    0                2.9e-6    0            2e-5    3e-4
    bf16, fp32
    residual      1.4e-5    1.8e-4           1.4e-5    2.7e-4       5e-5    1.5e-3

(The tolerances were set when every grid ran 4 samples a step, dp1 grids 4 micro-batches
a rank: the worst deviations then were the same or up to 2.6x smaller.)

(16-bit deviations come from fp32 reduction order: masters that differ in their last bit
can round to different bf16/fp16 values, 2^-8 / 2^-11 apart; a 16-bit residual stream
rounds every block's output, and its gradient, once more.) Before the fix (measured over
3 steps), bf16 pp2 at ZeRO-3 deviated 4.8e-3 in the loss and 8.6e-2 in the gradient norm
(~100x and ~57x the tolerance). The residual stream's dtype is asserted as well: the
compute dtype at every stage, fp32 under --fp32-residual-connection.
"""

import os

import pytest

from dist import run_ranks
from helpers import TINY, parsed, read_jsonl, train_losses

DTYPES = {"fp32": [], "bf16": ["--bf16"], "fp16": ["--fp16"],
          "bf16-fp32res": ["--bf16", "--fp32-residual-connection"]}
STREAM = {"fp32": "torch.float32", "bf16": "torch.bfloat16", "fp16": "torch.float16",
          "bf16-fp32res": "torch.float32"}
# relative, per step; measured as the module doc says
LOSS_RTOL = {"fp32": 1e-6, "bf16": 1e-4, "fp16": 2e-5, "bf16-fp32res": 5e-5}
GRAD_NORM_RTOL = {"fp32": 2e-6, "bf16": 1.5e-3, "fp16": 3e-4, "bf16-fp32res": 1.5e-3}
# Small and quick: 2 steps (the first step's loss and gradient norm check forward and
# backward, the second's the update) of micro-batches of 1 sample, mock data over a
# 512-token vocabulary; the global batch is the grid's (`batch`).
STEPS = ["--train-iters", "2", "--micro-batch-size", "1", "--eval-iters", "0",
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512"]
TP2, SP2 = ["--tensor-model-parallel-size", "2"], ["--ds-sequence-parallel-size", "2"]
PP2, CP2 = ["--pipeline-model-parallel-size", "2"], ["--context-parallel-size", "2"]
GRIDS = {4: {"pp2": PP2, "pp2-sp2": PP2 + SP2, "tp2-sp2": TP2 + SP2},
         8: {"dp2-sp2-cp2": SP2 + CP2}}
STAGES = {"bf16": (0, 1, 2, 3)}  # other dtypes: (1, 3), as the module doc says
WORLD = {grid: world for world, grids in GRIDS.items() for grid in grids}
FLAGS = {grid: flags for grids in GRIDS.values() for grid, flags in grids.items()}


def batch(grid: str) -> int:
    """The global batch that gives each dp rank of `grid` 2 micro-batches of 1 sample:
    two are summed in each stage's precision as more would be, and a step costs about
    its micro-batches' count (at 4 samples a step the dp1 grids ran 4 a rank, and
    tp2 x sp2 was the matrix's slowest grid)."""
    flags, model_parallel = FLAGS[grid], 1
    for size in (flags[i + 1] for i, flag in enumerate(flags) if flag.endswith("-size")):
        model_parallel *= int(size)
    return 2 * WORLD[grid] // model_parallel


def stages(dtype: str) -> tuple:
    return STAGES.get(dtype, (1, 3))


def base_args(tmp, dtype: str, samples: int) -> list:
    return TINY + STEPS + DTYPES[dtype] + ["--global-batch-size", str(samples),
                                            "--data-cache-path", str(tmp / "cache")]


def train_runs(rank, world, configs) -> list:
    """One Trainer per Config (helpers.parsed), one after the other in these ranks; per
    run the dtypes the transformer blocks returned (the residual stream's)."""
    from megaulysses.training.trainer import Trainer
    out = []
    for cfg in configs:
        trainer = Trainer(cfg)
        seen = set()
        for block in trainer.model.layers.values():
            block.register_forward_hook(lambda m, i, y, seen=seen: seen.add(str(y.dtype)))
        trainer.train()
        out.append(sorted(seen))
    return out


def metrics(tmp, name: str) -> list:
    return ["--metrics-jsonl", str(tmp / f"{name}.jsonl")]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """{(dtype, grid, stage; or "one" and the global batch for one process): (metrics
    records, the residual stream's dtypes on rank 0)}."""
    tmp = tmp_path_factory.mktemp("matrix")
    names, streams = {}, {}
    for dtype in DTYPES:
        for samples in sorted({batch(grid) for grid in WORLD}):
            key = dtype, "one", samples
            names[key] = f"{dtype}-one-{samples}"
            args = base_args(tmp, dtype, samples) + metrics(tmp, names[key])
            streams[key] = train_runs(0, 1, parsed([args]))[0]
    for world, grids in GRIDS.items():
        keys, runs = [], []
        for dtype in DTYPES:
            for grid, flags in grids.items():
                for stage in stages(dtype):
                    keys.append((dtype, grid, stage))
                    names[keys[-1]] = f"{dtype}-{grid}-zero{stage}"
                    runs.append(base_args(tmp, dtype, batch(grid)) + flags
                                + ["--zero-stage", str(stage)] + metrics(tmp, names[keys[-1]]))
        results = run_ranks(train_runs, world, parsed(runs), timeout=900)
        streams.update(zip(keys, results[0], strict=True))
    return {key: (read_jsonl(tmp / f"{name}.jsonl"), streams[key])
            for key, name in names.items()}


def deviations(records, ref) -> tuple[float, float]:
    """Worst relative deviation of the per-step losses and gradient norms."""
    got, want = train_losses(records), train_losses(ref)
    assert sorted(got) == sorted(want) == [1, 2]
    norm = {r["iteration"]: r["grad_norm"] for r in records if "grad_norm" in r}
    ref_norm = {r["iteration"]: r["grad_norm"] for r in ref if "grad_norm" in r}
    loss_dev = max(abs(got[i] - want[i]) / abs(want[i]) for i in want)
    norm_dev = max(abs(norm[i] - ref_norm[i]) / max(abs(ref_norm[i]), 1e-12) for i in ref_norm)
    return loss_dev, norm_dev


CASES = [(dtype, grid, stage) for dtype in DTYPES for grids in GRIDS.values()
         for grid in grids for stage in stages(dtype)]


@pytest.mark.parametrize("dtype,grid,stage", CASES,
                         ids=[f"{d}-{g}-zero{z}" for d, g, z in CASES])
def test_grid_equals_one_process_in_its_dtype(matrix, dtype, grid, stage):
    (records, stream), (ref, _) = matrix[dtype, grid, stage], matrix[dtype, "one", batch(grid)]
    # the residual stream is in the compute dtype at every stage (fp32 when asked for)
    assert stream == [STREAM[dtype]]
    loss_dev, norm_dev = deviations(records, ref)
    if os.environ.get("MEASURE"):
        print(f"\n{dtype:5s} {grid:12s} zero{stage}: loss {loss_dev:.2e} grad norm {norm_dev:.2e}")
    assert loss_dev <= LOSS_RTOL[dtype], (loss_dev, train_losses(records), train_losses(ref))
    assert norm_dev <= GRAD_NORM_RTOL[dtype], norm_dev
    skipped = [r.get("skipped_iterations") for r in records if "loss" in r]
    assert skipped == [r.get("skipped_iterations") for r in ref if "loss" in r]
