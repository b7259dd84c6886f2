"""Memory per rank: ZeRO stage 0-3 x Ulysses sp 1, 2, 4, 8 on a world of 8 gloo ranks.

One fixed Llama-style GPT (default: the bundled default's shape, 6 layers, h 384, 8 heads,
at seq 1024) trains on the bundled data with a global batch of 8 sequences in
micro-batches of 1: with Ulysses degree P each of the 8 / P data-parallel groups runs
P micro-batches of seq / P tokens per rank. ZeRO shards over dp x sp = 8 ranks at every
P, so model states fall with the stage whatever P is (the paper's point), while the
activations of a micro-batch fall with P. For every (stage, P) the 8 ranks build a
Trainer, run one step to warm up (AdamW creates its states) and measure the second:

    states   bytes of parameters, gradients and optimizer states held right after the
             optimizer step, counted from the tensors (`Zero.held_bytes`; FSDP's gathered
             copies and ZeRO-1's reduced rows included); "params peak" is the most
             parameter bytes held at the observed moments (before the last backward:
             stage 2 holds every parameter gathered, stage 3 the root unit and a block)
    peak     the most bytes of tensors the rank held during the measured step: on CPU,
             what it held when the step began (model states, batches) plus the CPU
             allocator's high-water mark above that, from the torch profiler's allocation
             events (the CPU counterpart of torch.cuda.max_memory_allocated, which is
             used on CUDA); the busiest rank's

Ratios: against stage 0 at the same P, and against P = 1 at the same stage. Rank 0's
states are shown (every rank holds the same up to padding); peak is the max over ranks.
The table goes to stdout, the plot to docs/memory.png (--png).

    python benchmarks/memory.py                                  # the full default
    python benchmarks/memory.py --layers 2 --hidden 64 --seq 64  # a quick one
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import launch, table  # noqa: E402

MIB = 2 ** 20
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--zero", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--png", default=os.path.join(REPO, "docs", "memory.png"),
                   help="plot path; '' for none")
    p.add_argument("--timeout", type=float, default=3600)
    args = p.parse_args(argv)
    for sp in args.sp:
        if args.world % sp or args.heads % sp or args.seq % sp:
            p.error(f"--sp {sp} must divide --world, --heads and --seq")
    if 0 not in args.zero or 1 not in args.sp:
        p.error("the ratios need --zero 0 and --sp 1")
    return args


def trainer_flags(args, sp: int, zero: int) -> list:
    return ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
            "--num-attention-heads", str(args.heads), "--seq-length", str(args.seq),
            "--micro-batch-size", "1", "--global-batch-size", str(args.world),
            "--train-iters", "2", "--lr-warmup-iters", "0", "--eval-iters", "0",
            "--log-interval", "1000", "--generate", "0", "--peak-tflops", "1",
            "--ds-sequence-parallel-size", str(sp), "--zero-stage", str(zero)]


def measure(args, sp: int, zero: int) -> dict:
    """This rank's figures for one (sp, zero) run: two steps, the second measured."""
    from megaulysses.config import parse_args as parse_flags
    from megaulysses.training.step import train_step
    from megaulysses.training.trainer import Trainer
    trainer = Trainer(parse_flags(trainer_flags(args, sp, zero)))
    step = lambda: _one_step(trainer, train_step)  # noqa: E731
    step()  # warm-up: optimizer states appear
    trainer.zero.pop_peak()
    start = trainer.zero.held_bytes()  # no gradients between steps
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        loss = step()
        peak = torch.cuda.max_memory_allocated()
    else:
        t0 = time.perf_counter()
        loss, above = _profiled(step)
        peak = sum(start.values()) + _batch_bytes(trainer) + above
    seconds = time.perf_counter() - t0
    return {"states": dict(trainer.zero.at_step), "peak": peak, "loss": loss,
            "params_peak": trainer.zero.pop_peak()["params"], "seconds": seconds}


def _one_step(trainer, train_step) -> float:
    t = trainer.cfg.train
    batches = trainer.train_data.micro_batches(trainer.state.consumed_train_samples)
    r = train_step(trainer.model, batches, trainer.zero, trainer.scaler, t.clip_grad,
                   trainer.device, trainer.dtype, trainer.comm, trainer.pipeline)
    trainer.state.consumed_train_samples += t.global_batch_size
    return r.loss


def _batch_bytes(trainer) -> int:
    b = trainer.train_data.micro_batches(0)
    return sum(t.numel() * t.element_size() for mb in b for t in mb.values())


def _profiled(fn):
    """(fn(), the CPU allocator's high-water mark above its level when fn began)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    peak, stack = 0, list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation:
            peak = max(peak, event.extra_fields.total_allocated)
    return out, peak


def run_rank(rank: int, world: int, args) -> dict:
    torch.set_num_threads(1)
    out = {}
    for sp in args.sp:
        for zero in args.zero:
            gc.collect()  # the previous run's trainer (its hooks make cycles) is gone
            out[(sp, zero)] = measure(args, sp, zero)
            if rank == 0:
                print(f"  sp {sp} zero {zero}: {out[(sp, zero)]['seconds']:.1f} s", flush=True)
    return out


# -- report ---------------------------------------------------------------------------


def summarize(ranks: list[dict]) -> dict:
    rows = {}
    for key in ranks[0]:
        r0 = ranks[0][key]
        rows[key] = {"states": r0["states"], "params_peak": r0["params_peak"],
                     "total": sum(r0["states"].values()),
                     "peak": max(r[key]["peak"] for r in ranks), "loss": r0["loss"]}
    return rows


def report(rows: dict, args, wall: float) -> str:
    lines = [f"Memory per rank: {args.layers} layers, h {args.hidden}, {args.heads} heads, "
             f"seq {args.seq}, global batch {args.world} x micro-batch 1, fp32 + AdamW, "
             f"world {args.world} gloo ranks (dp = world / sp); MiB", ""]
    table_rows = []
    for (sp, zero), r in sorted(rows.items()):
        s = r["states"]
        base_zero, base_sp = rows[(sp, 0)], rows[(1, zero)] if (1, zero) in rows else None
        table_rows.append([
            sp, args.world // sp, zero, f"{s['params'] / MIB:.2f}", f"{s['grads'] / MIB:.2f}",
            f"{s['optim'] / MIB:.2f}", f"{r['total'] / MIB:.2f}",
            f"{r['total'] / base_zero['total']:.3f}", f"{r['params_peak'] / MIB:.2f}",
            f"{r['peak'] / MIB:.1f}", f"{r['peak'] / base_zero['peak']:.3f}",
            f"{r['peak'] / base_sp['peak']:.3f}" if base_sp else "-"])
    lines.append(table(["sp", "dp", "zero", "params", "grads", "optim", "states",
                        "states vs zero 0", "params peak", "peak", "peak vs zero 0",
                        "peak vs sp 1"], table_rows))
    losses = [r["loss"] for r in rows.values()]
    spread = (max(losses) - min(losses)) / abs(losses[0])
    lines += ["", f"same loss everywhere (fp32, 1e-5 relative): "
              f"{'yes' if spread < 1e-5 else 'NO'} (spread {spread:.1e})",
              f"total wall time: {wall:.0f} s"]
    return "\n".join(lines)


def plot(rows: dict, args, png: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(args.sp)
    for i, sp in enumerate(args.sp):
        xs = [z + (i - (len(args.sp) - 1) / 2) * width for z in args.zero]
        axes[0].bar(xs, [rows[(sp, z)]["total"] / MIB for z in args.zero], width,
                    label=f"sp {sp} (dp {args.world // sp})")
        axes[1].bar(xs, [rows[(sp, z)]["peak"] / MIB for z in args.zero], width,
                    label=f"sp {sp}")
    titles = ("model states per rank (after the step)", "peak tensor memory per rank")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xticks(args.zero, [f"ZeRO-{z}" for z in args.zero])
        ax.set_ylabel("MiB")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"{args.layers} layers, h {args.hidden}, seq {args.seq}, world {args.world}: "
                 "ZeRO over dp x sp")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv=None):
    args = parse_args(argv)
    start = time.perf_counter()
    rows = summarize(launch(run_rank, args.world, args, timeout=args.timeout))
    print()
    print(report(rows, args, time.perf_counter() - start))
    if args.png:
        plot(rows, args, args.png)
        print(f"plot: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
