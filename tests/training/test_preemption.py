"""Preemption, with real processes and real signals.

SIGTERM reaches one rank of two (as a scheduler's signal may arrive unevenly): both finish
the step, save the same checkpoint and exit 0; the same command then resumes and the whole
loss sequence equals an uninterrupted run's bit for bit. A save killed with SIGKILL halfway
through its write leaves the previous checkpoint loadable.
"""

import glob
import os
import signal
import subprocess
import sys
import time

from dist import free_port
from helpers import REPO, TINY, launch, logged_iteration, read_jsonl, train_losses, wait_all

ITERS = ["--train-iters", "16"]


def test_sigterm_to_one_rank_saves_exits_0_and_resumes_exactly(tmp_path):
    base = TINY + ITERS + ["--data-cache-path", str(tmp_path / "cache")]
    ref = base + ["--metrics-jsonl", str(tmp_path / "ref.jsonl")]
    assert wait_all(launch(ref, 2, str(tmp_path / "ref"))) == [0, 0]
    ck, metrics = tmp_path / "ck", tmp_path / "run.jsonl"
    run = base + ["--save", str(ck), "--load", str(ck), "--exit-signal-handler",
                  "--metrics-jsonl", str(metrics)]
    procs = launch(run, 2, str(tmp_path / "first"))
    deadline = time.monotonic() + 240
    while logged_iteration(metrics) < 2 and time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), "finished before the signal"
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGTERM)  # rank 1 only: rank 0 learns it from rank 1
    assert wait_all(procs) == [0, 0]
    stopped = int((ck / "latest_checkpointed_iteration.txt").read_text())
    assert 2 <= stopped < 16
    assert f"stopping after iteration {stopped}" in (tmp_path / "first.rank0.log").read_text()
    assert "SIGTERM received" in (tmp_path / "first.rank1.log").read_text()
    # The same command again (a requeued job): resumes from the checkpoint to the end.
    assert wait_all(launch(run, 2, str(tmp_path / "second"))) == [0, 0]
    got, want = train_losses(read_jsonl(metrics)), train_losses(read_jsonl(tmp_path / "ref.jsonl"))
    assert [r["iteration"] for r in read_jsonl(metrics) if "loss" in r] == list(range(1, 17))
    assert got == want  # bit for bit, every iteration


# A model whose optimizer state takes a few tens of ms to write: a window to kill it in.
BIGGER = TINY + ["--hidden-size", "256", "--num-layers", "4", "--ffn-hidden-size", "1024",
                 "--eval-iters", "0", "--train-iters", "40", "--save-interval", "1"]


def kill_during_a_save(ck, args) -> bool:
    """Run until a save is being written after at least one committed one, SIGKILL the
    process there; True if it died with the write unfinished."""
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *args],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    marker = os.path.join(ck, "latest_checkpointed_iteration.txt")
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if os.path.exists(marker) and glob.glob(os.path.join(ck, ".tmp_iter_*", "*")):
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.001)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    return bool(glob.glob(os.path.join(ck, ".tmp_iter_*")))


def test_a_save_killed_halfway_leaves_the_previous_checkpoint_loadable(tmp_path):
    ck = str(tmp_path / "ck")
    args = BIGGER + ["--save", ck, "--load", ck, "--data-cache-path", str(tmp_path / "cache")]
    for _ in range(5):  # the kill may land just after a commit: try again from there
        if kill_during_a_save(ck, args):
            break
    else:
        raise AssertionError("never caught a save in progress")
    last = int(open(os.path.join(ck, "latest_checkpointed_iteration.txt")).read())
    metrics = str(tmp_path / "after.jsonl")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *args,
                           "--train-iters", str(last + 1), "--metrics-jsonl", metrics],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"loaded checkpoint {ck}/iter_{last:07d}" in proc.stdout
    assert [r["iteration"] for r in read_jsonl(metrics) if "loss" in r] == [last + 1]
    assert not glob.glob(os.path.join(ck, ".tmp_iter_*"))  # the debris is cleared


def run_node(args, tmp_path, log_name: str) -> subprocess.Popen:
    """examples/slurm/run_node.sh as srun starts it on one node of 2 workers, in a process
    group of its own (SLURM signals the whole step)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", NNODES="1", GPUS_PER_NODE="2",
               HEAD_NODE="127.0.0.1", RDZV_PORT=str(free_port()), SLURM_JOB_ID="4242",
               PYTHON=sys.executable)
    out = open(tmp_path / log_name, "w")
    return subprocess.Popen(["bash", "examples/slurm/run_node.sh", *args], cwd=REPO,
                            stdout=out, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def test_slurm_step_after_sigusr1_is_a_success_when_every_worker_saved(tmp_path):
    """As examples/slurm/pretrain_gpt.sbatch runs it: SLURM's SIGUSR1 (--signal=USR1@300)
    reaches the step's processes; torchrun forwards it (--signals-to-handle), the workers
    save and exit 0. torchrun then exits non-zero (its way after a signal); run_node.sh
    sees every worker's saved-marker and exits 0, so SLURM records a success."""
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    args = [*TINY, "--train-iters", "1000", "--eval-iters", "0", "--save", str(ck),
            "--exit-signal-handler", "--metrics-jsonl", str(metrics),
            "--data-cache-path", str(tmp_path / "cache")]
    proc = run_node(args, tmp_path, "out.log")
    deadline = time.monotonic() + 240
    while logged_iteration(metrics) < 2 and time.monotonic() < deadline:
        assert proc.poll() is None, (tmp_path / "out.log").read_text()[-3000:]
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGUSR1)
    rc = wait_all([proc])[0]
    log = (tmp_path / "out.log").read_text()
    assert rc == 0, log[-3000:]
    stopped = int((ck / "latest_checkpointed_iteration.txt").read_text())
    assert 2 <= stopped < 1000 and (ck / f"iter_{stopped:07d}" / "COMMITTED").exists()
    assert log.count("SIGUSR1 received") == 2  # both workers
    assert f"saved checkpoint {ck}/iter_{stopped:07d}" in log
    assert "but all 2 workers" in log and "saved and exited cleanly: success" in log


def test_slurm_step_that_fails_is_still_a_failure(tmp_path):
    """No stop, no markers: a worker's failure (here a bad flag, exit 2) stays a failure."""
    proc = run_node([*TINY, "--zero-stage", "9"], tmp_path, "out.log")
    assert wait_all([proc])[0] != 0
    assert "success" not in (tmp_path / "out.log").read_text()
