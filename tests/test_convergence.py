"""examples/convergence: a short version of the study (4 iterations of the tiny model, the
Ulysses runs at ZeRO-3 only: stages 1 and 2 run the same command line, and test_zero
compares every stage with one process) runs through the real command lines (torchrun),
and every curve equals the one-process curve within fp32 tolerance (1e-5 relative, as
the parity tests)."""

import os
import subprocess
import sys

from helpers import REPO, TINY

RUN = os.path.join(REPO, "examples", "convergence", "run.sh")
PLOT = os.path.join(REPO, "examples", "convergence", "plot.py")


def test_short_study_agrees_with_one_process_and_plots(tmp_path):
    out = tmp_path / "study"
    flags = TINY + ["--train-iters", "4", "--eval-iters", "0",
                    "--data-cache-path", str(tmp_path / "cache")]
    proc = subprocess.run(["bash", RUN, str(out), *flags], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1", ZERO_STAGES="3"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    names = sorted(p[:-len(".jsonl")] for p in os.listdir(out) if p.endswith(".jsonl"))
    assert names == ["megatron_sp_tp2_dp2", "one_process", "ulysses_sp2_dp2_zero3"]
    assert (out / "convergence.png").stat().st_size > 10_000
    sys.path.insert(0, os.path.dirname(PLOT))
    try:
        import plot
    finally:
        sys.path.pop(0)
    curves = plot.read_curves(str(out))
    assert all(sorted(c) == [1, 2, 3, 4] for c in curves.values())
    diffs = plot.max_differences(curves)
    assert max(diffs.values()) <= 1e-5, diffs
    # the printed report: one line per run, each within the tolerance up to the last iteration
    report = [line for line in proc.stdout.splitlines() if "iteration 4" in line]
    assert sorted(line.split("  ")[1].strip() for line in report) == sorted(
        plot.LABELS[n] for n in names if n != plot.REFERENCE), proc.stdout
    assert plot.main([str(out), "--png", str(tmp_path / "check.png"), "--check"]) == 0
