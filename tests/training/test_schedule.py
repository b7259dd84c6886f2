"""Sample-based training (--train-samples, --lr-warmup/decay-samples), the global batch's
ramp-up (--rampup-batch-size) and --decoupled-lr, against schedules computed by hand, and
in real runs: the batch each iteration takes, an exact resume from the middle of the
ramp, and a pipeline (its schedule per micro-batch count) against one process."""

import pytest
import torch

from dist import run_ranks
from helpers import TINY, read_jsonl, train_losses
from test_invalid_flags import BASE as INVALID_BASE
from test_invalid_flags import assert_one_line_naming, run_main

from megaulysses.config import parse_args, resolve
from megaulysses.config.schedule import global_batch_at
from megaulysses.training.optim import DECOUPLED, LRSchedule, lr_bounds, param_groups


def without(args, *flags):
    """`args` less each of `flags` and its value."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        else:
            out.append(a)
    return out


def resolved(*args, world=1):
    return resolve(parse_args(["--mock-data", *args]), world, 4096).train


def steps(t):
    """(iteration, consumed samples, global batch) of each step of a resolved run."""
    out, consumed = [], 0
    for it in range(t.train_iters):
        batch = global_batch_at(t, consumed)
        out.append((it, consumed, batch))
        consumed += batch
    return out


# ---- by hand, no training


def test_rampup_batches_and_iterations_as_megatron_counts_them():
    # 2 -> 8 by 2 over 12 samples: 3 increments, one per 4 samples consumed. The ramp's
    # steps are those that start at or before sample 12 (at 0, 2, 4, 8); then whole
    # batches of 8 of the 50 - 14 samples left: 4 (4 samples dropped).
    t = resolved("--train-samples", "50", "--global-batch-size", "8", "--micro-batch-size", "2",
                 "--rampup-batch-size", "2", "2", "12")
    assert [b for _, _, b in steps(t)] == [2, 2, 4, 6, 8, 8, 8, 8]
    # 4 -> 16 by 4 over 10 samples: one increment per 10/3 samples (Megatron-LM's float
    # division): at 4 consumed int(1.2) = 1 increment; past 10 the full batch. Batch 12
    # is never taken.
    t = resolved("--train-samples", "60", "--global-batch-size", "16", "--micro-batch-size",
                 "4", "--rampup-batch-size", "4", "4", "10")
    assert [b for _, _, b in steps(t)] == [4, 8, 16, 16, 16]
    # no ramp: whole global batches, the partial last one dropped
    assert resolved("--train-samples", "70", "--global-batch-size", "16").train_iters == 4


def test_rampup_with_train_iters_ramps_for_that_many_steps():
    """Megatron-LM's validate_args refuses --rampup-batch-size with --train-iters, but its
    GPT-3 175B example gives both: here the run takes --train-iters steps, ramping."""
    t = resolved("--train-iters", "6", "--global-batch-size", "8", "--micro-batch-size", "2",
                 "--rampup-batch-size", "2", "2", "12")
    assert [b for _, _, b in steps(t)] == [2, 2, 4, 6, 8, 8]
    assert (t.train_samples, t.lr_warmup_samples) == (None, 0)  # the lr counts iterations


def test_lr_per_step_in_samples_with_decoupled_groups():
    """Warmup over 10 samples, then linear decay over --train-samples 50, each step at
    the schedule's value where it starts (the samples consumed before it), as Megatron-LM's
    scheduler. The decoupled group has the same shape between its own peak and floor."""
    t = resolved("--train-samples", "50", "--global-batch-size", "8", "--micro-batch-size", "2",
                 "--rampup-batch-size", "2", "2", "12", "--lr", "1", "--min-lr", "0.1",
                 "--lr-warmup-samples", "10", "--lr-decay-style", "linear",
                 "--decoupled-lr", "2", "--decoupled-min-lr", "0.2")
    s = LRSchedule(t, [(1.0, 0.1), (2.0, 0.2)])
    got = [lr for step in steps(t) for lr in s.group_lrs(*step)]
    # consumed before each step: 0, 2, 4, 8 (warmup: 0/10, 2/10, 4/10, 8/10), then 14,
    # 22, 30, 38, 46: (consumed - 10) / 40 of the decay
    warm = [0.0, 0.2, 0.4, 0.8]
    decay = [1 - (c - 10) / 40 for c in (14, 22, 30, 38)]
    want = ([x for w in warm for x in (w, 2 * w)]
            + [x for k in decay for x in (0.1 + k * 0.9, 0.2 + k * 1.8)])
    assert got == pytest.approx(want)
    assert s.logged(0, 14, 8) == pytest.approx({"lr": 0.91, "decoupled_lr": 1.82})


def test_samples_in_whole_batches_schedule_as_iterations():
    samples = resolved("--train-samples", "80", "--global-batch-size", "8",
                       "--lr-warmup-samples", "16", "--lr-decay-samples", "64")
    iters = resolved("--train-iters", "10", "--global-batch-size", "8",
                     "--lr-warmup-iters", "2", "--lr-decay-iters", "8")
    assert samples.train_iters == iters.train_iters == 10
    a, b = LRSchedule(samples), LRSchedule(iters)
    assert [a.group_lrs(*s) for s in steps(samples)] == [b.group_lrs(*s) for s in steps(iters)]
    # a warm-up fraction counts samples too: 0.25 of 64
    assert resolved("--train-samples", "80", "--global-batch-size", "8", "--lr-decay-samples",
                    "64", "--lr-warmup-fraction", "0.25").lr_warmup_samples == 16


def test_decoupled_groups_are_the_embedding_and_output_layer():
    from megaulysses.config import ModelConfig
    from megaulysses.model.attention import math_attention
    from megaulysses.model.gpt import build_model
    m = build_model(ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2,
                                vocab_size=100, position_embedding_type="learned_absolute",
                                untie_embeddings_and_output_weights=True), math_attention, 0)
    t = resolved("--decoupled-lr", "0.5", "--decoupled-min-lr", "0.05", "--lr", "1e-3",
                 "--min-lr", "1e-4")
    groups, bounds = param_groups(m, 0.1, decoupled=True), lr_bounds(m, t)
    names = {id(p): n for n, p in m.named_parameters()}
    decoupled = {names[id(p)] for g, b in zip(groups, bounds, strict=True) if b == (0.5, 0.05)
                 for p in g["params"]}
    assert decoupled == set(DECOUPLED)  # not the position embedding (Megatron-LM's rule)
    assert all(b == (1e-3, 1e-4) for g, b in zip(groups, bounds, strict=True)
               if not {names[id(p)] for p in g["params"]} & decoupled)
    # without --decoupled-lr: the groups of before (no new group, no new key)
    assert [len(g["params"]) for g in param_groups(m, 0.1)] == [
        len(g["params"]) for g in param_groups(m, 0.1, decoupled=False)]
    assert len(param_groups(m, 0.1)) == 2


# ---- bad input: one line naming the flag, exit 2 (BASE less its --train-iters)

SAMPLES_BASE = without(INVALID_BASE, "--train-iters")
RAMP = ["--train-samples", "512", "--global-batch-size", "16", "--rampup-batch-size"]


def bad(name, args, flag, words, world=None):
    return pytest.param(args, flag, words, world, id=name)


BAD = [
    bad("decay-iters", ["--train-samples", "64", "--lr-decay-iters", "4"], "--lr-decay-iters",
        "use --lr-decay-samples"),
    bad("warmup-iters", ["--train-samples", "64", "--lr-warmup-iters", "2"],
        "--lr-warmup-iters", "use --lr-warmup-samples"),
    bad("warmup-fraction-and-samples", ["--train-samples", "64", "--lr-warmup-samples", "8",
                                        "--lr-warmup-fraction", "0.1"],
        "--lr-warmup-fraction", "cannot be combined with --lr-warmup-samples"),
    bad("warmup-past-decay", ["--train-samples", "64", "--lr-warmup-samples", "65"],
        "--lr-warmup-samples", "--train-samples = 64"),
    bad("warmup-neg", ["--train-samples", "64", "--lr-warmup-samples", "-1"],
        "--lr-warmup-samples", ">= 0"),
    bad("samples-0", ["--train-samples", "0"], "--train-samples", "must be > 0"),
    bad("less-than-a-batch", ["--train-samples", "7", "--global-batch-size", "8"],
        "--train-samples", "less than one global batch"),
    bad("ends-in-ramp", ["--train-samples", "20", "--global-batch-size", "16",
                         "--rampup-batch-size", "4", "4", "24"], "--train-samples",
        "give at least"),
    bad("ramp-samples-0", RAMP + ["4", "4", "0"], "--rampup-batch-size", "must be > 0"),
    bad("ramp-start-at-global", RAMP + ["16", "4", "64"], "--rampup-batch-size",
        "START 16 must be below --global-batch-size 16"),
    bad("ramp-increments", RAMP + ["4", "8", "64"], "--rampup-batch-size",
        "12 must be divisible by INCREMENT 8"),
    bad("ramp-start-dp", RAMP + ["2", "2", "64"], "--rampup-batch-size",
        "START 2 must be divisible by --micro-batch-size * dp = 2*2", world=2),
    bad("ramp-increment-dp", RAMP + ["4", "2", "64"], "--rampup-batch-size",
        "INCREMENT 2 must be divisible by --micro-batch-size * dp = 2*2", world=2),
    bad("ramp-1f1b-too-few", RAMP + ["2", "2", "64", "--pipeline-model-parallel-size", "2"],
        "--rampup-batch-size", "1f1b needs at least pp = 2", world=2),
    bad("ramp-interleaved-multiple", RAMP + ["4", "2", "64", "--pipeline-model-parallel-size",
                                             "2", "--num-layers-per-virtual-pipeline-stage",
                                             "1"],
        "--rampup-batch-size", "needs a multiple of pp = 2", world=2),
]


@pytest.mark.parametrize("args,flag,words,world", BAD)
def test_bad_sample_schedule(args, flag, words, world, tmp_path, capfd):
    argv = SAMPLES_BASE + args + ["--data-cache-path", str(tmp_path / "cache")]
    if world is not None:
        argv += ["--dry-run", "--dry-run-world-size", str(world)]
    assert_one_line_naming(*run_main(argv, capfd), flag, words)


# ---- real runs: 38 samples, the batch 4, 4, 6, then 8 (ramp 4 -> 8 by 2 over 12 samples)

RUN = without(TINY, "--train-iters", "--lr-warmup-iters", "--lr-warmup-init",
              "--global-batch-size") + [
    "--train-samples", "38", "--lr-warmup-samples", "10", "--lr-decay-style", "linear",
    # the embedding (and its tied output layer) frozen: a wrong group would move it
    "--decoupled-lr", "0", "--decoupled-min-lr", "0"]
RAMP_4_TO_8 = ["--global-batch-size", "8", "--rampup-batch-size", "4", "2", "12"]
BATCHES = [4, 4, 6, 8, 8, 8]
CONSUMED = [0, 4, 8, 14, 22, 30]  # before each step


def run_args(tmp_path, name, extra=(), batch=RAMP_4_TO_8):
    path = str(tmp_path / f"{name}.jsonl")
    return path, RUN + batch + list(extra) + ["--metrics-jsonl", path,
                                              "--data-cache-path", str(tmp_path / "cache")]


def train(rank, world, args):
    """Train; on rank 0, whether the word embedding (decoupled lr 0) kept its values while
    the layers moved."""
    from megaulysses.training.trainer import Trainer
    trainer = Trainer(parse_args(args))
    model = trainer.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    after = dict(model.named_parameters())
    return {n: bool(torch.equal(before[n], after[n].detach())) for n in before}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ramp")
    path, args = run_args(tmp, "full")
    unchanged = train(0, 1, args)
    return read_jsonl(path), unchanged


def test_rampup_run_batches_lr_and_frozen_decoupled_group(reference):
    records, unchanged = reference
    train_recs = [r for r in records if "loss" in r]
    assert [r["global_batch_size"] for r in train_recs] == BATCHES
    assert [r["consumed_samples"] for r in train_recs] == [c + b for c, b in
                                                           zip(CONSUMED, BATCHES, strict=True)]
    # lr 3e-3 -> 3e-4: warmup at consumed / 10 (Megatron-LM's: the value where the step
    # starts), then linear over the 28 samples after it
    want = [3e-3 * c / 10 if c <= 10 else 3e-4 + (1 - (c - 10) / 28) * 2.7e-3
            for c in CONSUMED]
    assert [r["lr"] for r in train_recs] == pytest.approx(want)
    assert all(r["decoupled_lr"] == 0 for r in train_recs)
    assert unchanged["embed.word.weight"]
    assert not any(unchanged[n] for n in unchanged if n not in DECOUPLED)


def test_rampup_first_steps_equal_a_constant_batch_run(reference, tmp_path):
    """Iterations 1 and 2 take batches of 4 (samples 0-3, 4-7) at the same learning
    rates as a run of --global-batch-size 4 throughout."""
    path, args = run_args(tmp_path, "const", ["--exit-interval", "2"],
                          batch=["--global-batch-size", "4"])
    assert run_main_ok(args)
    got, want = train_losses(read_jsonl(path)), train_losses(reference[0])
    assert sorted(got) == [1, 2]
    assert got[1] == want[1] and got[2] == want[2]


def run_main_ok(args) -> bool:
    import pretrain_gpt
    return pretrain_gpt.main(args) == 0


def test_resume_in_the_middle_of_the_ramp_is_exact(reference, tmp_path):
    """Stopped after iteration 2 (8 samples consumed, the next batch 6), resumed: the
    batches, learning rates and losses of iterations 3..6 are the uninterrupted run's."""
    ck = str(tmp_path / "ck")
    _, first = run_args(tmp_path, "first", ["--save", ck, "--exit-interval", "2"])
    assert run_main_ok(first)
    path, second = run_args(tmp_path, "second", ["--load", ck])
    assert run_main_ok(second)
    got = [r for r in read_jsonl(path) if "loss" in r]
    want = [r for r in reference[0] if "loss" in r][2:]
    for key in ("iteration", "global_batch_size", "consumed_samples", "lr", "loss"):
        assert [r[key] for r in got] == [r[key] for r in want], key
    evals = [r["eval_loss"] for r in read_jsonl(path) if "eval_loss" in r]
    assert evals == [r["eval_loss"] for r in reference[0] if "eval_loss" in r]


def test_pipeline_rampup_equals_one_process(reference, tmp_path):
    """pp2 (1f1b): 2, 2, 3, then 4 micro-batches per step (a schedule per count; the
    evaluation's full batch between them), the tied embedding's two copies both frozen."""
    path, args = run_args(tmp_path, "pp2", ["--pipeline-model-parallel-size", "2"])
    unchanged = run_ranks(train, 2, args)
    assert all(u["embed.word.weight"] for u in unchanged)  # first stage's and last's copy
    got, want = read_jsonl(path), reference[0]
    assert [r.get("global_batch_size") for r in got] == [r.get("global_batch_size")
                                                         for r in want]
    losses, ref = train_losses(got), train_losses(want)
    assert sorted(losses) == list(range(1, 7))
    for it in ref:
        assert losses[it] == pytest.approx(ref[it], rel=1e-5), it
    evals = [r["eval_loss"] for r in got if "eval_loss" in r]
    assert evals == pytest.approx([r["eval_loss"] for r in want if "eval_loss" in r],
                                  rel=1e-5)
