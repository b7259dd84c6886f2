"""--overlap-param-gather waits for every weight before its first use, wherever it is read.

The distributed optimizer (parallel/dist_opt.py) leaves each bucket's all-gather of the
updated 16-bit weights in flight after the step; the next forward must finish a bucket's
gather before it reads any weight of it. The head's loss reads `output.weight` (or the
tied `embed.word.weight`) without calling that module, so a wait in module pre-hooks
alone missed it whenever that weight sat in a bucket no earlier forward had finished:
step 2 then trained on step 1's output layer.

Each case below trains 3 steps on 2 gloo ranks (dp 2, --bf16, --use-distributed-optimizer)
with and without --overlap-param-gather; the losses and gradient norms must be *equal*
(tolerance 0): the overlap changes only when the same bytes are copied into the weights,
never which bytes or the order of any sum. Each case makes more than one bucket
(--ddp-bucket-size / --ddp-num-buckets), the only way a weight can be read before its
bucket's gather is finished.
"""

import pytest

from dist import run_ranks
from helpers import TINY, read_jsonl

STEPS = ["--train-iters", "3", "--micro-batch-size", "1", "--global-batch-size", "4",
         "--eval-iters", "0", "--mock-data", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "512", "--bf16", "--use-distributed-optimizer"]
UNTIED = ["--untie-embeddings-and-output-weights"]
# Buckets fill in reverse order of the optimizer's groups: the five norms' 64-element
# weights first (the no-decay group is last), then the output layer (640 x 64 = 40960
# parameters, the vocabulary padded to 640), then the blocks' weights, the embedding last.
CASES = {
    # the five norms (320 parameters) in the first bucket, the output layer alone in the
    # second: the head reads it only in the loss, never through the module's forward
    "untied-output": UNTIED + ["--ddp-bucket-size", "320"],
    # --decoupled-lr puts the embedding and output layer in groups of their own, last:
    # the output layer alone in the first bucket, as with a real vocabulary and the
    # default bucket
    "decoupled-lr": UNTIED + ["--decoupled-lr", "1e-3", "--ddp-bucket-size", "40960"],
    # every parameter alone in a bucket
    "tiny-buckets": UNTIED + ["--ddp-bucket-size", "1"],
    # the tied word embedding, read by the head through the embedding module's attribute
    "tied-embedding": ["--ddp-num-buckets", "8"],
}


def train_all(rank, world, runs) -> list:
    from megaulysses.config import parse_args
    from megaulysses.training.trainer import Trainer
    buckets = []
    for args in runs:
        trainer = Trainer(parse_args(args))
        buckets.append(len(trainer.optimizer.buckets))
        trainer.train()
    return buckets


def steps(path) -> list:
    return [(r["loss"], r["grad_norm"]) for r in read_jsonl(path) if "grad_norm" in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("overlap_gather")
    base = TINY + STEPS + ["--data-cache-path", str(tmp / "cache")]
    jobs = [base + flags + overlap + ["--metrics-jsonl", str(tmp / f"{name}-{tag}.jsonl")]
            for name, flags in CASES.items()
            for tag, overlap in (("plain", []), ("overlap", ["--overlap-param-gather"]))]
    buckets = run_ranks(train_all, 2, jobs)[0]
    names = [f"{n}-{t}" for n in CASES for t in ("plain", "overlap")]
    return tmp, dict(zip(names, buckets, strict=True))


@pytest.mark.parametrize("name", list(CASES))
def test_overlapped_gather_trains_the_same_weights(runs, name):
    tmp, buckets = runs
    assert buckets[f"{name}-overlap"] > 1  # else every gather ends at the first forward
    plain, overlap = steps(tmp / f"{name}-plain.jsonl"), steps(tmp / f"{name}-overlap.jsonl")
    assert len(plain) == 3
    assert overlap == plain  # exact: the same weights, copied at another moment
