"""examples/paper/: every script dry-runs (DRY_RUN=1) and every configuration fits an
A100-80GB by its memory plan (80 GiB less the 4 GiB every plan reserves: CUDA context,
allocator slack, NCCL buffers), except those its script marks

    # expected OOM (paper: why): NAME [NAME...]

which must dry-run too, and must indeed be planned over that (so a mark cannot go stale).
A script's configurations run in one python process (examples/paper/dry_run_configs.py);
the model exists on the meta device only.
"""

import os
import re
import subprocess
import sys

import pytest

from megaulysses.hardware import RESERVE_GIB

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAPER = os.path.join(ROOT, "examples", "paper")
SCRIPTS = sorted(f for f in os.listdir(PAPER) if f.endswith(".sh") and f != "common.sh")
GPU_MIB = (80 - RESERVE_GIB) * 1024  # A100-80GB: 81,920 MiB, less the plans' reserve
HEADER = re.compile(r"^=== (\S+): (\d+) GPUs ===$", re.M)
PEAK = re.compile(r"^\s+peak \([^)]*\)\s+([\d,]+\.\d)$", re.M)
EXPECTED_OOM = re.compile(r"^#\s*expected OOM \(paper: .+\):\s*(\S.*)$", re.M)


def expected_oom(script: str) -> set[str]:
    with open(os.path.join(PAPER, script)) as f:
        return {name for names in EXPECTED_OOM.findall(f.read()) for name in names.split()}


def peaks(output: str) -> dict[str, float]:
    """NAME -> the largest peak (MiB per rank) over the pipeline stages printed."""
    heads = list(HEADER.finditer(output))
    assert heads, output[-3000:]
    result = {}
    for i, h in enumerate(heads):
        block = output[h.end():heads[i + 1].start() if i + 1 < len(heads) else len(output)]
        found = [float(p.replace(",", "")) for p in PEAK.findall(block)]
        assert found, f"{h.group(1)}: no memory plan printed:\n{block[-2000:]}"
        assert h.group(1) not in result, f"configuration {h.group(1)} twice"
        result[h.group(1)] = max(found)
    return result


def test_every_script_has_a_figure_header():
    assert len(SCRIPTS) >= 5, SCRIPTS
    for script in SCRIPTS:
        with open(os.path.join(PAPER, script)) as f:
            head = f.read(600)
        assert "2309.14509" in head and re.search(r"Fig\.|table", head), script


@pytest.mark.parametrize("script", SCRIPTS)
def test_paper_script_dry_runs_and_fits(script):
    env = dict(os.environ, DRY_RUN="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    bindir = os.path.dirname(sys.executable)  # `python` in the scripts: this interpreter
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    r = subprocess.run(["bash", os.path.join(PAPER, script)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    planned = peaks(r.stdout)
    marked = expected_oom(script)
    assert marked <= set(planned), f"marked but not run: {marked - set(planned)}"
    too_big = {n: p for n, p in planned.items() if p > GPU_MIB and n not in marked}
    assert not too_big, ("planned over the usable memory of an A100-80GB, not marked "
                         f"expected OOM: {too_big}")
    stale = {n: planned[n] for n in marked if planned[n] <= GPU_MIB}
    assert not stale, f"marked expected OOM but planned to fit: {stale}"
