"""Preemption, with real processes and real signals.

SIGTERM reaches one rank of two (as a scheduler's signal may arrive unevenly): both finish
the step, save the same checkpoint and exit 0; the same command then resumes and the whole
loss sequence equals an uninterrupted run's bit for bit. A save killed with SIGKILL halfway
through its write leaves the previous checkpoint loadable.
"""

import glob
import json
import os
import signal
import subprocess
import sys
import time

from dist import free_port
from helpers import REPO, TINY, read_jsonl, train_losses

ITERS = ["--train-iters", "16"]


def launch(args, world: int, log_prefix: str) -> list[subprocess.Popen]:
    """One process per rank, each told its rank in the environment, as srun starts them."""
    port, procs = free_port(), []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   OMP_NUM_THREADS="1")
        env.pop("SLURM_JOB_ID", None)
        log = open(f"{log_prefix}.rank{rank}.log", "w")
        procs.append(subprocess.Popen([sys.executable, os.path.join(REPO, "pretrain_gpt.py"),
                                       *args], cwd=REPO, env=env, stdout=log,
                                      stderr=subprocess.STDOUT))
    return procs


def wait_all(procs, timeout=300) -> list[int]:
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def logged_iteration(path) -> int:
    """The newest iteration in a --metrics-jsonl that is being written (0 if none yet)."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return 0
    done = [json.loads(line)["iteration"] for line in lines[:-1] if line]  # last may be cut
    return max(done, default=0)


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


def test_torchrun_forwards_sigusr1_and_the_workers_save(tmp_path):
    """As examples/slurm/pretrain_gpt.sbatch runs it: SLURM's SIGUSR1 (--signal=USR1@300)
    reaches torchrun, which forwards it (--signals-to-handle); the workers save and exit
    0. torchrun itself then reports the signal and exits non-zero: that is its way."""
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()),
           "--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "pretrain_gpt.py",
           *TINY, "--train-iters", "1000", "--eval-iters", "0", "--save", str(ck),
           "--exit-signal-handler", "--metrics-jsonl", str(metrics),
           "--data-cache-path", str(tmp_path / "cache")]
    with open(tmp_path / "out.log", "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
        deadline = time.monotonic() + 240
        while logged_iteration(metrics) < 2 and time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "out.log").read_text()[-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGUSR1)
        wait_all([proc])
    log = (tmp_path / "out.log").read_text()
    stopped = int((ck / "latest_checkpointed_iteration.txt").read_text())
    assert 2 <= stopped < 1000 and (ck / f"iter_{stopped:07d}" / "COMMITTED").exists()
    assert log.count("SIGUSR1 received") == 2  # both workers
    assert f"saved checkpoint {ck}/iter_{stopped:07d}" in log
