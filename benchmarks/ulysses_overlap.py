"""Ulysses' all-to-all behind compute (parallel/a2a_overlap.py): one transformer layer on
sp = 2 gloo ranks, forward + backward, each way overlapped and blocking.

    python benchmarks/ulysses_overlap.py                      # the README's run
    python benchmarks/ulysses_overlap.py --seq 512 --reps 3   # quick

A Llama-ish block (RMSNorm, SwiGLU, GQA 8 q / 4 kv heads of 64, hidden 512; no RoPE: it
changes no exchange), micro-batch 1, --seq positions over the two ranks, fp32, the block
kernel's SDPA core, under each variant:
    G=1      plain Ulysses: q, k, v issued together (nothing computes between)
    G=2, 4   --attention-head-groups: a group's exchanges in flight while another's core
             runs (each group checkpointed, as the trainer runs them)
    fpdt     --ds-sequence-parallel-fpdt, 4 chunks a rank: a chunk ahead
each overlapped (the default) and blocking (`overlap=False`, the same results bit for bit:
checked here too). Both built from the same weights.

Timing: --warmup untimed reps, then --reps reps, the two ways of a variant interleaved
within each rep so that other processes' load hits them alike; a rep's time is the slowest
rank's. Reported: min and median ms of each, the median ms a rank's thread spent issuing
and waiting for all-to-alls (comm.py's timers: the exposed part), and `ratio
overlap/blocking` (of the medians, and of the mins; < 1: overlapping is faster). On a 2-core CPU both ranks' compute and
gloo's threads share the cores, so there is little idle time for an exchange to hide in:
expect ratios near 1 here; the overlap is for GPUs, where the exchange runs on its own
engines.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import launch, table  # noqa: E402

VARIANTS = ("G=1", "G=2", "G=4", "fpdt")


def _layer(comm, variant: str, overlap: bool, seq: int):
    """The block with this variant's attention core, weights from seed 0."""
    from megaulysses.config import ModelConfig
    from megaulysses.model.attention import sdpa_attention
    from megaulysses.model.gpt import Block
    from megaulysses.parallel.fpdt import ChunkedUlyssesAttention
    from megaulysses.parallel.head_groups import HeadGroups
    from megaulysses.parallel.ulysses import UlyssesAttention
    cfg = ModelConfig(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                      add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                      num_layers=1, hidden_size=512, num_attention_heads=8, num_query_groups=4,
                      ffn_hidden_size=1536, seq_length=seq, max_position_embeddings=seq)
    if variant == "fpdt":
        core = ChunkedUlyssesAttention(comm, 4, False, overlap=overlap)
    else:
        core = UlyssesAttention(sdpa_attention, comm, overlap=overlap)
        groups = int(variant[2:])
        core = HeadGroups(core, groups) if groups > 1 else core
    torch.manual_seed(0)
    return Block(cfg, core)


def _step(layer, x, dy, timers) -> tuple[float, float, list]:
    """Seconds of one forward + backward (the ranks start together), of them the seconds
    this rank's thread spent issuing and waiting for all-to-alls (the exposed part), and
    its results."""
    dist.barrier()
    x = x.clone().requires_grad_()
    timers.pop()
    start = time.perf_counter()
    y = layer(x, None)
    grads = torch.autograd.grad(y, [x] + list(layer.parameters()), dy)
    seconds = time.perf_counter() - start
    return seconds, timers.pop().get("all_to_all", 0.0), [y.detach()] + list(grads)


def run(rank: int, P: int, seq: int, warmup: int, reps: int, variants: list) -> dict:
    from megaulysses.parallel.comm import Comm
    from megaulysses.parallel.dims import ParallelDims, build_mesh
    comm = Comm(build_mesh(ParallelDims(dp=1, tp=1, pp=1, sp=P), "cpu"))
    comm.stats.timers.on = True  # every all-to-all's issue and wait timed (comm.py)
    g = torch.Generator().manual_seed(1)
    x, dy = (torch.randn(1, seq, 512, generator=g)[:, rank * seq // P:(rank + 1) * seq // P]
             for _ in range(2))
    out = {}
    for variant in variants:
        layers = {o: _layer(comm, variant, o, seq) for o in (True, False)}
        times = {True: [], False: []}
        for rep in range(warmup + reps):
            results = {}
            for overlap in ((True, False) if rep % 2 else (False, True)):
                *seconds, results[overlap] = _step(layers[overlap], x, dy, comm.stats.timers)
                if rep >= warmup:
                    times[overlap].append(seconds)  # (step, exposed all-to-all)
            same = all(torch.equal(a, b)
                       for a, b in zip(results[True], results[False], strict=True))
            assert same, f"{variant}: overlapped and blocking results differ"
        out[variant] = times
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=2048, help="positions, over the 2 ranks")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    a = ap.parse_args()
    ranks = launch(run, 2, a.seq, a.warmup, a.reps, a.variants)
    rows = []
    for variant in a.variants:
        # a rep's time: its slowest rank's; the exposed all-to-all: the ranks' mean
        per = {o: [max(r[variant][o][i][0] for r in ranks) * 1e3 for i in range(a.reps)]
               for o in (True, False)}
        a2a = {o: statistics.median(sum(r[variant][o][i][1] for r in ranks) / len(ranks)
                                    * 1e3 for i in range(a.reps)) for o in (True, False)}
        med = {o: statistics.median(t) for o, t in per.items()}
        low = {o: min(t) for o, t in per.items()}
        rows.append([variant, f"{med[False]:.1f}", f"{low[False]:.1f}", f"{a2a[False]:.1f}",
                     f"{med[True]:.1f}", f"{low[True]:.1f}", f"{a2a[True]:.1f}",
                     f"{med[True] / med[False]:.3f}", f"{low[True] / low[False]:.3f}"])
        print(f"{variant}: ratio overlap/blocking: {med[True] / med[False]:.3f} (median), "
              f"{low[True] / low[False]:.3f} (min); exposed all-to-all "
              f"{a2a[True] / a2a[False]:.3f} (median)")
    print(f"\nsp=2 gloo, seq {a.seq}, {a.reps} reps (+{a.warmup} warmup), one torch thread "
          f"a rank, {os.cpu_count()} CPUs\n")
    print(table(["variant", "blocking median ms", "min", "a2a exposed", "overlap median ms",
                 "min", "a2a exposed", "ratio (median)", "ratio (min)"], rows))


if __name__ == "__main__":
    main()
