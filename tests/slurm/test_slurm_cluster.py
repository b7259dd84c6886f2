"""examples/slurm/pretrain_gpt.sbatch as users submit it, under a real SLURM (issue 41):
slurmctld and two slurmd ("node1", "node2") on this machine, started by
examples/slurm/local_cluster.sh (skipped where none answers: conftest.py).

Each job is `GPUS_PER_NODE=2 sbatch --nodes 2 --gpus-per-node 0 pretrain_gpt.sbatch FLAGS`:
the nodes have no GPUs, so the command line overrides the script's --gpus-per-node=8
(SLURM refuses the job otherwise: "Invalid generic resource (gres) specification"), and
GPUS_PER_NODE=2 makes torchrun start 2 CPU ranks a node: world 4 = dp 2 x sp 2, gloo,
the rendezvous on node1 (the allocation's first node). The job's final state is read
from `scontrol show job` and from `sacct -c` (the job-completion log: the cluster has
no accounting database).

Scenarios: a run completes with one process's losses; scancel --signal=USR1 stops it
cleanly (saved, COMPLETED); scontrol requeue restarts it in the same output file and it
resumes to the uninterrupted run's losses; a node killed mid-run ends the job with
the line naming the lost ranks, the checkpoint intact, and a resubmission resumes; a
grid that does not divide the ranks fails before any step with the line naming the
flag; the paper's and Megatron-LM's example scripts dry-run inside sbatch jobs.
"""

import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
from dist import free_port
from helpers import REPO, TINY, logged_iteration, read_jsonl, train_losses

CLUSTER = os.path.join(REPO, "examples", "slurm", "local_cluster.sh")

# 20 iterations: the signal and kill tests act at iteration 2 and land within a few more
# (the stops came after iteration 3 to 5 in the runs measured), which leaves the resumed
# runs steps to take
ITERS = 20
BASE = TINY + ["--train-iters", str(ITERS), "--eval-iters", "0"]
SP2 = ["--ds-sequence-parallel-size", "2"]
DONE = {"COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL", "TIMEOUT", "OUT_OF_MEMORY",
        "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
JOB_TIMEOUT_S = 300


def submit(env: dict, out, args: list, opts=(), extra_env=None) -> str:
    """pretrain_gpt.sbatch on 2 nodes x 2 ranks with `args`; returns the job id."""
    job_env = dict(env, GPUS_PER_NODE="2", OMP_NUM_THREADS="1", PYTHON=sys.executable,
                   RDZV_PORT=str(free_port()), **(extra_env or {}))
    cmd = ["sbatch", "--parsable", "--nodes", "2", "--gpus-per-node", "0",
           "--output", str(out), *opts, "examples/slurm/pretrain_gpt.sbatch", *args]
    proc = subprocess.run(cmd, cwd=REPO, env=job_env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def job_fields(env: dict, job: str) -> dict:
    """`scontrol show job` as a dict (JobState, ExitCode, Restarts, ...)."""
    text = subprocess.run(["scontrol", "show", "job", "-o", job], env=env,
                          capture_output=True, text=True, timeout=30).stdout
    return dict(f.split("=", 1) for f in text.split() if "=" in f)


def wait_job(env: dict, job: str, timeout=JOB_TIMEOUT_S, restarts=0, states=DONE) -> dict:
    """Poll until the job is in one of `states`, over by default (after `restarts`
    requeues); a job still running at the timeout is cancelled and fails the test rather
    than hang CI."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fields = job_fields(env, job)
        if fields.get("JobState") in states and int(fields.get("Restarts", 0)) >= restarts:
            return fields
        time.sleep(0.3)
    subprocess.run(["scancel", job], env=env, timeout=30)
    raise AssertionError(f"job {job} not over in {timeout} s: {job_fields(env, job)}")


def sacct_states(env: dict, job: str) -> list[str]:
    """The job's end states as `sacct -c` reads them from the job-completion log (one per
    end: a requeued job ends twice)."""
    out = subprocess.run(["sacct", "-c", "-j", job, "-n", "-P", "-o", "JobID,State"],
                         env=env, capture_output=True, text=True, timeout=30).stdout
    return [line.split("|")[1] for line in out.splitlines() if line.split("|")[0] == job]


def wait_for(predicate, env, job, what: str, timeout=JOB_TIMEOUT_S):
    """Poll `predicate` (a file read) every 20 ms while the job runs. The job's state is
    asked once a second, not every time: an scontrol takes ~50 ms under load, as long as
    an iteration can, and would delay the signals the tests send at iteration 2."""
    deadline, asked = time.monotonic() + timeout, 0.0
    while not predicate():
        now = time.monotonic()
        assert now < deadline, f"{what}: not in {timeout} s"
        if now - asked >= 1.0:
            state = job_fields(env, job).get("JobState")
            assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"{what}: job is {state}"
            asked = now
        time.sleep(0.02)


def committed(ck) -> int:
    try:
        return int((ck / "latest_checkpointed_iteration.txt").read_text())
    except (FileNotFoundError, ValueError):
        return 0


@pytest.fixture(scope="module")
def jobs(slurm_env):
    """Every job a test submits is cancelled at the end, whatever happened."""
    submitted = []
    yield submitted
    left = [job for job in submitted if job_fields(slurm_env, job).get("JobState") not in DONE]
    if left:
        subprocess.run(["scancel", *left], env=slurm_env, timeout=30)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """BASE's losses from one process (no SLURM): a call waits for them. The process
    starts at once, so that it runs while the SLURM job that it is compared with starts
    (scheduling, srun, rendezvous: waits that leave the cores idle at times)."""
    tmp = tmp_path_factory.mktemp("one")
    metrics, stderr = tmp / "m.jsonl", tmp / "stderr.txt"
    with open(stderr, "w") as err:
        proc = subprocess.Popen([sys.executable, "pretrain_gpt.py", *BASE, "--metrics-jsonl",
                                 str(metrics), "--data-cache-path", str(tmp / "cache")],
                                cwd=REPO, stdout=subprocess.DEVNULL, stderr=err,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))

    def losses() -> dict:
        try:
            rc = proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        assert rc == 0, stderr.read_text()[-3000:]
        return train_losses(read_jsonl(metrics))
    yield losses
    if proc.poll() is None:  # a test that failed before asking
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def uninterrupted(slurm_env, jobs, tmp_path_factory) -> dict:
    """BASE at dp 2 x sp 2 as a 2-node job, run to its end: its final fields, output
    and losses."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    out, metrics = tmp / "job.out", tmp / "m.jsonl"
    job = submit(slurm_env, out, BASE + SP2 + ["--metrics-jsonl", str(metrics),
                                               "--data-cache-path", str(tmp / "cache")])
    jobs.append(job)
    fields = wait_job(slurm_env, job)
    losses = train_losses(read_jsonl(metrics)) if metrics.exists() else {}
    return {"job": job, "fields": fields, "out": out.read_text(), "losses": losses}


def test_two_node_job_completes_with_one_process_losses(slurm_env, one_process,
                                                        uninterrupted):
    fields, log = uninterrupted["fields"], uninterrupted["out"]
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", log[-3000:]
    assert fields["NodeList"] == "node[1-2]"
    assert sacct_states(slurm_env, uninterrupted["job"]) == ["COMPLETED"]
    assert "nodes: 2 x 2 GPUs; rendezvous at node1:" in log
    assert "grid: world 4 = dp 2 x tp 1 x pp 1 x sp 2" in log
    got, want = uninterrupted["losses"], one_process()
    assert sorted(got) == list(range(1, ITERS + 1))
    for it in want:
        assert got[it] == pytest.approx(want[it], rel=1e-5), it


def test_scancel_usr1_saves_on_every_rank_and_completes(slurm_env, jobs, tmp_path):
    """The --signal=USR1@300 path: SLURM signals the step's processes; every rank
    finishes its step, saves and exits 0; run_node.sh makes the step a success."""
    ck, metrics, out = tmp_path / "ck", tmp_path / "m.jsonl", tmp_path / "job.out"
    args = BASE + SP2 + ["--train-iters", "1000", "--save", str(ck), "--metrics-jsonl",
                         str(metrics), "--data-cache-path", str(tmp_path / "cache")]
    job = submit(slurm_env, out, args)
    jobs.append(job)
    wait_for(lambda: logged_iteration(metrics) >= 2, slurm_env, job, "iteration 2")
    subprocess.run(["scancel", "--signal=USR1", job], env=slurm_env, check=True, timeout=30)
    fields = wait_job(slurm_env, job)
    log = out.read_text()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", log[-3000:]
    assert sacct_states(slurm_env, job) == ["COMPLETED"]
    stopped = committed(ck)
    assert 2 <= stopped < 1000 and (ck / f"iter_{stopped:07d}" / "COMMITTED").exists()
    # SLURM signals every process of the step and torchrun forwards it again: a worker
    # may log it twice
    assert log.count("SIGUSR1 received") >= 4, log[-3000:]
    assert f"saved checkpoint {ck}/iter_{stopped:07d}" in log
    assert log.count("saved and exited cleanly: success") == 2  # both nodes


def test_requeued_job_resumes_in_the_same_output_to_the_same_losses(slurm_env, jobs,
                                                                    tmp_path, uninterrupted):
    """scontrol requeue: SIGTERM to the running job (it saves), then the same job again,
    appending to the same output file, resuming from the checkpoint."""
    ck, metrics, out = tmp_path / "ck", tmp_path / "m.jsonl", tmp_path / "job.out"
    args = BASE + SP2 + ["--save", str(ck), "--load", str(ck), "--metrics-jsonl",
                         str(metrics), "--data-cache-path", str(tmp_path / "cache")]
    job = submit(slurm_env, out, args, opts=["--requeue", "--open-mode=append"])
    jobs.append(job)
    wait_for(lambda: logged_iteration(metrics) >= 2, slurm_env, job, "iteration 2")
    subprocess.run(["scontrol", "requeue", job], env=slurm_env, check=True, timeout=30)
    fields = wait_job(slurm_env, job, restarts=1)
    log = out.read_text()
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", log[-3000:]
    assert sacct_states(slurm_env, job)[-1] == "COMPLETED"
    assert log.count("nodes: 2 x 2 GPUs") == 2  # both starts, one file
    found = re.search(rf"loaded checkpoint {ck}/iter_(\d+)", log)
    assert found and 2 <= int(found.group(1)) < ITERS, log[-3000:]
    records = [r["iteration"] for r in read_jsonl(metrics) if "loss" in r]
    assert records == list(range(1, ITERS + 1))
    assert train_losses(read_jsonl(metrics)) == uninterrupted["losses"]  # bit for bit


def job_processes(job: str) -> list[psutil.Process]:
    """This machine's processes of the job's steps (their environment names the job)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("SLURM_JOB_ID") == job:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def node_processes(node: str, job: str) -> tuple[list[psutil.Process], list[int]]:
    """What losing a node kills: its slurmd, and the job's slurmstepd and processes on it;
    and the global ranks that ran there. Found while the job trains, ahead of the kill."""
    tasks = [p for p in job_processes(job) if p.environ().get("SLURMD_NODENAME") == node]
    ranks = sorted(int(p.environ()["RANK"]) for p in tasks if "RANK" in p.environ())
    stepds = {p.parent() for p in tasks if p.parent().name().startswith("slurmstepd")}
    slurmd = [p for p in psutil.process_iter(["name", "cmdline"])
              if p.info["name"] == "slurmd" and node in (p.info["cmdline"] or [])]
    assert len(slurmd) == 1 and stepds and ranks, (slurmd, stepds, ranks)
    return [*slurmd, *stepds, *tasks], ranks


def kill(procs: list[psutil.Process]) -> None:
    """SIGKILL them all at once (nothing reports an exit): a node lost."""
    for proc in procs:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


def rank0_node(job: str) -> str:
    for proc in job_processes(job):
        env = proc.environ()
        if env.get("RANK") == "0" and "SLURMD_NODENAME" in env:
            return env["SLURMD_NODENAME"]
    raise AssertionError("no rank 0 found")


def test_lost_node_names_its_ranks_and_a_resubmission_resumes(slurm_env, jobs, tmp_path,
                                                              uninterrupted):
    """node2 dies. node1 stays: it runs the batch script and srun (which writes the job's
    output), and rank 0 with the job's store, which the survivors' roll call needs to
    name who is gone (run_node.sh's static rendezvous puts rank 0 there)."""
    ck, metrics, out = tmp_path / "ck", tmp_path / "m.jsonl", tmp_path / "job.out"
    args = BASE + SP2 + ["--save", str(ck), "--load", str(ck), "--save-interval", "2",
                         "--distributed-timeout-minutes", "0.1", "--metrics-jsonl",
                         str(metrics), "--data-cache-path", str(tmp_path / "cache")]
    job = submit(slurm_env, out, args)
    jobs.append(job)
    # node2's processes are looked up once the ranks train, ahead of the checkpoint: the
    # kill then follows the checkpoint within ms, not after scans of every process, while
    # a run of 12 iterations (under 100 ms each on a quiet machine) goes on
    wait_for(lambda: logged_iteration(metrics) >= 1, slurm_env, job, "iteration 1")
    assert rank0_node(job) == "node1"
    node2, lost = node_processes("node2", job)
    wait_for(lambda: committed(ck) >= 2, slurm_env, job, "a checkpoint")
    try:
        kill(node2)
        # SLURM ends the job when node2 stops answering (SlurmdTimeout); the job then
        # stayed COMPLETING ~10 s more in 2 of 6 runs, its clean-up waiting on the dead
        # node: node2 comes back as soon as the job stops running
        wait_job(slurm_env, job, states=DONE | {"COMPLETING"})
    finally:
        subprocess.run(["bash", CLUSTER, "start"], env=slurm_env, timeout=120, check=True)
    fields = wait_job(slurm_env, job)
    log = out.read_text()
    assert fields["JobState"] in ("NODE_FAIL", "FAILED"), fields
    errors = [line for line in log.splitlines() if line.startswith("error: rank")]
    assert lost == [2, 3], lost  # node k holds ranks 2k, 2k+1
    named = "ranks 2, 3 did not answer"
    assert errors and all(named in line for line in errors), log[-4000:]
    last = committed(ck)
    assert last >= 2 and (ck / f"iter_{last:07d}" / "COMMITTED").exists()
    again = submit(slurm_env, tmp_path / "again.out", args)
    jobs.append(again)
    fields = wait_job(slurm_env, again)
    log = (tmp_path / "again.out").read_text()
    assert fields["JobState"] == "COMPLETED", log[-3000:]
    assert f"loaded checkpoint {ck}/iter_{last:07d}" in log
    assert train_losses(read_jsonl(metrics)) == uninterrupted["losses"]


def test_grid_that_does_not_divide_the_ranks_fails_before_any_step(slurm_env, jobs,
                                                                    tmp_path):
    out = tmp_path / "job.out"
    job = submit(slurm_env, out, BASE + ["--ds-sequence-parallel-size", "3",
                                         "--data-cache-path", str(tmp_path / "cache")])
    jobs.append(job)
    fields = wait_job(slurm_env, job)
    log = out.read_text()
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] == "2:0", fields
    assert sacct_states(slurm_env, job) == ["FAILED"]
    # pretrain_gpt.sbatch's first step: every node checks the flags, one line each
    errors = sorted(line for line in log.splitlines() if re.match(r"node\d+: error: ", line))
    assert [line.split(":")[0] for line in errors] == ["node1", "node2"], log[-3000:]
    assert all(": error: --ds-sequence-parallel-size: " in line
               and "must divide the world size 4" in line for line in errors), errors
    assert "iteration" not in log and "| loss" not in log and "Traceback" not in log


def dry_run_job(env: dict, out, sbatch_args: list, dry_run: str) -> str:
    """A one-node batch job with DRY_RUN set, submitted from the checkout as users do."""
    proc = subprocess.run(["sbatch", "--parsable", "--nodes", "1", "--output", str(out),
                           *sbatch_args], cwd=REPO, capture_output=True, text=True,
                          env=dict(env, OMP_NUM_THREADS="1", DRY_RUN=dry_run), timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


PAPER = ("examples/paper/fig8_convergence_1p3b.sh", "1",
         "=== convergence-1p3b-megatron-sp: 8 GPUs ===")
MEGATRON = ("examples/megatron/train_gpt3_175b_distributed.sh", "128",
            "dry run: world 128 = dp 1 x tp 8 x pp 16")
HOWS = ["wrap", "direct"]


@pytest.fixture(scope="module")
def dry_runs(slurm_env, jobs, tmp_path_factory) -> dict:
    """Every (script, how) case's job, submitted together: each takes one CPU of one
    node, so SLURM runs them side by side, where one after another each waited for the
    last (four scheduling and start-up delays in a row)."""
    tmp = tmp_path_factory.mktemp("dry_runs")
    submitted = {}
    for n, (script, dry_run, _) in enumerate([PAPER, MEGATRON]):
        for how in HOWS:
            out = tmp / f"{n}-{how}.out"
            args = ["--wrap", f"bash {script}"] if how == "wrap" else [script]
            submitted[script, how] = dry_run_job(slurm_env, out, args, dry_run), out
            jobs.append(submitted[script, how][0])
    return submitted


# sbatch runs a copy of the batch script from slurmd's spool directory: the scripts find
# their files from the submit directory when $(dirname "$0") is the spool's
@pytest.mark.parametrize("script, dry_run, expect", [PAPER, MEGATRON], ids=["paper", "megatron"])
@pytest.mark.parametrize("how", HOWS)
def test_example_scripts_dry_run_inside_a_job(slurm_env, dry_runs, script, dry_run, expect,
                                              how):
    """`sbatch --wrap "bash SCRIPT"` (the script from the checkout, in a job's
    environment) and `sbatch SCRIPT` (the script as the batch script itself), with
    DRY_RUN=`dry_run` (the dry_runs fixture submitted it)."""
    job, out = dry_runs[script, how]
    fields = wait_job(slurm_env, job)
    log = out.read_text()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", log[-3000:]
    assert expect in log, log[-3000:]
