"""The paper's headline at a fixed memory budget: the longest sequence each setup trains.

    python benchmarks/long_sequence.py                       # ~20 min on 2 cores
    python benchmarks/long_sequence.py --throughput-seq 1024 8192    # ~27 min: the docs' run
    python benchmarks/long_sequence.py --budget-gib 0.5 --setups b,c --throughput-seq 0

One GPT (4 layers, hidden 512, 8 heads, SwiGLU ffn 1408, RoPE, RMSNorm, untied embeddings,
vocab 32000, fp32, AdamW) on 8 ranks, five setups:

    a   dp8, ZeRO-0: data parallel only, nothing recomputed, the plain (untiled) loss
    b   Megatron-SP as Megatron-LM runs it: tp8 + --sequence-parallel, ZeRO-0, full
        recompute, its vocab-parallel loss untiled (one [s, V/8] logits block and its
        gradient, as Megatron's vocab_parallel_cross_entropy)
    b+  b with every memory feature of issue 12 that applies: tiled loss, tiled MLP
    c   ours: Ulysses sp8 + ZeRO-3 + full recompute + tiled loss + tiled MLP
    d   ours without recomputation or tiling (Ulysses sp8 + ZeRO-3, untiled loss)
    c+o c with every layer's kept input offloaded to host memory (issue 24): device bytes
        count against the budget, the host bytes are reported beside them
    c+f c+o with Ulysses attention in 8 sequence chunks (FPDT, --ds-sequence-parallel-fpdt)
        whose q, k, v, output chunks and key/value gradient sums are on the host

For each, the longest sequence (a multiple of --step, 1024) whose whole training step fits
--budget-gib of live tensor bytes per rank: what the rank holds before the step
(parameters, buffers, AdamW's states, its batch) plus the most the step allocates at once
(forward, backward, gradient reduction, optimizer). Search: double from --step while it
fits, then bisect between the last fit and the first miss. The tiled MLP's chunk count
is the smallest that divides the local sequence and gives chunks of at most --tile-rows
rows of the MLP's input (under Megatron-SP its all-gathered rows).

How a length is measured. These lengths (up to ~10^6 tokens) cannot run for real on a
2-core machine (the attention alone of 512K tokens is ~10^15 flops), so each step runs as
one rank of the 8 on torch's fake process group under FakeTensorMode: the real Trainer and
train_step, every op with its real shapes and no data (benchmarks/fake_rank.py, whose
peaks equal real gloo runs to the byte on 12 grids). Every rank of these setups holds the
same shapes (32000 and every length divide by 8), so rank 0 stands for all. Next to each
measured peak: the memory plan's prediction (planner/memory/, what --dry-run
prints) for the same flags.

Throughput is measured for real (8 gloo ranks, 1 thread each, on this machine's cores:
the eight ranks share 2 cores, so it measures total work and the cost of the collectives,
not a cluster's speed) at one common length, --throughput-seq (default: the shortest of
the longest lengths, so every setup fits): tokens/s = tokens of a step / median step time.

"Untiled loss" patches the fused cross entropy's chunk size to all rows
(`ops.cross_entropy._rows_per_chunk`, and the plan's `CE_BUDGET` alike): it then keeps the whole
[tokens, V/tp] block of exps for backward, as Megatron's loss does.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MIB, GIB = 2 ** 20, 2 ** 30
WORLD = 8
MODEL = ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8",
         "--ffn-hidden-size", "1408", "--swiglu", "--normalization", "RMSNorm",
         "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
         "--disable-bias-linear", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "31999",
         "--mock-data", "--micro-batch-size", "1", "--train-iters", "3",
         "--lr-warmup-iters", "0", "--eval-iters", "0", "--log-interval", "1000",
         "--generate", "0"]
FULL = ["--recompute-granularity", "full"]
TP8 = ["--tensor-model-parallel-size", "8", "--sequence-parallel", "--global-batch-size", "1"]
SP8_Z3 = ["--ds-sequence-parallel-size", "8", "--zero-stage", "3", "--global-batch-size", "1"]


@dataclass(frozen=True)
class Setup:
    name: str
    what: str
    flags: tuple
    untiled_loss: bool
    tiled_mlp: bool
    fpdt_chunks: int = 0  # --ds-sequence-parallel-fpdt with this many chunks, offloading

    def argv(self, seq: int, tile_rows: int) -> list:
        out = MODEL + list(self.flags) + ["--seq-length", str(seq),
                                          "--max-position-embeddings", str(seq)]
        if self.tiled_mlp:
            out += ["--tiled-mlp-chunks", str(mlp_chunks(seq, self.gathers_mlp, tile_rows))]
        if self.fpdt_chunks:
            out += ["--ds-sequence-parallel-fpdt", "--ds-sequence-parallel-fpdt-offloading",
                    "--ds-sequence-parallel-fpdt-chunk-size", str(seq // self.fpdt_chunks)]
        return out

    @property
    def gathers_mlp(self) -> bool:  # Megatron-SP: the MLP runs on all-gathered rows
        return "--sequence-parallel" in self.flags


SETUPS = [
    Setup("a", "dp8, ZeRO-0", ("--zero-stage", "0", "--global-batch-size", "8"), True, False),
    Setup("b", "Megatron-SP: tp8 + SP, ZeRO-0, full recompute, untiled loss",
          tuple(TP8 + FULL), True, False),
    Setup("b+", "b + tiled loss + tiled MLP", tuple(TP8 + FULL), False, True),
    Setup("c", "ours: Ulysses sp8 + ZeRO-3 + full recompute + tiled loss/MLP",
          tuple(SP8_Z3 + FULL), False, True),
    Setup("d", "ours without recompute/tiling: Ulysses sp8 + ZeRO-3", tuple(SP8_Z3), True,
          False),
    Setup("c+o", "c + activation offload to host (--cpu-offloading-num-layers 4)",
          tuple(SP8_Z3 + FULL + ["--cpu-offloading-num-layers", "4"]), False, True),
    Setup("c+f", "c+o + chunked Ulysses attention, chunks on the host (FPDT, 8 chunks)",
          tuple(SP8_Z3 + FULL + ["--cpu-offloading-num-layers", "4"]), False, True, 8),
]
C_BEFORE_ISSUE_24 = 178176  # (c)'s longest length before issue 24's working-set changes


def mlp_chunks(seq: int, gathered: bool, tile_rows: int) -> int:
    """Smallest N dividing the local sequence (seq / 8) with at most `tile_rows` rows of the
    MLP's input per chunk (seq / N under Megatron-SP, seq / 8 / N under Ulysses)."""
    local = seq // WORLD
    rows = seq if gathered else local
    for n in range(1, local + 1):
        if local % n == 0 and rows // n <= tile_rows:
            return n
    return local


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget-gib", type=float, default=1.0,
                   help="live tensor bytes per rank (default 1)")
    p.add_argument("--setups", default=",".join(s.name for s in SETUPS))
    p.add_argument("--step", type=int, default=1024, help="lengths are multiples of this")
    p.add_argument("--max-seq", type=int, default=2 ** 22, help="stop doubling here")
    p.add_argument("--tile-rows", type=int, default=4096)
    p.add_argument("--throughput-seq", type=int, nargs="*", default=None,
                   help="measure tokens/s for real at these lengths, for every setup that "
                        "fits them (default: the shortest longest length; 0: skip)")
    p.add_argument("--throughput-steps", type=int, default=2, help="timed steps (after one)")
    p.add_argument("--out", default=os.path.join(REPO, "docs", "long_sequence"),
                   help="writes OUT.json, OUT.md and OUT.png ('' : print only)")
    args = p.parse_args(argv)
    known = {s.name: s for s in SETUPS}
    names = args.setups.split(",")
    bad = [n for n in names if n not in known]
    if bad:
        p.error(f"--setups: unknown {bad}; choose from {sorted(known)}")
    args.chosen = [known[n] for n in names]
    return args


# -- the untiled loss ---------------------------------------------------------------------

@contextlib.contextmanager
def loss_chunks(untiled: bool):
    """All rows in one kept chunk (Megatron's loss) when `untiled`, for the fused cross
    entropy and for the plan's model of it."""
    from megaulysses.model.ops import cross_entropy
    from megaulysses.planner import memory as memory_plan
    rows, budget = cross_entropy._rows_per_chunk, dict(memory_plan.CE_BUDGET)
    if untiled:
        cross_entropy._rows_per_chunk = lambda n, *_: n
        memory_plan.CE_BUDGET.update({k: 2 ** 62 for k in budget})
    try:
        yield
    finally:
        cross_entropy._rows_per_chunk = rows
        memory_plan.CE_BUDGET.update(budget)


# -- one length on the fake process group -------------------------------------------------

class FakeRank:
    """This process as rank 0 of 8 on torch's fake process group, for every measurement."""

    def __enter__(self):
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore
        import fake_rank
        fake_rank._quiet(False)
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist
        dist.destroy_process_group()

    def measure(self, setup: Setup, seq: int, tile_rows: int) -> dict:
        """{total: held + step peak, planned: the memory plan's peak, by_phase, seconds}."""
        from torch._subclasses.fake_tensor import FakeTensorMode
        import fake_rank
        from megaulysses.config import parse_args as parse_flags
        from megaulysses.parallel.dims import PP
        from megaulysses.planner.memory import plan_memory
        from megaulysses.training.trainer import Trainer
        start = time.perf_counter()
        with loss_chunks(setup.untiled_loss), fake_rank._fake_patches(), FakeTensorMode():
            trainer = Trainer(parse_flags(setup.argv(seq, tile_rows)))
            with fake_rank._Scalars():
                r = fake_rank.measure_step(trainer, steps=2)
            plan = plan_memory(trainer.cfg, trainer.dims, trainer.comm.rank(PP), "cpu")
        del trainer
        gc.collect()
        return {"seq": seq, "total": sum(r["held"].values()) + r["peak"], "host": r["host"],
                "held": sum(r["held"].values()), "planned": plan.peak_bytes,
                "by_phase": r["by_phase"], "seconds": time.perf_counter() - start,
                "plan": {"moment": plan.peak_moment, "params": plan.param_bytes,
                         "grads": plan.grad_bytes, "optimizer": plan.optimizer_bytes,
                         "activations": plan.activation_bytes,
                         "transient": plan.transient_bytes,
                         "layer_terms": plan.layer_terms}}


def longest(rank: FakeRank, setup: Setup, budget: int, step: int, max_seq: int,
            tile_rows: int, log) -> tuple[int, dict, list]:
    """(longest fitting length, its measurement, every measurement) for `setup`."""
    tried = []

    def fits(seq: int) -> bool:
        r = rank.measure(setup, seq, tile_rows)
        tried.append(r)
        log(f"  {setup.name:<3} seq {seq:>8}: {r['total'] / MIB:8.1f} MiB measured, "
            f"{r['planned'] / MIB:8.1f} planned -> {'fits' if r['total'] <= budget else 'over'}"
            f" ({r['seconds']:.1f} s)")
        return r["total"] <= budget

    if not fits(step):
        return 0, tried[-1], tried
    good = step
    while good * 2 <= max_seq and fits(good * 2):
        good *= 2
    bad = good * 2
    if bad <= max_seq:
        while bad - good > step:
            mid = (good + bad) // 2 // step * step
            good, bad = (mid, bad) if fits(mid) else (good, mid)
    best = next(r for r in tried if r["seq"] == good)
    return good, best, tried


# -- tokens/s, for real -------------------------------------------------------------------

def real_step_seconds(rank: int, world: int, argv: list, untiled: bool, steps: int) -> list:
    """One warm-up step, then `steps` timed ones (barrier-aligned) of the real Trainer."""
    import torch.distributed as dist
    import megaulysses.training.step as tr
    from megaulysses.config import parse_args as parse_flags
    from megaulysses.training.trainer import Trainer
    logging.disable(logging.INFO)
    with loss_chunks(untiled):
        trainer = Trainer(parse_flags(argv))
        t = trainer.cfg.train
        times = []
        for i in range(steps + 1):
            batches = trainer.train_data.micro_batches(i * t.global_batch_size)
            dist.barrier()
            start = time.perf_counter()
            tr.train_step(trainer.model, batches, trainer.zero, trainer.scaler, t.clip_grad,
                          trainer.device, trainer.dtype, trainer.comm, trainer.pipeline)
            dist.barrier()
            times.append(time.perf_counter() - start)
    return times[1:]


def tokens_per_second(setup: Setup, seq: int, tile_rows: int, steps: int) -> float:
    from _common import launch
    argv = setup.argv(seq, tile_rows)
    per_rank = launch(real_step_seconds, WORLD, argv, setup.untiled_loss, steps)
    seconds = statistics.median(max(ts) for ts in zip(*per_rank, strict=True))
    batch = int(argv[argv.index("--global-batch-size") + 1])
    return batch * seq / seconds


# -- report -------------------------------------------------------------------------------

def report(results: dict, args) -> str:
    from _common import table
    rows = []
    for s in args.chosen:
        r = results[s.name]
        best = r["best"]
        rows.append([s.name, s.what, f"{r['longest']:,}",
                     f"{best['total'] / MIB:.1f}", f"{best['planned'] / MIB:.1f}",
                     f"{(best['planned'] - best['total']) / best['total']:+.1%}",
                     f"{best.get('host', 0) / MIB:.1f}"] + [f"{r['tokens_per_s'][n]:.0f}" if n in r.get("tokens_per_s", {})
                          else "-" for n in args.throughput_seq_used])
    head = ["setup", "what", "longest seq", "measured MiB", "planned MiB", "plan error",
            "host MiB"] + [
        f"tokens/s at {n}" for n in args.throughput_seq_used]
    lines = [f"budget {args.budget_gib:g} GiB of live tensor bytes per rank, world {WORLD}; "
             "longest multiple of 1024 whose whole training step fits", table(head, rows)]
    got = {n: results[n]["longest"] for n in results}
    for num, den, target in (("c", "b", 4), ("c", "a", 8), ("c", "b+", None)):
        if num in got and den in got and got[den]:
            ratio = got[num] / got[den]
            mark = "" if target is None else f" (target >= {target}: " \
                f"{'met' if ratio >= target else 'NOT met'})"
            lines.append(f"ratio ({num})/({den}): {ratio:.2f}{mark}")
    for name in ("c", "c+o", "c+f"):
        if got.get(name):
            ratio = got[name] / C_BEFORE_ISSUE_24
            lines.append(f"({name}) / (c) before issue 24 ({C_BEFORE_ISSUE_24:,}): {ratio:.2f} "
                         f"(target >= 2: {'met' if ratio >= 2 else 'NOT met'})")
    return "\n".join(lines)


def advantage(rank: "FakeRank", results: dict, args) -> str:
    """(b+) and (c) at (b+)'s longest length, side by side: the plan's split of each peak
    and what one layer holds while recomputed."""
    from _common import table
    known = {s.name: s for s in SETUPS}
    seq = results["b+"]["longest"]
    runs = {n: next((t for t in results[n]["tried"] if t["seq"] == seq), None) for n in
            ("b+", "c")}
    for n, r in runs.items():
        if r is None:
            runs[n] = rank.measure(known[n], seq, args.tile_rows)
    mib = lambda n: f"{n / MIB:.1f}"  # noqa: E731
    keys = ("params", "grads", "optimizer", "activations", "transient")
    terms = sorted(set().union(*(r["plan"]["layer_terms"] for r in runs.values())))
    rows = [[k] + [mib(runs[n]["plan"][k]) for n in runs] for k in keys]
    rows += [["measured total"] + [mib(runs[n]["total"]) for n in runs]]
    rows += [[f"layer: {k}"] + [mib(runs[n]["plan"]["layer_terms"].get(k, 0)) for n in runs]
             for k in terms]
    head = [f"at seq {seq:,} (MiB, the plan's split)"] + [
        f"({n}) peak at {runs[n]['plan']['moment']}" for n in runs]
    return table(head, rows)


def plot(results: dict, args, path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [s.name for s in args.chosen]
    values = [results[n]["longest"] / 1024 for n in names]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    bars = ax.bar(names, values, color=["#999", "#c66", "#e99", "#36c", "#9bd",
                                        "#139"][:len(names)])
    for bar, v in zip(bars, values, strict=True):
        ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:,.0f}K", ha="center", va="bottom")
    ax.set_yscale("log")
    ax.set_ylabel("longest sequence (K tokens)")
    ax.set_title(f"Longest trainable sequence, 8 ranks, {args.budget_gib:g} GiB per rank")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    args = parse_args(argv)
    budget = int(args.budget_gib * GIB)
    log = lambda m: print(m, flush=True)  # noqa: E731
    results = {}
    with FakeRank() as rank:
        for s in args.chosen:
            log(f"({s.name}) {s.what}")
            n, best, tried = longest(rank, s, budget, args.step, args.max_seq,
                                     args.tile_rows, log)
            results[s.name] = {"longest": n, "best": best, "tried": tried}
        why = advantage(rank, results, args) if {"b+", "c"} <= set(results) else ""
    fitting = [r["longest"] for r in results.values() if r["longest"]]
    seqs = [min(fitting, default=0)] if args.throughput_seq is None else args.throughput_seq
    seqs = args.throughput_seq_used = [n for n in seqs if n]
    for n in seqs:  # lengths outermost: a setup's runs are spread over the whole time
        for s in args.chosen:
            if results[s.name]["longest"] >= n:
                log(f"tokens/s of ({s.name}) at seq {n} on {WORLD} real gloo ranks ...")
                results[s.name].setdefault("tokens_per_s", {})[n] = tokens_per_second(
                    s, n, args.tile_rows, args.throughput_steps)
    from _common import provenance
    text = provenance("python benchmarks/long_sequence.py " + " ".join(sys.argv[1:]),
                      "longest sequences and tokens/s measured on 8 gloo ranks on this CPU "
                      "(live tensor bytes, the live-bytes tracker), beside the plan's bytes "
                      "(cpu).") + "\n\n" + report(results, args) + (
        "\n\nwhere (c)'s advantage over (b+) comes from:\n" + why if why else "")
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump({"budget_gib": args.budget_gib, "throughput_seq": seqs,
                       "results": results}, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(text + "\n")
        plot(results, args, args.out + ".png")
        print(f"wrote {args.out}.json, .md, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
