"""Smoke test of benchmarks/megatron_step.py: a tiny run at tp 1 and 2, output format only.

No speed is asserted (wall-clock numbers on a shared machine are not test material). The
compiled side is left out (no --compile): compiling costs ~30 s here; tests/parallel/
test_compile.py tests our compiled step. The losses' agreement is checked by the script
itself (it exits 1 beyond its tolerance) and read back here.
"""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

# found, not imported: the script's ranks import it (importing it here costs ~3 s)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                reason="megatron-core is the peer (pip install '.[test]')")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "benchmarks", "megatron_step.py")
TINY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "128",
        "--vocab", "256", "--seq", "32", "--micro-batch", "2", "--reps", "2", "--warmup", "0",
        "--tp", "1", "2"]
# the script's own bound, relative (fp32 losses ~7 here); measured 7e-08 (tp1), 1.5e-07 (tp2)
LOSS_RTOL = 1e-5
NUMBER = r"\d+\.\d{3}"


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=300, cwd=REPO)


def test_tiny_run_prints_losses_table_and_ratios():
    proc = run(*TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    assert re.search(r"^llama: 2 layers, hidden 64, heads 4/2 kv, .*\(64 tokens/step\)", text,
                     re.M)
    for tp in (1, 2):
        for side in ("megatron-core", "ours"):
            losses = re.search(rf"^tp{tp} {side}\s+losses: (\S+) (\S+) (\S+)$", text, re.M)
            assert losses, (tp, side)
            assert all(float(x) > 0 for x in losses.groups())
            assert re.search(rf"^\| tp{tp}\s*\| {side}\s*\|( {NUMBER}\s*\|){{2}} \d+\s*\|$",
                             text, re.M), (tp, side)
        worst = re.search(rf"^tp{tp} largest \|loss - megatron-core's\| over 3 steps: \S+ "
                          r"\((\S+) relative; ", text, re.M)
        assert worst and float(worst.group(1)) <= LOSS_RTOL, (tp, worst)
        assert re.search(rf"^tp{tp}: \d+ s wall \(build \d+ s, .*\), load average now ", text,
                         re.M), tp
    assert "speed: > 1 means faster than megatron-core" in text
    lines = text.strip().splitlines()
    for line, tp in zip(lines[-2:], (1, 2), strict=True):
        assert re.fullmatch(rf"ratio ours/megatron-core \(tp{tp}\): min \d+\.\d\d median "
                            r"\d+\.\d\d", line), line


def test_bad_input_names_the_flag():
    proc = run("--heads", "4", "--kv-heads", "1", "--tp", "2")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "--kv-heads: must be divisible by --tp 2", proc.stderr
