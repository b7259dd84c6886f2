"""The SLURM tests need a running cluster: examples/slurm/local_cluster.sh start (.ci/run
starts it). Where none answers, every test here is skipped, with the reason; with
MEGAULYSSES_REQUIRE_SLURM=1 (.ci/run) they fail instead, so CI cannot skip them unseen."""

import os
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER = os.path.join(REPO, "examples", "slurm", "local_cluster.sh")


def _cluster_env() -> dict:
    """The environment the SLURM clients need: SLURM_CONF as local_cluster.sh writes it,
    unless the caller's environment names one."""
    env = dict(os.environ)
    if "SLURM_CONF" not in env:
        out = subprocess.run(["bash", CLUSTER, "env"], capture_output=True, text=True,
                             timeout=30).stdout.strip()
        env["SLURM_CONF"] = out.removeprefix("export SLURM_CONF=")
    return env


def _unavailable(reason: str):
    if os.environ.get("MEGAULYSSES_REQUIRE_SLURM") == "1":
        pytest.fail(f"MEGAULYSSES_REQUIRE_SLURM=1, but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def slurm_env() -> dict:
    """The cluster's client environment; skips the module where no cluster answers."""
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        _unavailable("SLURM is not installed (examples/slurm/local_cluster.sh start installs it)")
    env = _cluster_env()
    status = subprocess.run(["bash", CLUSTER, "status"], env=env, capture_output=True,
                            timeout=60)
    if status.returncode != 0:
        _unavailable("no SLURM cluster answers with 2 nodes up "
                     "(examples/slurm/local_cluster.sh start)")
    return env
