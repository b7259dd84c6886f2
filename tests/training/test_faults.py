"""Faults on 4 real gloo ranks: a rank killed (kill -9) or frozen mid-step, and a NaN in
one rank's gradient. Faults are injected by MEGAULYSSES_FAULT (megaulysses/training/
faults.py) after the backward, before the gradient norm's collectives: the other ranks
are then waiting in a collective.

Promises checked, with --distributed-timeout-minutes 0.1 (T = 6 s):
- every other rank exits non-zero within T + 7 s (the roll call's 5 s, rank 0's 2 s)
  plus a 15 s margin for a loaded 2-core machine, measured from the fault;
- each prints one `error:` line naming the lost rank, and no traceback;
- the last committed checkpoint is intact and the same command resumes from it;
- a NaN that only one rank sees stops every rank alike (Megatron-LM's result validation:
  a transient one, not met again by the step's rerun, exits 17 with nothing saved;
  tests/training/test_nonfinite_steps.py has the rest).
"""

import os
import time

import pytest
from helpers import TINY, launch, read_jsonl, train_losses, wait_all

T_MIN = 0.1
MARGIN_S = 60 * T_MIN + 7 + 15
WORLD = 4
GRID = ["--ds-sequence-parallel-size", "2", "--distributed-timeout-minutes", str(T_MIN)]


def args_for(tmp_path, iters=8):
    ck = str(tmp_path / "ck")
    return TINY + GRID + ["--train-iters", str(iters), "--eval-iters", "0", "--save", ck,
                          "--load", ck, "--save-interval", "2", "--data-cache-path",
                          str(tmp_path / "cache"), "--metrics-jsonl", str(tmp_path / "m.jsonl")]


def watch(procs, fault_started, timeout=240) -> tuple[float, dict]:
    """Poll until every process ends: (when the fault began, {rank: (rc, exit time)})."""
    start, began, ends = time.monotonic(), None, {}
    while len(ends) < len(procs) and time.monotonic() - start < timeout:
        now = time.monotonic()
        if began is None and fault_started():
            began = now
        for rank, p in enumerate(procs):
            if rank not in ends and p.poll() is not None:
                ends[rank] = (p.returncode, now)
        time.sleep(0.05)
    wait_all(procs, timeout=1)  # kills what is left, so a hang fails below, not forever
    return began, ends


def error_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("error:")]


def check_survivors(tmp_path, ends, began, lost: int):
    assert began is not None, "the fault was never injected"
    for rank in range(WORLD):
        log = (tmp_path / f"run.rank{rank}.log").read_text()
        assert "Traceback" not in log, log[-2000:]
        if rank == lost:
            continue
        rc, t = ends[rank]
        assert rc == 1, (rank, rc, log[-2000:])
        assert t - began < MARGIN_S, (rank, t - began)
        lines = error_lines(log)
        assert len(lines) == 1, lines
        assert f"rank {lost} did not answer" in lines[0], lines[0]
        assert "--distributed-timeout-minutes 0.1" in lines[0]


def committed(tmp_path) -> int:
    return int((tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text())


def test_a_killed_rank_stops_every_rank_and_the_same_command_resumes(tmp_path):
    args = args_for(tmp_path)
    procs = launch(args, WORLD, str(tmp_path / "run"), {"MEGAULYSSES_FAULT": "kill:2:5"})
    began, ends = watch(procs, lambda: procs[2].poll() is not None)
    assert ends[2][0] == -9  # killed, as kill -9
    check_survivors(tmp_path, ends, began, lost=2)
    assert committed(tmp_path) == 4 and not os.path.exists(tmp_path / "ck" / "iter_0000005")
    # The same command again (a requeued job): it resumes from iteration 4 to the end.
    assert wait_all(launch(args, WORLD, str(tmp_path / "again"))) == [0] * WORLD
    assert "iteration 4" in (tmp_path / "again.rank0.log").read_text()
    logged = [r["iteration"] for r in read_jsonl(tmp_path / "m.jsonl") if "loss" in r]
    assert logged == list(range(1, 9)) and committed(tmp_path) == 8


def test_a_frozen_rank_stops_every_other_rank_within_the_timeout(tmp_path):
    # Rank 3 sleeps 20 s in iteration 3: longer than T, short enough for a test.
    procs = launch(args_for(tmp_path), WORLD, str(tmp_path / "run"),
                   {"MEGAULYSSES_FAULT": "hang:3:3:20"})
    log3 = tmp_path / "run.rank3.log"
    began, ends = watch(procs, lambda: "injecting hang" in log3.read_text())
    check_survivors(tmp_path, ends, began, lost=3)
    assert ends[3][0] not in (0, None)  # it wakes to find the others gone, and exits too
    assert len(error_lines(log3.read_text())) == 1
    assert committed(tmp_path) == 2


def test_a_nan_on_one_rank_stops_every_rank(tmp_path):
    """The NaN goes into rank 1's gradient after the reduction, in step 3's first pass
    only: only rank 1 sees it, and every rank (rank 0 is the other data-parallel replica)
    must rerun the step and stop alike, or the replicas part or hang: exit 17 on every
    rank, no traceback, the checkpoint of iteration 2 the last."""
    args = args_for(tmp_path)
    procs = launch(args, WORLD, str(tmp_path / "run"), {"MEGAULYSSES_FAULT": "nan:1:3"})
    assert wait_all(procs) == [17] * WORLD
    for rank in range(WORLD):
        log = (tmp_path / f"run.rank{rank}.log").read_text()
        assert "Traceback" not in log, log[-2000:]
        assert f"rank {rank}, iteration #3: Possible transient error!" in log
    grid = read_jsonl(tmp_path / "m.jsonl")
    assert [r["iteration"] for r in grid if "loss" in r] == [1, 2]
    assert committed(tmp_path) == 2


def run_main(args, tmp_path, capfd) -> tuple[int, list[str]]:
    """pretrain_gpt.main in this process: (exit code, the stderr lines)."""
    import pretrain_gpt
    capfd.readouterr()
    rc = pretrain_gpt.main(TINY + ["--eval-iters", "0", "--data-cache-path",
                                   str(tmp_path / "cache")] + args)
    return rc, capfd.readouterr().err.strip().splitlines()


def test_consecutive_nan_steps_stop_the_run_and_save_nothing_more(tmp_path, monkeypatch,
                                                                  capfd):
    """fp16 with dynamic loss scaling (the loss scaler's overflows, no result validation,
    as Megatron-LM) at its minimum scale: each overflow skips a step and counts."""
    monkeypatch.setenv("MEGAULYSSES_FAULT", "nan:0:3+")  # every step from 3 on
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    rc, err = run_main(["--fp16", "--initial-loss-scale", "1", "--min-loss-scale", "1",
                        "--train-iters", "10", "--save", str(ck), "--save-interval", "2",
                        "--max-consecutive-skipped", "3", "--metrics-jsonl", str(metrics)],
                       tmp_path, capfd)
    assert rc == 1 and len(err) == 1, err
    assert err[0] == (f"error: iteration 5: 3 steps in a row skipped for a non-finite loss or "
                      f"gradient norm (--max-consecutive-skipped 3); stopped without saving "
                      f"(the checkpoints in {ck} are as they were)")
    assert sorted(os.listdir(ck)) == ["iter_0000002", "iter_0000004",
                                      "latest_checkpointed_iteration.txt"]
    records = [r for r in read_jsonl(metrics) if "loss" in r]
    assert [r["skipped_iterations"] for r in records] == [0, 0, 1, 2, 3]


def test_without_the_nan_check_a_nan_step_is_taken(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("MEGAULYSSES_FAULT", "nan:0:3")
    metrics = tmp_path / "m.jsonl"
    rc, _ = run_main(["--train-iters", "5", "--no-check-for-nan-in-loss-and-grad",
                      "--metrics-jsonl", str(metrics)], tmp_path, capfd)
    assert rc == 0
    losses = train_losses(read_jsonl(metrics))
    assert all(losses[i] == losses[i] for i in (1, 2, 3))  # finite up to the NaN step
    assert losses[4] != losses[4] and losses[5] != losses[5]  # NaN weights from then on


@pytest.mark.parametrize("value", ["crash:0:1", "kill:x:1", "kill:0", "nan:0:1:2:3"])
def test_a_malformed_fault_variable_is_one_line(tmp_path, monkeypatch, capfd, value):
    monkeypatch.setenv("MEGAULYSSES_FAULT", value)
    rc, err = run_main(["--train-iters", "2"], tmp_path, capfd)
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: MEGAULYSSES_FAULT: "), err
