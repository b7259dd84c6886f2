"""Plot the convergence study's loss curves (run.sh) and compare each with one process.

    python examples/convergence/plot.py OUT_DIR [--png PATH] [--rtol 1e-5] [--check]

Reads OUT_DIR/*.jsonl (one_process.jsonl is the reference), draws every training-loss
curve into one PNG (default OUT_DIR/convergence.png), and prints, per run, the largest
relative difference of its logged loss from the one-process loss, and where it stops
being within --rtol. fp32 runs of the same model, data and global batch differ only by
summation order; over a few steps that stays within 1e-5, over hundreds it grows (training
amplifies last-bit differences), so --check (exit 1 beyond --rtol) is for short runs.
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import os
import sys

REFERENCE = "one_process"
LABELS = {"one_process": "1 process",
          "ulysses_sp2_dp2_zero1": "Ulysses sp2 x dp2, ZeRO-1",
          "ulysses_sp2_dp2_zero2": "Ulysses sp2 x dp2, ZeRO-2",
          "ulysses_sp2_dp2_zero3": "Ulysses sp2 x dp2, ZeRO-3",
          "megatron_sp_tp2_dp2": "Megatron-SP tp2 x dp2"}


def read_curves(out_dir: str) -> dict[str, dict[int, float]]:
    curves = {}
    for path in sorted(glob.glob(os.path.join(out_dir, "*.jsonl"))):
        name = os.path.splitext(os.path.basename(path))[0]
        with open(path) as f:
            records = [json.loads(line) for line in f]
        curves[name] = {r["iteration"]: r["loss"] for r in records if "loss" in r}
    if REFERENCE not in curves:
        raise SystemExit(f"{out_dir}: no {REFERENCE}.jsonl (run run.sh first)")
    return curves


def differences(curves: dict) -> dict[str, dict[int, float]]:
    """Per run and logged iteration: |loss - reference| / reference."""
    ref = curves[REFERENCE]
    out = {}
    for name, curve in curves.items():
        if name == REFERENCE:
            continue
        if sorted(curve) != sorted(ref):
            raise SystemExit(f"{name}: iterations {min(curve)}..{max(curve)} differ from "
                             f"the one-process run's {min(ref)}..{max(ref)}")
        out[name] = {i: abs(curve[i] - ref[i]) / abs(ref[i]) for i in sorted(ref)}
    return out


def max_differences(curves: dict) -> dict[str, float]:
    return {name: max(d.values()) for name, d in differences(curves).items()}


def plot(curves: dict, png: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2))
    styles = ["-", "--", "-.", ":", (0, (5, 1))]
    # the styles repeat: one curve per run, however many runs
    for (name, curve), style in zip(sorted(curves.items(), key=lambda kv: kv[0] != REFERENCE),
                                    itertools.cycle(styles), strict=False):
        its = sorted(curve)
        ax.plot(its, [curve[i] for i in its], linestyle=style, linewidth=1.4,
                label=LABELS.get(name, name))
    ax.set_xlabel("iteration")
    ax.set_ylabel("training loss")
    ax.set_title("Convergence: Ulysses + ZeRO vs Megatron-SP vs 1 process (fp32, CPU)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--png", default=None, help="default: OUT_DIR/convergence.png")
    p.add_argument("--rtol", type=float, default=1e-5)
    p.add_argument("--check", action="store_true", help="exit 1 when a run differs by "
                   "more than --rtol")
    args = p.parse_args(argv)
    curves = read_curves(args.out_dir)
    png = args.png or os.path.join(args.out_dir, "convergence.png")
    plot(curves, png)
    diffs = differences(curves)
    iters = sorted(curves[REFERENCE])
    print(f"{len(iters)} logged iterations; relative difference of the loss from the "
          f"one-process run:")
    print(f"  {'run':28s} {'largest':>9s} {'final':>9s}  within {args.rtol:g} up to")
    for name, d in diffs.items():
        within = [i for i in iters if all(d[j] <= args.rtol for j in iters if j <= i)]
        print(f"  {LABELS.get(name, name):28s} {max(d.values()):9.2e} {d[iters[-1]]:9.2e}  "
              f"{'iteration ' + str(within[-1]) if within else '-'}")
    final = {name: c[iters[-1]] for name, c in curves.items()}
    print("final loss: " + ", ".join(f"{LABELS.get(n, n)} {v:.4f}" for n, v in final.items()))
    print(f"plot: {png}")
    bad = [name for name, d in diffs.items() if max(d.values()) > args.rtol]
    if args.check and bad:
        print(f"DIFFERENT beyond {args.rtol:g}: {', '.join(bad)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
