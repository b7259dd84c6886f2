"""How long a checkpoint save stalls training: --async-save against the plain (sync) save.

    python benchmarks/checkpoint.py [--rounds 3] [pretrain_gpt.py flags ...]

One process builds the model of the given flags (default: the bundled default model),
trains one step (so AdamW's moments exist), then saves `--rounds` times in each mode into
a temporary directory. Per save: the time `Trainer.save()` blocks the training loop, and
the time until the checkpoint is committed (for sync saves the same). Prints a table and
the ratio of the blocking times, async / sync.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import table  # noqa: E402


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f))
               for root, _, files in os.walk(path) for f in files)


def time_saves(trainer, use_async: bool, rounds: int) -> list[tuple[float, float, int]]:
    """(seconds blocked, seconds until committed, bytes) per save."""
    from megaulysses.training.checkpoint import iteration_dir
    trainer.saver.use_async = use_async
    out = []
    for _ in range(rounds):
        trainer.state.iteration += 1  # a new directory each time
        t0 = time.perf_counter()
        trainer.save()
        blocked = time.perf_counter() - t0
        trainer.saver.wait()
        done = time.perf_counter() - t0
        out.append((blocked, done, dir_bytes(iteration_dir(trainer.cfg.train.save,
                                                           trainer.state.iteration))))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    args, flags = p.parse_known_args(argv)
    from megaulysses.config import parse_args
    from megaulysses.training.trainer import Trainer
    with tempfile.TemporaryDirectory() as tmp:
        cfg = parse_args(flags + ["--save", tmp, "--train-iters", "1", "--eval-iters", "0",
                                  "--generate", "0", "--log-interval", "1"])
        trainer = Trainer(cfg)
        trainer.train()  # one step, and the first (sync) save: warms the file system
        results = {mode: time_saves(trainer, mode == "async", args.rounds)
                   for mode in ("sync", "async")}
    rows, blocked = [], {}
    for mode, saves in results.items():
        blocked[mode] = statistics.median(s[0] for s in saves)
        done = statistics.median(s[1] for s in saves)
        mib = saves[-1][2] / 2**20
        rows.append([mode, f"{blocked[mode]:.3f}", f"{done:.3f}", f"{mib:.1f}",
                     f"{mib / done:.0f}"])
    print(table(["save", "training blocked s", "until committed s", "MiB", "MiB/s"], rows))
    print(f"ratio blocked async/sync: {blocked['async'] / blocked['sync']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
