"""Smoke test of benchmarks/single_device.py: a tiny run end to end, output format only.

No speed is asserted (wall-clock numbers on a shared machine are not test material). The
compiled variants are left out (--no-compile): compiling both models costs ~30 s here;
tests/parallel/test_compile.py tests our compiled step.
"""

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "benchmarks", "single_device.py")
TINY = ["--layers", "1", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "128",
        "--vocab", "256", "--seq", "32", "--micro-batch", "2", "--warmup", "1", "--rounds", "1",
        "--steps", "1", "--device", "cpu", "--threads", "1", "--no-compile"]


def test_tiny_run_prints_table_and_ratio():
    proc = subprocess.run([sys.executable, SCRIPT, *TINY], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert re.fullmatch(r"ratio ours/hf: \d+\.\d\d", lines[-1]), lines[-1]
    assert float(lines[-1].split(":")[1]) > 0
    text = proc.stdout
    assert "64 tokens/step" in text  # micro batch 2 x seq 32, counted the same for both
    for name in ("ours", "hf"):
        assert re.search(rf"^{name} tokens/s: \d+\.\d$", text, re.M), name
        assert re.search(rf"^\| {name}\s*\|(\s*\d+\.\d+\s*\|){{4}}$", text, re.M), name
    assert re.search(r"^round 1/1: ours \d+\.\d+ s/step, hf \d+\.\d+ s/step$", text, re.M)
    # HF starts from our weights (--same-init, the default), so the first losses (before
    # any update) agree: both compute the same next-token loss on the same positions.
    ours, hf = map(float, re.search(r"^initial loss: ours (\S+), hf (\S+)$", text, re.M).groups())
    assert ours > 0 and abs(ours - hf) <= 1e-5 * ours, (ours, hf)
