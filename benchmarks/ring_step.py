"""One ring attention step, forward + backward: the fused kernel with lse vs the block kernel.

    python benchmarks/ring_step.py                          # the README's run (~6 min on 2 cores)
    python benchmarks/ring_step.py --seq 256 --reps 2 --ring-seq 256      # quick (~10 s)
    python benchmarks/ring_step.py --device cuda            # on a GPU (flash_attn if importable)

Part 1, one process: the two kinds of step a ring rank runs under the causal mask, at s
query positions (--seq: the positions a ring rank holds, S/C), b=1, 8 heads, d=64, in
fp32 and bf16 (--dtypes), each forward then backward (given the step's out and lse, as the
ring's backward is):
    causal   step 0: the rank's own keys, an s x s causal square
    full     a later step, ring rank 1 of 2 against rank 0's keys: s queries x the s/2
             keys of rank 0's early chunk, all attended
on the two kernels parallel/ring.py chooses between:
    fused    model/attention/fused.py (`fused_kernel`): one call each way (on CPU torch's
             `_scaled_dot_product_flash_attention_for_cpu` and its backward)
    block    model/attention/block.py's `partial_forward` / `partial_backward` over the
             step's zigzag positions (blocks of 64), what the ring runs for other masks
Part 2, two gloo ranks (--ring-seq, S = 2 s; one torch thread each): the whole ring
attention, `RingAttention` over cp = 2, forward + backward, fused vs the block kernel
(forced by the script: `ring.plain_fused_kernel` returning None), the slowest rank's time.

Timing: --warmup untimed reps, then --reps reps, the variants interleaved within each rep so
that other processes' load hits them alike; reported: median and min ms, and block / fused
(of the medians; > 1: the fused kernel is faster). Results are checked: fused and block
outputs and gradients agree (max |diff| printed; the script exits 1 if an fp32 one is
over --tol).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import launch, table  # noqa: E402

from megaulysses.model.attention import AttentionMask  # noqa: E402
from megaulysses.model.attention.block import partial_backward, partial_forward  # noqa: E402
from megaulysses.model.attention.fused import fused_kernel  # noqa: E402
from megaulysses.parallel.ring import fused_step, zigzag_positions  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BLOCK = 64


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096],
                   help="s: positions a ring rank holds (part 1)")
    p.add_argument("--ring-seq", type=int, nargs="*", default=[1024, 2048, 4096],
                   help="s per rank of the cp=2 ring (part 2; none: skip it)")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch threads in part 1")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tol", type=float, default=1e-4, help="fp32: max |fused - block|")
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args(argv)


# ---- part 1: one step -----------------------------------------------------------------------


def step_inputs(args, s: int, dtype, kind: str):
    """q, k, v, dout for one step and its rectangle (rows, keys, causal) and positions."""
    g = torch.Generator().manual_seed(args.seed)
    shape = (args.batch, s, args.heads, args.head_dim)
    q, k, v, dout = (torch.randn(shape, generator=g).to(args.device, dtype) for _ in range(4))
    c, src = (0, 0) if kind == "causal" else (1, 0)  # ring rank 1 of 2 against rank 0
    rect = fused_step(True, c, src, s // 2)
    qi = zigzag_positions(2 * s, 2, c, args.device)  # the block kernel's global positions
    kj = zigzag_positions(2 * s, 2, src, args.device)
    return (q, k, v, dout), rect, (qi, kj)


def run_fused(tensors, rect, positions):
    q, k, v, dout = tensors
    rows, keys, causal = rect
    kernel, scale = fused_kernel(q), q.shape[-1] ** -0.5
    q, dout, k, v = q[:, rows], dout[:, rows], k[:, keys], v[:, keys]
    out, lse = kernel.forward(q, k, v, causal, scale)
    return (out, *kernel.backward(dout, q, k, v, out, lse, causal, scale))


def run_block(tensors, rect, positions):
    q, k, v, dout = tensors
    qi, kj = positions
    mask = AttentionMask()
    out, lse = partial_forward(q, k, v, mask, qi, kj, BLOCK, out_dtype=q.dtype)
    dq, dk, dv = partial_backward(q, k, v, out, lse, dout, None, mask, qi, kj, BLOCK)
    return out, dq, dk, dv


def _sync(device: str):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_steps(args) -> list:
    """Rows of part 1: (dtype, s, step, fused ms, block ms, ratio, max diff)."""
    rows = []
    for dname in args.dtypes:
        for s in args.seq:
            for kind in ("causal", "full"):
                rows.append(_time_step(args, DTYPES[dname], dname, s, kind))
                print("  " + " | ".join(str(c) for c in rows[-1]), flush=True)
    return rows


def _time_step(args, dtype, dname: str, s: int, kind: str) -> list:
    tensors, rect, positions = step_inputs(args, s, dtype, kind)
    variants = {"fused": run_fused, "block": run_block}
    times = {name: [] for name in variants}
    results = {}
    for rep in range(args.warmup + args.reps):
        for name, fn in variants.items():  # interleaved
            _sync(args.device)
            t0 = time.perf_counter()
            results[name] = fn(tensors, rect, positions)
            _sync(args.device)
            if rep >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    diff = _max_diff(results["fused"], results["block"], rect)
    fused, block = (statistics.median(times[n]) * 1e3 for n in ("fused", "block"))
    return [dname, s, kind, f"{fused:.1f} ({min(times['fused']) * 1e3:.1f})",
            f"{block:.1f} ({min(times['block']) * 1e3:.1f})", f"{block / fused:.2f}",
            f"{diff:.1e}"]


def _max_diff(fused, block, rect) -> float:
    """max |fused - block| over out, dq, dk, dv, on the step's rows and keys (the block
    kernel returns all of them: zeros elsewhere)."""
    rows, keys, _ = rect
    pairs = zip(fused, (block[0][:, rows], block[1][:, rows], block[2][:, keys],
                        block[3][:, keys]), strict=True)
    return max((a.float() - b.float()).abs().max().item() for a, b in pairs)


# ---- part 2: the whole cp=2 ring on gloo ----------------------------------------------------


def ring_rank(rank, world, args, s: int, dname: str) -> dict:
    """This rank's forward + backward times of RingAttention, fused and block, interleaved."""
    import torch.distributed as dist

    import megaulysses.parallel.ring as ring
    from megaulysses.parallel.comm import Comm
    from megaulysses.parallel.dims import ParallelDims, build_mesh
    comm = Comm(build_mesh(ParallelDims(dp=1, tp=1, pp=1, sp=1, cp=world), "cpu"))
    g = torch.Generator().manual_seed(args.seed + rank)
    shape = (args.batch, s, args.heads, args.head_dim)
    q, k, v, dout = (torch.randn(shape, generator=g).to(DTYPES[dname]) for _ in range(4))
    fused_pick = ring.plain_fused_kernel
    # The block kernel is what the ring runs for masks no fused kernel runs; forced here
    # under the causal mask for a like-for-like comparison.
    pick = {"fused": fused_pick, "block": lambda *a: None}
    times, outs = {n: [] for n in pick}, {}
    for rep in range(args.warmup + args.reps):
        for name, chooser in pick.items():
            ring.plain_fused_kernel = chooser
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            dist.barrier()
            t0 = time.perf_counter()
            out = ring.RingAttention(comm)(*inputs)
            grads = torch.autograd.grad(out, inputs, dout)
            if rep >= args.warmup:
                times[name].append(time.perf_counter() - t0)
            outs[name] = (out, *grads)
    ring.plain_fused_kernel = fused_pick
    diff = max((a.float() - b.float()).abs().max().item()
               for a, b in zip(outs["fused"], outs["block"], strict=True))
    return {"times": times, "diff": diff}


def time_rings(args) -> list:
    rows = []
    for dname in args.dtypes:
        for s in args.ring_seq:
            ranks = launch(ring_rank, 2, args, s, dname)
            # a rep's time: the slowest rank's
            med = {n: statistics.median(max(r["times"][n][i] for r in ranks)
                                        for i in range(args.reps)) * 1e3
                   for n in ("fused", "block")}
            low = {n: min(max(r["times"][n][i] for r in ranks) for i in range(args.reps)) * 1e3
                   for n in ("fused", "block")}
            rows.append([dname, 2 * s, s, f"{med['fused']:.1f} ({low['fused']:.1f})",
                         f"{med['block']:.1f} ({low['block']:.1f})",
                         f"{med['block'] / med['fused']:.2f}",
                         f"{max(r['diff'] for r in ranks):.1e}"])
            print("  " + " | ".join(str(c) for c in rows[-1]), flush=True)
    return rows


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    first = torch.zeros(1, 8, 1, args.head_dim, dtype=DTYPES[args.dtypes[0]],
                        device=args.device)
    kernel = fused_kernel(first)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"device {args.device}, {args.threads} thread(s) in part 1; fused kernel: "
          f"{kernel.name if kernel else 'none'}; b={args.batch}, {args.heads} heads, "
          f"d={args.head_dim}; median (min) of {args.reps} reps after {args.warmup} warm-up")
    print("\nPart 1: one ring step, forward + backward")
    steps = time_steps(args)
    print(table(["dtype", "s", "step", "fused ms", "block ms", "block / fused",
                 "max |diff|"], steps))
    if args.ring_seq and args.device == "cpu":
        print("\nPart 2: RingAttention over cp = 2 gloo ranks, forward + backward "
              "(slowest rank)")
        rings = time_rings(args)
        print(table(["dtype", "S", "s a rank", "fused ms", "block ms", "block / fused",
                     "max |diff|"], rings))
        steps += rings
    bad = [r for r in steps if r[0] == "fp32" and float(r[-1]) > args.tol]
    if bad:
        print(f"fp32 results differ by more than {args.tol}: {bad}")
        sys.exit(1)


if __name__ == "__main__":
    main()
