"""A non-finite loss or gradient norm in a bf16/fp32 run, as Megatron-LM's default
--check-for-nan-in-loss-and-grad under --rerun-mode validate_results handles it
(megaulysses/training/result_checks.py): the step is run again in place; reproduced, a
checkpoint of the last iteration is saved and every rank exits 16; not reproduced (a
transient fault) every rank exits 17 with nothing saved, and a resume from the last
checkpoint ends as a run that never met the fault. --rerun-mode disabled exits 1 at once.

NaNs are injected by MEGAULYSSES_FAULT (faults.py) into one rank's gradient after the
reduction: "nan:R:I" at step I's first pass only (the rerun does not meet it), "nan:R:I+"
in every pass from step I on. The fp16 loss scaler's own handling of an overflow is
tested in tests/training/test_trainer.py and test_faults.py.
"""

import logging
import math
import os

import pytest
import torch
from helpers import TINY, launch, read_jsonl, train_losses, wait_all

ARGS = ["--eval-iters", "0", "--train-iters", "5"]


def run_main(args, tmp_path, capfd) -> tuple[int, list[str]]:
    """pretrain_gpt.main in this process: (exit code, the stderr lines)."""
    import pretrain_gpt
    capfd.readouterr()
    rc = pretrain_gpt.main(TINY + ["--data-cache-path", str(tmp_path / "cache")] + args)
    return rc, capfd.readouterr().err.strip().splitlines()


def saved(ck) -> list[str]:
    return sorted(os.listdir(ck)) if os.path.isdir(ck) else []


def model_of(checkpoint: str, tmp_path) -> dict:
    """The model tensors of a committed checkpoint (DCP read back as one torch file)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = tmp_path / (os.path.basename(os.path.dirname(checkpoint)) + ".pt")
    dcp_to_torch_save(checkpoint, str(out))
    return {k: v for k, v in torch.load(out, weights_only=False).items()
            if k.startswith("model.")}


def test_a_transient_nan_stops_with_17_and_the_resumed_run_ends_as_a_clean_one(
        tmp_path, monkeypatch, capfd, caplog):
    """Step 3's gradient is NaN in its first pass only: the rerun's is finite, so the fault
    was transient; Megatron-LM still stops (its fatal check): exit 17, nothing saved past
    iteration 2. The same command then resumes from iteration 2 and ends bit-equal
    (weights and losses) to a run that never met the fault (CPU: deterministic)."""
    clean_ck, ck = tmp_path / "clean", tmp_path / "ck"
    rc, _ = run_main(ARGS + ["--save", str(clean_ck), "--save-interval", "5",
                             "--metrics-jsonl", str(tmp_path / "clean.jsonl")], tmp_path, capfd)
    assert rc == 0
    args = ARGS + ["--save", str(ck), "--load", str(ck), "--save-interval", "2",
                   "--metrics-jsonl", str(tmp_path / "m.jsonl")]
    monkeypatch.setenv("MEGAULYSSES_FAULT", "nan:0:3")
    with caplog.at_level(logging.WARNING, "megaulysses.training.result_checks"):
        rc, err = run_main(args, tmp_path, capfd)
    assert rc == 17 and len(err) == 1, err
    assert err[0].startswith("error: iteration 3: grad norm nan not reproduced by the rerun "), err
    assert "possible transient error (message='found NaN in grad norm'); exit 17" in err[0]
    text = caplog.text
    assert "unexpected result grad norm nan on rank 0 at iteration #3" in text
    assert "Need to rerun step to check reproducibility of initial result" in text
    assert "First rerun: unexpected result is not reproducible within the tolerance" in text
    assert "Possible transient error!" in text
    assert "Exiting now. The job can be resumed from a previous checkpoint" in text
    assert saved(ck) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    monkeypatch.delenv("MEGAULYSSES_FAULT")
    rc, _ = run_main(args, tmp_path, capfd)
    assert rc == 0
    clean = train_losses(read_jsonl(tmp_path / "clean.jsonl"))
    resumed = train_losses(read_jsonl(tmp_path / "m.jsonl"))
    assert resumed == clean  # iterations 1-2 of the first try, 3-5 of the resumed one
    # exact: the same steps on one CPU process (a tolerance would hide a skipped step)
    want = model_of(str(clean_ck / "iter_0000005"), tmp_path)
    got = model_of(str(ck / "iter_0000005"), tmp_path)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def persistent_nan_two_ranks(tmp_path):
    ck = tmp_path / "ck"
    args = TINY + ARGS + ["--save", str(ck), "--save-interval", "10",
                          "--data-cache-path", str(tmp_path / "cache")]
    procs = launch(args, 2, str(tmp_path / "run"), {"MEGAULYSSES_FAULT": "nan:1:3+"})
    return ck, wait_all(procs), [(tmp_path / f"run.rank{r}.log").read_text() for r in (0, 1)]


def test_a_persistent_nan_on_one_rank_saves_and_stops_every_rank_with_16(tmp_path, capfd):
    """2 data-parallel ranks; rank 1's gradient is NaN from step 3 on (after the
    reduction: rank 0's own norm is finite). Both ranks rerun step 3, both find it
    reproduced, log it, save iteration 2 together (the step not taken) and exit 16 with
    no traceback; the checkpoint is committed and a run resumes from it."""
    ck, codes, logs = persistent_nan_two_ranks(tmp_path)
    assert codes == [16, 16], logs[0][-3000:]
    for rank, log in enumerate(logs):
        assert "Traceback" not in log, log[-3000:]
        assert f"unexpected result grad norm nan on rank {rank} at iteration #3" in log
        assert (f"rank {rank}, iteration #3: First rerun: unexpected result is reproducible "
                "within the tolerance (nan = nan). Need to rerun on a different GPU") in log
    assert "Saving a checkpoint and exiting now. Please resume the job from the checkpoint" \
        in logs[0]
    errors = [line for line in logs[0].splitlines() if line.startswith("error:")]
    assert errors == ["error: iteration 3: grad norm nan reproduced by the rerun (message="
                      "'found NaN in grad norm'); exit 16 after saving the last iteration's "
                      "checkpoint: resume on another device to tell a fault from the model"]
    assert saved(ck) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert os.path.exists(ck / "iter_0000002" / "COMMITTED")
    # readable: one process resumes from it (no fault now) and trains step 3
    jsonl = tmp_path / "resumed.jsonl"
    rc, _ = run_main(["--eval-iters", "0", "--train-iters", "3", "--load", str(ck),
                      "--metrics-jsonl", str(jsonl)], tmp_path, capfd)
    assert rc == 0
    losses = train_losses(read_jsonl(jsonl))
    assert list(losses) == [3] and math.isfinite(losses[3])


def test_rerun_mode_disabled_exits_1_at_once(tmp_path, monkeypatch, capfd):
    """No rerun, no checkpoint, even at the job's first step (Megatron-LM raises there)."""
    monkeypatch.setenv("MEGAULYSSES_FAULT", "nan:0:1")
    ck = tmp_path / "ck"
    rc, err = run_main(ARGS + ["--rerun-mode", "disabled", "--save", str(ck)], tmp_path, capfd)
    assert rc == 1
    assert err == ["error: iteration 1: unexpected result grad norm nan (message='found NaN "
                   "in grad norm'; --rerun-mode disabled)"]
    assert saved(ck) == []


def test_the_jobs_first_step_is_not_validated_but_skipped(tmp_path, monkeypatch, capfd):
    """Megatron-LM validates nothing in a job's first step (no checkpoint could be taken
    before an optimizer step); here that step is skipped, and the run goes on."""
    monkeypatch.setenv("MEGAULYSSES_FAULT", "nan:0:1")
    jsonl = tmp_path / "m.jsonl"
    rc, _ = run_main(["--eval-iters", "0", "--train-iters", "2", "--metrics-jsonl",
                      str(jsonl)], tmp_path, capfd)
    assert rc == 0
    assert [r["skipped_iterations"] for r in read_jsonl(jsonl) if "loss" in r] == [1, 1]


@pytest.mark.parametrize("bad, message", [((math.nan, 1.0), "found NaN in forward loss "
                                           "calculation"),
                                          ((2.0, math.inf), "found Inf in grad norm")])
@pytest.mark.parametrize("rerun, code", [("same", 16), ("finite", 17)])
def test_the_review_of_a_non_finite_step(bad, message, rerun, code):
    """ResultChecks alone: the loss is looked at before the norm, the first step is not
    validated, a non-finite value asks for a rerun, the rerun's verdict stops the run."""
    from megaulysses.training.result_checks import ResultChecks, ResultRejected
    checks = ResultChecks(False, False, 0, nan="validate")
    assert checks.active
    assert not checks.review(*bad, 1)  # the job's first step
    assert not checks.review(3.0, 1.0, 2)
    assert checks.review(*bad, 3)
    with pytest.raises(ResultRejected) as e:
        checks.review(*(bad if rerun == "same" else (3.0, 1.0)), 3)
    assert (e.value.exit_code, e.value.checkpoint) == (code, code == 16)
    assert f"(message='{message}')" in str(e.value)
    # off: nothing looked at
    assert not ResultChecks(False, False, 0).active


@pytest.mark.parametrize("flags, mode", [
    ([], "validate"), (["--bf16"], "validate"), (["--rerun-mode", "disabled"], "raise"),
    (["--no-check-for-nan-in-loss-and-grad"], "off"),
    (["--fp16"], "off"),  # dynamic loss scaling: the scaler's overflows (Megatron-LM's rule)
    (["--fp16", "--loss-scale", "64"], "validate")])  # a static scale is validated there too
def test_which_runs_validate(flags, mode):
    from megaulysses.config import parse_args
    from megaulysses.training.optim import LossScaler
    from megaulysses.training.step import NoScaler
    from megaulysses.training.trainer import nan_mode
    t = parse_args(TINY + ["--mock-data"] + flags).train
    assert nan_mode(t, LossScaler(t) if t.fp16 else NoScaler()) == mode
