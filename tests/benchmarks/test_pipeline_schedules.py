"""Smoke test of benchmarks/pipeline.py: a tiny run on pp = 2 gloo ranks.

Time is printed, never asserted. Activation memory is counted from the saved tensors, so
it is exact: under 1f1b the first stage holds 2 micro-batches (pp - rank) and the last 1,
gpipe holds all m = 4; every schedule computes the one-rank loss.
"""

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "benchmarks", "pipeline.py")
TINY = ["--layers", "4", "--hidden", "64", "--heads", "4", "--seq", "32", "--vocab", "512",
        "--micro-batches", "4", "--pp", "2", "--reps", "1", "--timeout", "200"]
ROW = re.compile(r"^\| 2\s+\| ([\w-]+)\s*\| (\d)\s+\|.*\| ([\d.]+)\s+\|$", re.M)


def test_tiny_run_prints_bubbles_and_activations_in_flight():
    proc = subprocess.run([sys.executable, SCRIPT, *TINY], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    text = proc.stdout
    flight = {(m[1], int(m[2])): float(m[3]) for m in ROW.finditer(text)}
    assert {s for s, _ in flight} == {"gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"}, text
    assert flight[("gpipe", 0)] == flight[("gpipe", 1)] == 4.0
    assert flight[("1f1b", 0)] == 2.0 and flight[("1f1b", 1)] == 1.0
    assert "same loss everywhere (fp32, 1e-5): yes" in text
    assert re.search(r"^\| 2\s+\| 1f1b\s+\| [\d.]+\s+\| [\d.]+\s+\| [\d.]+ ", text, re.M), text
