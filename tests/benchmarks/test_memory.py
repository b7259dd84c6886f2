"""Smoke test of benchmarks/memory.py: a tiny run on 2 gloo ranks, sp 1 and 2, stages 0-3.

Model-state bytes are counted from tensors, so they are exact: with N = 2 ranks, stage 1
holds 1/2 of the optimizer states and gradients (reduced rows), stages 2 and 3 1/2 of
everything, at either sp; every run computes the same loss. Peak memory is printed, not
asserted (it depends on the allocator).
"""

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "benchmarks", "memory.py")
TINY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "64", "--world", "2",
        "--sp", "1", "2", "--timeout", "200"]
ROW = re.compile(r"^\| (\d)\s+\| (\d)\s+\| (\d)\s+\| ([\d.]+)\s+\| ([\d.]+)\s+\| ([\d.]+)\s+\| "
                 r"([\d.]+)\s+\| ([\d.]+)\s+\|", re.M)


def test_tiny_run_prints_states_per_stage_and_plot(tmp_path):
    png = tmp_path / "memory.png"
    proc = subprocess.run([sys.executable, SCRIPT, *TINY, "--png", str(png)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {(int(m[1]), int(m[3])): [float(m[i]) for i in range(4, 9)]
            for m in ROW.finditer(proc.stdout)}
    assert sorted(rows) == [(sp, z) for sp in (1, 2) for z in range(4)], proc.stdout
    for sp in (1, 2):
        params, grads, optim, states, ratio = rows[(sp, 0)]
        # printed to 0.01 MiB: 2 x a rounded figure may differ from the rounded double
        assert grads == params and abs(optim - 2 * params) <= 0.011 and ratio == 1.0
        assert rows[(sp, 1)][0] == params  # parameters replicated
        for z in (1, 2, 3):  # MiB with 2 decimals: 0.01 of rounding
            assert abs(rows[(sp, z)][1] - params / 2) <= 0.01, (sp, z, rows[(sp, z)])
            assert abs(rows[(sp, z)][2] - params) <= 0.01, (sp, z, rows[(sp, z)])
        for z in (2, 3):
            assert abs(rows[(sp, z)][3] - states / 2) <= 0.01, (sp, z, rows[(sp, z)])
        assert rows[(sp, 3)] == rows[(1, 3)]  # ZeRO over dp x sp: the same whatever sp
    assert "same loss everywhere (fp32, 1e-5 relative): yes" in proc.stdout
    assert png.stat().st_size > 10_000
