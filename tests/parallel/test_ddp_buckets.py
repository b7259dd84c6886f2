"""--ddp-bucket-size / --ddp-num-buckets (Megatron-LM's, counted in parameters) size the
gradient buckets of ZeRO-0/1's reducer and of the distributed optimizer.

On 2 gloo ranks, 2 steps: each bucketing trains *exactly* as the default one bucket
(tolerance 0: a bucket changes which elements travel together, never any sum), and makes
the buckets asked for: one per parameter with --ddp-bucket-size 1; with --ddp-num-buckets
N, buckets of parameters // N, each closed once it reaches that (Megatron-LM's rule), so
at most N + 1 and fewer where one parameter is larger than that (the embedding and output
layer here are a quarter of the model each): more than one.
"""

import pytest

from dist import run_ranks
from helpers import TINY, read_jsonl

STEPS = ["--train-iters", "2", "--micro-batch-size", "1", "--global-batch-size", "4",
         "--eval-iters", "0", "--mock-data", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "512"]
OPTIMIZERS = {"zero0": [], "zero1": ["--zero-stage", "1"],
              "dist-opt": ["--bf16", "--use-distributed-optimizer"]}
BUCKETS = {"default": [], "size-1": ["--ddp-bucket-size", "1"],
           "num-4": ["--ddp-num-buckets", "4"]}


def train_all(rank, world, runs) -> list:
    from megaulysses.config import parse_args
    from megaulysses.training.trainer import Trainer
    out = []
    for args in runs:
        trainer = Trainer(parse_args(args))
        z = trainer.zero
        buckets = z.own.buckets if z.own is not None else z.reducer.buckets
        out.append((len(buckets), sum(1 for _ in trainer.model.parameters())))
        trainer.train()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp_buckets")
    base = TINY + STEPS + ["--data-cache-path", str(tmp / "cache")]
    names = [(o, b) for o in OPTIMIZERS for b in BUCKETS]
    jobs = [base + OPTIMIZERS[o] + BUCKETS[b] + ["--metrics-jsonl", str(tmp / f"{o}-{b}.jsonl")]
            for o, b in names]
    counts = dict(zip(names, run_ranks(train_all, 2, jobs)[0], strict=True))
    steps = {(o, b): [(r["loss"], r["grad_norm"]) for r in read_jsonl(tmp / f"{o}-{b}.jsonl")
                      if "grad_norm" in r] for o, b in names}
    return steps, counts


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_buckets_change_no_number_and_are_as_many_as_asked(runs, optimizer):
    steps, counts = runs
    default = steps[(optimizer, "default")]
    assert len(default) == 2 and counts[(optimizer, "default")][0] == 1
    for bucketing in ("size-1", "num-4"):
        assert steps[(optimizer, bucketing)] == default
    buckets, params = counts[(optimizer, "size-1")]
    assert buckets == params
    assert 1 < counts[(optimizer, "num-4")][0] <= 5
