"""Smoke test of benchmarks/checkpoint.py: a tiny run end to end, output format only.

No time is asserted (wall-clock numbers on a shared machine are not test material)."""

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "benchmarks", "checkpoint.py")
TINY = ["--rounds", "1", "--num-layers", "1", "--hidden-size", "64", "--num-attention-heads",
        "4", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "2",
        "--peak-tflops", "1"]


def test_tiny_run_prints_both_modes_and_the_ratio(tmp_path):
    proc = subprocess.run([sys.executable, SCRIPT, *TINY, "--data-cache-path",
                           str(tmp_path / "cache")], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    for mode in ("sync", "async"):
        row = re.search(rf"^\| {mode}\s*\|(\s*\d+\.\d+\s*\|){{3}}\s*\d+\s*\|$", proc.stdout, re.M)
        assert row, proc.stdout
    sizes = re.findall(r"^\| a?sync\s*\|[^|]*\|[^|]*\|\s*(\d+\.\d)\s*\|", proc.stdout, re.M)
    assert len(sizes) == 2 and sizes[0] == sizes[1] and float(sizes[0]) > 0  # same files
    assert re.search(r"^ratio blocked async/sync: \d+\.\d\d$", proc.stdout, re.M)
