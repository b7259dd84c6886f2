"""Checkpoints on one process: background saves, --keep-last, commit markers, metrics that
continue across a resume, --exit-duration-in-mins, what a checkpoint records."""

import json
import logging
import os

import pytest

from helpers import read_jsonl, run_inprocess, train_losses

NO_EVAL = ["--eval-iters", "0"]


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """The uninterrupted 6-iteration run every resume is compared with (bit for bit)."""
    return train_losses(run_inprocess(NO_EVAL, tmp_path_factory.mktemp("full"), "full"))


def test_async_save_keep_last_and_bit_exact_resume(full, tmp_path):
    ck = tmp_path / "ck"
    save = NO_EVAL + ["--save", str(ck), "--save-interval", "2", "--keep-last", "2",
                      "--async-save"]
    first = train_losses(run_inprocess(save, tmp_path, "first"))
    assert first == full  # saving in the background changes nothing in training
    assert sorted(os.listdir(ck)) == ["iter_0000004", "iter_0000006",
                                      "latest_checkpointed_iteration.txt"]
    assert (ck / "latest_checkpointed_iteration.txt").read_text() == "6"
    for it in (4, 6):
        d = ck / f"iter_{it:07d}"
        assert (d / "COMMITTED").read_text().strip() == str(it)
        meta = json.loads((d / "trainer_state.json").read_text())
        assert meta["iteration"] == it and meta["consumed_train_samples"] == 4 * it
        assert meta["contents"] == ["model", "optim", "rng"]
        assert meta["model"]["num_layers"] == 2 and meta["tokenizer"]["sha256"]
        assert meta["lr_schedule"]["lr"] == 3e-3 and meta["grid"]["dp"] == 1
        assert (d / "tokenizer.model").stat().st_size > 0  # the checkpoint is self-contained
    # Resume from iteration 4 of the background-saved checkpoints: 5 and 6 bit for bit.
    resumed = train_losses(run_inprocess(NO_EVAL + ["--load", str(ck / "iter_0000004")],
                                         tmp_path, "resumed"))
    assert resumed == {5: full[5], 6: full[6]}


def test_uncommitted_checkpoint_is_skipped_and_metrics_continue(full, tmp_path, caplog):
    """iter_6 lost its commit marker (a save cut short on a file system without atomic
    rename): --load warns, uses iter_3, and the resumed run rewrites iterations 4..6 of
    the same --metrics-jsonl, so the file holds each iteration once."""
    ck = tmp_path / "ck"
    args = NO_EVAL + ["--save", str(ck), "--save-interval", "3"]
    run_inprocess(args, tmp_path, "run")
    os.remove(ck / "iter_0000006" / "COMMITTED")
    with caplog.at_level(logging.WARNING):
        records = run_inprocess(args + ["--load", str(ck)], tmp_path, "run")
    assert any("iter_0000006 has no COMMITTED marker" in r.getMessage() for r in caplog.records)
    losses = [(r["iteration"], r["loss"]) for r in records if "loss" in r]
    assert losses == sorted(full.items())  # 1..3 from the first run, 4..6 resumed: exact
    assert (ck / "latest_checkpointed_iteration.txt").read_text() == "6"
    assert (ck / "iter_0000006" / "COMMITTED").exists()  # saved again, whole


def test_exit_duration_saves_and_stops(tmp_path):
    ck = tmp_path / "ck"
    import pretrain_gpt
    from helpers import TINY
    rc = pretrain_gpt.main(TINY + ["--exit-duration-in-mins", "1e-6", "--save", str(ck),
                                   "--data-cache-path", str(tmp_path / "cache"),
                                   "--metrics-jsonl", str(tmp_path / "m.jsonl")])
    assert rc == 0
    assert (ck / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert (ck / "iter_0000001" / "COMMITTED").exists()
    records = read_jsonl(tmp_path / "m.jsonl")
    assert [r["iteration"] for r in records if "loss" in r] == [1]
    assert not any("test_loss" in r for r in records)  # stopping: no test evaluation


def test_no_load_optim_starts_a_fresh_optimizer(full, tmp_path):
    """--no-load-optim keeps the model and iteration, not the Adam moments: iteration 4
    then differs from the uninterrupted run (bias correction restarts)."""
    ck = tmp_path / "ck"
    run_inprocess(NO_EVAL + ["--save", str(ck), "--exit-interval", "3"], tmp_path, "first")
    fresh = train_losses(run_inprocess(NO_EVAL + ["--load", str(ck), "--no-load-optim"],
                                       tmp_path, "fresh"))
    assert sorted(fresh) == [4, 5, 6]
    assert fresh[4] == pytest.approx(full[4], rel=1e-6)  # same weights before step 4
    assert fresh[5] != full[5]  # a different step 4


def test_a_different_tokenizer_of_the_same_size_is_refused():
    """Same vocabulary size, other pieces: the embedding rows would mean other tokens."""
    from megaulysses.config import CheckpointError, ModelConfig
    from megaulysses.training.checkpoint import check_meta
    shape = ModelConfig(vocab_size=1000).shape_dict()
    saved = {"model": shape, "tokenizer": {"sha256": "a" * 64}}
    check_meta("ck", saved, {"model": shape, "tokenizer": {"sha256": "a" * 64}})
    with pytest.raises(CheckpointError, match="another tokenizer than --tokenizer-model t"):
        check_meta("ck", saved, {"model": shape, "tokenizer": {
            "sha256": "b" * 64, "flag": "--tokenizer-model t"}})


def test_signal_handler_is_on_by_default_under_slurm(monkeypatch):
    from helpers import TINY
    from megaulysses.config import parse_args, resolve

    def resolved(flags):
        return resolve(parse_args(flags), 1, 4096)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert not resolved(TINY).train.exit_signal_handler
    assert resolved(TINY + ["--exit-signal-handler"]).train.exit_signal_handler
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    assert resolved(TINY).train.exit_signal_handler
    assert not resolved(TINY + ["--no-exit-signal-handler"]).train.exit_signal_handler
