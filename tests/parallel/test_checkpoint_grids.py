"""A checkpoint saved on one grid loads on any other and training goes on as before.

Saved (in the background, --async-save) after 3 of test_parity's 10 steps at
tp2 x sp2 x dp2 with ZeRO-3; loaded at 1 process, at sp4 with ZeRO-1, at tp2 and at pp2.
Each continues with iterations 4..10 equal to the uninterrupted one-process run within
1e-5 relative (every grid computes the same losses as one process within that tolerance:
test_parity), evaluations included.
"""

import pytest

from dist import run_ranks
from helpers import read_jsonl, train_losses
from test_parity import LOSS_RTOL, run_args, train

TP2 = ["--tensor-model-parallel-size", "2"]
SP2 = ["--ds-sequence-parallel-size", "2"]


def train_each(rank, world, runs):
    """One Trainer per argument list of `runs`, one after the other in these ranks."""
    from megaulysses.config import parse_args
    from megaulysses.training.trainer import Trainer
    for args in runs:
        Trainer(parse_args(args)).train()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(checkpoint dir, the one-process run's records) with the checkpoint at iteration 3."""
    tmp = tmp_path_factory.mktemp("saved")
    ref_path, ref_args = run_args(tmp, "reference", [])
    train(0, 1, ref_args)
    ck = str(tmp / "ck")
    path, args = run_args(tmp, "tp2-sp2-dp2", [], TP2 + SP2 + [
        "--zero-stage", "3", "--save", ck, "--exit-interval", "3", "--async-save"])
    run_ranks(train_each, 8, [args])
    got, want = train_losses(read_jsonl(path)), train_losses(read_jsonl(ref_path))
    assert sorted(got) == [1, 2, 3]  # and the saving run itself equals one process
    assert all(got[it] == pytest.approx(want[it], rel=LOSS_RTOL) for it in got), (got, want)
    return ck, read_jsonl(ref_path)


def assert_continues(path, ref_records):
    got, want = train_losses(read_jsonl(path)), train_losses(ref_records)
    assert sorted(got) == list(range(4, 11))  # iteration numbers continue
    for it in got:
        assert got[it] == pytest.approx(want[it], rel=LOSS_RTOL), (path, it)
    evals = {r["iteration"]: r["eval_loss"] for r in read_jsonl(path) if "eval_loss" in r}
    ref_evals = {r["iteration"]: r["eval_loss"] for r in ref_records if "eval_loss" in r}
    assert evals == pytest.approx({k: v for k, v in ref_evals.items() if k > 3}, rel=LOSS_RTOL)


def test_loads_on_one_process(saved, tmp_path):
    ck, ref = saved
    path, args = run_args(tmp_path, "one", [], ["--load", ck])
    train(0, 1, args)
    assert_continues(path, ref)


def test_loads_at_sp4_with_zero1(saved, tmp_path):
    ck, ref = saved
    path, args = run_args(tmp_path, "sp4", [], ["--ds-sequence-parallel-size", "4",
                                                "--zero-stage", "1", "--load", ck])
    run_ranks(train_each, 4, [args])
    assert_continues(path, ref)


def test_loads_at_tp2_and_at_pp2(saved, tmp_path):
    ck, ref = saved
    tp_path, tp_args = run_args(tmp_path, "tp2", [], TP2 + ["--load", ck])
    pp_path, pp_args = run_args(tmp_path, "pp2", [], ["--pipeline-model-parallel-size", "2",
                                                       "--load", ck])
    run_ranks(train_each, 2, [tp_args, pp_args])
    assert_continues(tp_path, ref)
    assert_continues(pp_path, ref)
