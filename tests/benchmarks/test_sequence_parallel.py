"""Smoke test of benchmarks/sequence_parallel.py: a tiny run on 2 gloo ranks.

Bytes are exact, so measured bytes must equal theory for ours (Ulysses) and Megatron-SP
(and DeepSpeed's, when DeepSpeed is installed; it is not required). No time is asserted.
"""

import importlib.util
import os
import re
import subprocess
import sys

from megaulysses.parallel.tensor import megatron_sp_bytes_per_layer
from megaulysses.parallel.ulysses import ulysses_bytes_per_layer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "benchmarks", "sequence_parallel.py")
S, H, HEADS, P = 256, 128, 4, 2
TINY = ["--seq", str(S), "--hidden", str(H), "--heads", str(HEADS), "--ranks", str(P),
        "--reps", "1", "--warmup", "1", "--timeout", "100"]
ROW = re.compile(r"^\| (\d+) \| ([\w-]+)\s*\| (\d+) \((\d+)\)\s*\| (\d+) \((\d+)\)\s*\| (\w+)\s*\|",
                 re.M)


def test_tiny_run_prints_table_with_exact_bytes(tmp_path):
    png = tmp_path / "bytes.png"
    proc = subprocess.run([sys.executable, SCRIPT, *TINY, "--plot", str(png)],
                          capture_output=True, text=True, timeout=170, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    text = proc.stdout
    rows = {m[2]: m for m in ROW.finditer(text) if int(m[1]) == P}
    assert {"ulysses", "megatron-sp"} <= set(rows), text

    # forward = backward per layer, per rank: 4 b S h (P-1)/P^2 and 2 b S h (P-1)/P, fp32
    ours = ulysses_bytes_per_layer(1, S, HEADS, HEADS, H // HEADS, P, 4)
    megatron = sum(megatron_sp_bytes_per_layer(1, S, H, P, 4).values()) // 2  # attention only
    assert ours == 4 * S * H * 4 * (P - 1) // P ** 2
    assert megatron == 2 * S * H * 4 * (P - 1) // P
    expected = {"ulysses": ours, "megatron-sp": megatron, "deepspeed": ours}
    for method, m in rows.items():
        fwd, fwd_theory, bwd, bwd_theory = (int(v) for v in m.group(3, 4, 5, 6))
        assert fwd == fwd_theory == expected[method], (method, m[0])
        assert bwd == bwd_theory == expected[method], (method, m[0])
        assert m[7] == "yes", m[0]

    assert "ratios" in text and re.search(rf"^\| {P} \| 1\.000 ", text, re.M), text
    assert re.search(r"^ours: comm.stats all-to-all bytes == .*: yes$", text, re.M), text
    if "deepspeed" not in rows:
        assert "deepspeed: skipped" in text
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.exists() and png.stat().st_size > 0
