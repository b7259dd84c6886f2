"""Ulysses x Ring on one attention layer, and dense vs window vs block-sparse attention.

    python benchmarks/attention_grid.py                # the docs' run (~6 min on 2 quiet cores)
    python benchmarks/attention_grid.py --seq 1024 --sparse-seq 4096 --reps 2   # quicker
    python benchmarks/attention_grid.py --parts 2              # part 2 only

Part 1: the attention core between the exchanges, one layer, on P (--ranks, 8) gloo ranks
(spawned processes on 127.0.0.1, one torch thread each; one spawn serves every
configuration). Random q, k, v, already projected, `[b, S, h, d]` from one seed, the same on
every rank; each rank takes its tokens, the global positions
`local_positions(S, C, cp_rank, U, sp_rank)` (zigzag chunks when C > 1), runs forward and
backward with a random output gradient, and nothing else. Causal mask, fp32, b=1, d=64,
S=4096, for 8 and for 4 heads (MHA; --kv-heads for GQA). Configurations, U * C = P:

    U8       UlyssesAttention(core, comm, "sp") around a plain core: "auto" = cpu_attention
             (what the trainer runs on CPU: SDPA's CPU flash kernel at this length) and
             "block" = block_attention (the ring's own kernel, for a like-for-like row).
             Needs heads % U == 0: with 4 heads on 8 ranks it is n/a, which is the point.
    C8       RingAttention(comm, "cp"): zigzag chunks, C steps of the block kernel.
    U4xC2    UlyssesAttention(RingAttention(comm, "cp"), comm, "sp"), as parallelize.py
    U2xC4    composes them: all-to-all over U ranks, then a ring of C.

Measured per configuration:
    time      each rep starts at a barrier; a rep's time is the slowest rank's forward +
              backward; the median over --reps after --warmup (configurations interleaved
              within each rep, so that load from other processes hits them alike).
    CPU s     the ranks' main-thread CPU seconds (time.thread_time) for forward + backward,
              summed over ranks, median over reps: the work, which oversubscription (P
              ranks on fewer cores) and other processes hardly move.
    in comm   share of a rank's wall time spent inside the collectives (all-to-all, with its
              packing, and waiting on ring passes), mean over ranks, median over reps. It
              includes waiting for slower peers.
    bytes     what the rank sent (comm.stats: "all_to_all", "ring"), forward and backward,
              the busiest rank; next to the formulas, asserted equal (integers):
                  all_to_all  ulysses_bytes_per_layer(b, S / C, hq, hkv, d, U, 4) forward,
                              the same again backward (the all-to-all's backward is the
                              same exchange; kv heads below U are repeated to U first,
                              which is the max(hkv, P) in the formula)
                  ring        ring_bytes_per_layer(b, S, max(hkv, U) / U, d, C, 4):
                              (forward, backward), the kv heads a rank holds after Ulysses
    error     max |out - ref| and max |dq, dk, dv - ref| on the rank's positions, against a
              single-process math_attention over the whole sequence (computed here once,
              head by head); must be < --tol (1e-4).

Part 2: one process (2 threads), masked_block_attention at S=16384 (--sparse-seq), b=1,
8 heads, d=64, fp32, forward + backward, for the masks: dense causal `AttentionMask()`,
window 1024, fixed (`SparseLayout("fixed", 64, local=4, global_=1)`), bigbird
(`SparseLayout("bigbird", 64, local=3, global_=1, random=2, seed=0)`); and dense causal
through `sdpa_attention` (torch's CPU flash kernel) as the peer. Reported: time (median and
min over reps, variants interleaved; on a shared machine other processes only add time, so
the min is the least disturbed figure), process CPU s, time / dense block-kernel time, and
the fraction of (query, key) pairs the kernel computes (`computed_pairs`, in elements, over
dense causal's), so one sees the time track the attended blocks. A variant whose warm-up
and first timed rep both exceed --slow-s (60 s) is timed once only (said in the output).
The dense block kernel is checked against SDPA (max |diff| of out and gradients).

Outputs: the report on stdout, and OUT_DIR/attention_grid.md and .json (--out-dir, default
docs/; '' for none). The script exits 1, writing nothing, if a byte count differs from its
formula or an error exceeds --tol.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import launch, max_per_kind, provenance, table  # noqa: E402

from megaulysses.model.attention import (AttentionMask, SparseLayout,  # noqa: E402
                                         attention_block_size, block_attention, computed_pairs,
                                         cpu_attention, masked_block_attention, math_attention,
                                         sdpa_attention)
from megaulysses.parallel.comm import Comm  # noqa: E402
from megaulysses.parallel.dims import CP, SP, ParallelDims, build_mesh  # noqa: E402
from megaulysses.parallel.ring import (RingAttention, local_positions,  # noqa: E402
                                       ring_bytes_per_layer)
from megaulysses.parallel.ulysses import UlyssesAttention, ulysses_bytes_per_layer  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ELEMENT_SIZE = 4  # fp32
KINDS = ("all_to_all", "ring")
CORES = {"auto": cpu_attention, "block": block_attention, "sdpa": sdpa_attention,
         "math": math_attention}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--parts", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    g = p.add_argument_group("part 1: Ulysses x Ring on P ranks")
    g.add_argument("--ranks", type=int, default=8, help="P = U * C")
    g.add_argument("--seq", type=int, default=4096, help="global sequence length S")
    g.add_argument("--heads", type=int, nargs="+", default=[8, 4], help="query heads, one run each")
    g.add_argument("--kv-heads", type=int, nargs="+", default=None,
                   help="kv heads per --heads entry (one value: for all); default = heads (MHA)")
    g.add_argument("--head-dim", type=int, default=64)
    g.add_argument("--batch", type=int, default=1)
    g.add_argument("--grid", nargs="+", default=None,
                   help="configurations as U<u>xC<c>, U<p> or C<p> (default: U<P>, C<P> and "
                        "every U<u>xC<c> with u, c > 1, u * c = P, u descending)")
    g.add_argument("--ulysses-cores", nargs="+", default=["auto", "block"], choices=list(CORES),
                   help="the plain cores of the Ulysses-only configuration (C = 1)")
    g.add_argument("--warmup", type=int, default=1, help="untimed reps first")
    g.add_argument("--reps", type=int, default=5, help="timed reps")
    g.add_argument("--tol", type=float, default=1e-4, help="max abs error vs the reference")
    g.add_argument("--timeout", type=float, default=3600,
                   help="seconds before giving up on the ranks")
    g = p.add_argument_group("part 2: dense vs window vs block-sparse, one process")
    g.add_argument("--sparse-seq", type=int, default=16384)
    g.add_argument("--sparse-heads", type=int, default=8)
    g.add_argument("--window", type=int, default=1024)
    g.add_argument("--sparse-warmup", type=int, default=1)
    g.add_argument("--sparse-reps", type=int, default=5)
    g.add_argument("--slow-s", type=float, default=60.0,
                   help="a variant whose warm-up takes longer is timed once")
    g.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--out-dir", default=os.path.join(REPO, "docs"),
                   help="writes attention_grid.md and .json here ('' : print only)")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)

    if args.kv_heads is None:
        args.kv_heads = list(args.heads)
    elif len(args.kv_heads) == 1:
        args.kv_heads = args.kv_heads * len(args.heads)
    if len(args.kv_heads) != len(args.heads):
        p.error("--kv-heads: one value, or one per --heads entry")
    for hq, hkv in zip(args.heads, args.kv_heads, strict=True):
        if hq % hkv:
            p.error(f"--kv-heads {hkv} must divide --heads {hq}")
    try:
        args.configs = parse_grid(args.grid, args.ranks)
    except ValueError as e:
        p.error(f"--grid: {e}")
    for U, C in args.configs:
        need = 2 * U * C if C > 1 else U
        if args.seq % need:
            p.error(f"--seq {args.seq} must be divisible by {need} for U{U}xC{C}")
    return args


def parse_grid(grid, P: int) -> list[tuple[int, int]]:
    """[(U, C)] with U * C = P."""
    if grid is None:
        hybrids = [(u, P // u) for u in range(P - 1, 1, -1) if P % u == 0]
        return [(P, 1), (1, P)] + hybrids
    out = []
    for item in grid:
        s = item.upper()
        u = c = 1
        for part in s.split("X"):
            if part[:1] == "U" and part[1:].isdigit():
                u = int(part[1:])
            elif part[:1] == "C" and part[1:].isdigit():
                c = int(part[1:])
            else:
                raise ValueError(f"cannot read {item!r} (U<u>xC<c>, U<p> or C<p>)")
        if u * c != P:
            raise ValueError(f"{item}: U * C = {u * c}, not --ranks {P}")
        out.append((u, c))
    return out


def config_name(U: int, C: int) -> str:
    return f"U{U}xC{C}" if U > 1 and C > 1 else (f"U{U}" if C == 1 else f"C{C}")


def config_rows(args) -> list[dict]:
    """Every (heads, configuration, core) row of part 1, with why it cannot run if so."""
    rows = []
    for hq, hkv in zip(args.heads, args.kv_heads, strict=True):
        for U, C in args.configs:
            cores = args.ulysses_cores if C == 1 else ["ring"]
            for core in cores:
                why = None
                if hq % U:
                    why = (f"n/a: {hq} heads < {U} ranks" if hq < U
                           else f"n/a: {hq} heads not divisible by U={U}")
                elif hkv % U and U % hkv:
                    why = f"n/a: {hkv} kv heads and U={U} do not divide one another"
                rows.append(dict(hq=hq, hkv=hkv, U=U, C=C, core=core, name=config_name(U, C),
                                 na=why))
    return rows


def row_key(r: dict) -> str:
    return f"h{r['hq']}/{r['hkv']} {r['name']} {r['core']}"


# -- formulas ---------------------------------------------------------------------------

def formula_bytes(r: dict, args) -> tuple[dict, dict]:
    """(forward, backward) bytes one rank sends per layer, by kind."""
    b, S, d, U, C = args.batch, args.seq, args.head_dim, r["U"], r["C"]
    fwd, bwd = {}, {}
    if U > 1:
        n = ulysses_bytes_per_layer(b, S // C, r["hq"], r["hkv"], d, U, ELEMENT_SIZE)
        fwd["all_to_all"] = bwd["all_to_all"] = n
    if C > 1:
        hkv_local = max(r["hkv"], U) // U
        fwd["ring"], bwd["ring"] = ring_bytes_per_layer(b, S, hkv_local, d, C, ELEMENT_SIZE)
    return fwd, bwd


# -- inputs and the single-process reference ----------------------------------------------

def make_inputs(args, hq: int, hkv: int):
    g = torch.Generator().manual_seed(args.seed + 131 * hq + hkv)
    b, S, d = args.batch, args.seq, args.head_dim
    return [torch.randn(b, S, h, d, generator=g) for h in (hq, hkv, hkv, hq)]  # q, k, v, dout


def reference(q, k, v, dout):
    """math_attention over the whole sequence, one kv head (and its q heads) at a time so
    that the [s, s] scores stay small: (out, dq, dk, dv)."""
    hkv = k.shape[2]
    rep = q.shape[2] // hkv
    outs = [[] for _ in range(4)]
    for g in range(hkv):
        qs = slice(g * rep, (g + 1) * rep)
        t = [q[:, :, qs].clone().requires_grad_(), k[:, :, g:g + 1].clone().requires_grad_(),
             v[:, :, g:g + 1].clone().requires_grad_()]
        out = math_attention(*t)
        grads = torch.autograd.grad(out, t, dout[:, :, qs])
        for acc, x in zip(outs, (out.detach(),) + grads, strict=True):
            acc.append(x)
    return [torch.cat(acc, dim=2) for acc in outs]


# -- part 1: one rank ---------------------------------------------------------------------

class TimedComm(Comm):
    """Comm that also adds up the wall time spent in its collectives: the all-to-all (with
    its packing) and waiting for ring passes."""

    def __init__(self, meshes):
        super().__init__(meshes)
        self.comm_s = 0.0

    def _all_to_all_raw(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return super()._all_to_all_raw(*a, **kw)
        finally:
            self.comm_s += time.perf_counter() - t0

    def ring_pass(self, tensors, dim):
        t0 = time.perf_counter()
        passing = super().ring_pass(tensors, dim)
        self.comm_s += time.perf_counter() - t0
        return _TimedPass(passing, self)


class _TimedPass:
    def __init__(self, passing, comm: TimedComm):
        self.passing, self.comm = passing, comm

    def wait(self):
        t0 = time.perf_counter()
        try:
            return self.passing.wait()
        finally:
            self.comm.comm_s += time.perf_counter() - t0


def build_core(r: dict, comm: Comm):
    core = RingAttention(comm, CP) if r["C"] > 1 else CORES[r["core"]]
    return UlyssesAttention(core, comm, SP) if r["U"] > 1 else core


def run_rank(rank: int, P: int, args, rows: list[dict], ref_path: str) -> dict:
    torch.set_num_threads(1)
    comms = {}
    for U, C in args.configs:  # every rank builds every mesh, in the same order
        comms[(U, C)] = TimedComm(build_mesh(ParallelDims(dp=1, tp=1, pp=1, sp=U, cp=C), "cpu"))
    refs = torch.load(ref_path)  # {(hq, hkv): (out, dq, dk, dv)} over the whole sequence
    inputs = {hh: make_inputs(args, *hh) for hh in refs}
    live = [r for r in rows if r["na"] is None]
    cases = []
    for r in live:
        comm = comms[(r["U"], r["C"])]
        mine = local_positions(args.seq, r["C"], comm.rank(CP), r["U"], comm.rank(SP))
        q, k, v, dout = inputs[(r["hq"], r["hkv"])]
        cases.append((r, comm, build_core(r, comm), mine,
                      [t[:, mine].clone() for t in (q, k, v, dout)]))
    res = {row_key(r): {"wall": [], "cpu": [], "comm": [], "fwd": None, "bwd": None,
                        "err_out": None, "err_grad": None} for r in live}
    for run in range(args.warmup + args.reps):
        for r, comm, core, mine, (q, k, v, dout) in cases:
            out = res[row_key(r)]
            local = [t.clone().requires_grad_() for t in (q, k, v)]
            comm.stats.pop()
            dist.barrier()
            comm.comm_s = 0.0
            c0, t0 = time.thread_time(), time.perf_counter()
            y = core(*local, 0.0, None)
            fwd = comm.stats.pop()
            grads = torch.autograd.grad(y, local, dout)
            bwd = comm.stats.pop()
            wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
            if run >= args.warmup:
                out["wall"].append(wall)
                out["cpu"].append(cpu)
                out["comm"].append(comm.comm_s)
            if out["fwd"] is not None and (fwd, bwd) != (out["fwd"], out["bwd"]):
                raise RuntimeError(f"{row_key(r)}: bytes differ between reps")
            out["fwd"], out["bwd"] = fwd, bwd
            if run == 0:
                ref = refs[(r["hq"], r["hkv"])]
                out["err_out"] = (y.detach() - ref[0][:, mine]).abs().max().item()
                out["err_grad"] = max((g - x[:, mine]).abs().max().item()
                                      for g, x in zip(grads, ref[1:], strict=True))
            del y, grads, local
    return res


def part1(args) -> dict:
    rows = config_rows(args)
    tmp = tempfile.mkdtemp(prefix="attention_grid_")
    try:
        t0 = time.perf_counter()
        refs = {}
        for hq, hkv in dict.fromkeys(zip(args.heads, args.kv_heads, strict=True)):
            refs[(hq, hkv)] = reference(*make_inputs(args, hq, hkv))
        ref_s = time.perf_counter() - t0
        ref_path = os.path.join(tmp, "reference.pt")
        torch.save(refs, ref_path)
        del refs
        print(f"part 1: reference (math_attention, one process) in {ref_s:.0f} s; "
              f"{args.ranks} ranks ...", flush=True)
        t0 = time.perf_counter()
        ranks = launch(run_rank, args.ranks, args, rows, ref_path, timeout=args.timeout)
        ranks_s = time.perf_counter() - t0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = []
    for r in rows:
        row = dict(r)
        row["fwd_formula"], row["bwd_formula"] = formula_bytes(r, args)
        if r["na"] is None:
            per = [rk[row_key(r)] for rk in ranks]
            reps = range(len(per[0]["wall"]))
            row["time_s"] = statistics.median(max(p["wall"][i] for p in per) for i in reps)
            row["time_range_s"] = (min(max(p["wall"][i] for p in per) for i in reps),
                                   max(max(p["wall"][i] for p in per) for i in reps))
            row["cpu_s"] = statistics.median(sum(p["cpu"][i] for p in per) for i in reps)
            row["comm_share"] = statistics.median(
                sum(p["comm"][i] for p in per) / sum(p["wall"][i] for p in per) for i in reps)
            row["fwd"] = max_per_kind(p["fwd"] for p in per)
            row["bwd"] = max_per_kind(p["bwd"] for p in per)
            row["bytes_equal_on_all_ranks"] = all(
                (p["fwd"], p["bwd"]) == (per[0]["fwd"], per[0]["bwd"]) for p in per)
            row["bytes"] = _total(row["fwd"]) + _total(row["bwd"])
            row["bytes_formula"] = _total(row["fwd_formula"]) + _total(row["bwd_formula"])
            row["bytes_match"] = (row["fwd"] == row["fwd_formula"]
                                  and row["bwd"] == row["bwd_formula"])
            row["bytes_ratio"] = (row["bytes"] / row["bytes_formula"]
                                  if row["bytes_formula"] else None)
            row["err_out"] = max(p["err_out"] for p in per)
            row["err_grad"] = max(p["err_grad"] for p in per)
        out.append(row)
    return {"rows": out, "reference_s": ref_s, "ranks_s": ranks_s}


def _total(d: dict) -> int:
    return sum(d.values())


# -- part 2 -----------------------------------------------------------------------------

def sparse_variants(args) -> list[tuple[str, str, AttentionMask]]:
    return [
        ("dense causal", "block", AttentionMask()),
        (f"window {args.window}", "block", AttentionMask(window=args.window)),
        ("fixed (64, local 4, global 1)", "block",
         AttentionMask(layout=SparseLayout("fixed", block=64, local=4, global_=1))),
        ("bigbird (64, local 3, global 1, random 2)", "block",
         AttentionMask(layout=SparseLayout("bigbird", 64, local=3, global_=1, random=2, seed=0))),
        ("dense causal", "sdpa", AttentionMask()),
    ]


def computed_fraction(mask: AttentionMask, S: int) -> tuple[int, int, float]:
    """(pairs of blocks computed, block size, fraction of dense causal's computed elements)."""
    layout_block = mask.layout.block if mask.layout is not None else None
    block = attention_block_size(S, layout_block=layout_block)
    pos = torch.arange(S)
    pairs = computed_pairs(mask, pos, pos, block)
    dense_block = attention_block_size(S)
    dense = computed_pairs(AttentionMask(), pos, pos, dense_block)
    return pairs, block, pairs * block ** 2 / (dense * dense_block ** 2)


def part2(args, log) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    S, h, d = args.sparse_seq, args.sparse_heads, args.head_dim
    g = torch.Generator().manual_seed(args.seed)
    q, k, v, dout = (torch.randn(1, S, h, d, generator=g) for _ in range(4))
    variants = sparse_variants(args)
    rows = []
    for name, kernel, mask in variants:
        row = {"mask": name, "kernel": kernel, "wall": [], "cpu": [], "note": ""}
        if kernel == "block":
            row["pairs"], row["block"], row["fraction"] = computed_fraction(mask, S)
        else:
            row["pairs"], row["block"], row["fraction"] = None, None, 1.0
        rows.append(row)
    first = {}
    warm = {}  # variant -> its fastest warm-up
    slow = set()  # variants timed once: warm-up and first rep both over --slow-s
    for run in range(args.sparse_warmup + args.sparse_reps):
        for i, (name, kernel, mask) in enumerate(variants):
            if i in slow:
                continue
            local = [t.clone().requires_grad_() for t in (q, k, v)]
            c0, t0 = time.process_time(), time.perf_counter()
            if kernel == "block":
                y = masked_block_attention(*local, mask)
            else:
                y = sdpa_attention(*local)
            grads = torch.autograd.grad(y, local, dout)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            what = "warm-up" if run < args.sparse_warmup else f"rep {run - args.sparse_warmup + 1}"
            log(f"  part 2 {what}: {name} [{kernel}] {wall:.1f} s")
            if run < args.sparse_warmup:
                warm[i] = min(wall, warm.get(i, wall))
            else:
                rows[i]["wall"].append(wall)
                rows[i]["cpu"].append(cpu)
                if (run == args.sparse_warmup and args.sparse_reps > 1
                        and min(wall, warm.get(i, wall)) > args.slow_s):
                    slow.add(i)
                    rows[i]["note"] = (f"over {args.slow_s:.0f} s per iteration (warm-up "
                                       f"{warm.get(i, wall):.0f} s, first rep {wall:.0f} s): "
                                       "timed once")
            if name == "dense causal" and kernel not in first:
                first[kernel] = [y.detach()] + list(grads)
            del y, grads, local
    for row in rows:
        row["time_s"] = statistics.median(row["wall"])
        row["min_s"] = min(row["wall"])
        row["time_range_s"] = (min(row["wall"]), max(row["wall"]))
        row["cpu_s"] = statistics.median(row["cpu"])
    dense, dense_min = rows[0]["time_s"], rows[0]["min_s"]
    for row in rows:
        row["time_ratio"] = row["time_s"] / dense
        row["min_ratio"] = row["min_s"] / dense_min
        row["time_per_fraction"] = row["time_ratio"] / row["fraction"]
        row["min_per_fraction"] = row["min_ratio"] / row["fraction"]
    a, b = first["block"], first["sdpa"]
    check = {"out": (a[0] - b[0]).abs().max().item(),
             "grads": max((x - y).abs().max().item() for x, y in zip(a[1:], b[1:], strict=True))}
    return {"rows": rows, "seq": S, "heads": h, "head_dim": d, "threads": torch.get_num_threads(),
            "block_vs_sdpa": check}


# -- report -------------------------------------------------------------------------------

def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cores": len(os.sched_getaffinity(0)), "cpu": cpu, "torch": torch.__version__,
            "python": platform.python_version()}


def report(res: dict, args) -> str:
    m = res["machine"]
    lines = ["# Ulysses x Ring and sparse attention (benchmarks/attention_grid.py)", "",
             provenance("python benchmarks/attention_grid.py", "every figure measured on "
                        f"{args.ranks} gloo ranks on this CPU."), "",
             f"{res['date']}; {m['cores']} CPU cores ({m['cpu']}), torch {m['torch']}; "
             f"load average {res['load_start'][0]:.1f} at start, {res['load_end'][0]:.1f} "
             "at end (other processes share the cores).", ""]
    if "part1" in res:
        p1 = res["part1"]
        lines += [
            f"## Part 1: one attention layer on P={args.ranks} gloo ranks", "",
            f"Core between the exchanges only (q, k, v already projected), causal, fp32, "
            f"b={args.batch}, S={args.seq}, d={args.head_dim}, forward + backward. "
            f"Time: slowest rank per rep, median of {args.reps} after {args.warmup} warm-up "
            f"(min-max in brackets); {args.ranks} single-thread ranks share "
            f"{m['cores']} cores, so wall time measures the total work more than the "
            "parallel speed. CPU s: main-thread CPU seconds summed over ranks. In comm: "
            "share of wall time inside the collectives (including waits for slower peers). "
            "Bytes: sent per rank per layer, forward + backward, measured (comm.stats) / "
            "formula. Error: max |diff| vs single-process math_attention (out; dq, dk, dv).",
            ""]
        header = ["heads (kv)", "config", "core", "time s", "time vs C%d" % args.ranks, "CPU s",
                  "in comm", "a2a bytes", "ring bytes", "bytes vs C%d" % args.ranks,
                  "measured / formula",
                  "max err out", "max err grads"]
        body = []
        base = {}  # (hq, hkv) -> the ring-only row: every head count has one
        for r in p1["rows"]:
            if r["na"] is None and r["U"] == 1:
                base[r["hq"], r["hkv"]] = r
        for r in p1["rows"]:
            core = {"auto": "auto (cpu_attention)", "ring": "ring (block kernel)"}.get(
                r["core"], r["core"])
            head = f"{r['hq']} ({r['hkv']})"
            if r["na"] is not None:
                body.append([head, r["name"], core, r["na"]] + [""] * (len(header) - 4))
                continue
            kinds = {k: r["fwd"].get(k, 0) + r["bwd"].get(k, 0) for k in KINDS}
            b0 = base.get((r["hq"], r["hkv"]))
            body.append([head, r["name"], core,
                         f"{r['time_s']:.2f} ({r['time_range_s'][0]:.2f}-"
                         f"{r['time_range_s'][1]:.2f})",
                         f"{r['time_s'] / b0['time_s']:.2f}" if b0 else "-",
                         f"{r['cpu_s']:.2f}", f"{100 * r['comm_share']:.0f}%",
                         f"{kinds['all_to_all']:,}" if kinds["all_to_all"] else "-",
                         f"{kinds['ring']:,}" if kinds["ring"] else "-",
                         f"{r['bytes'] / b0['bytes']:.3f}" if b0 else "-",
                         f"{r['bytes_ratio']:.3f}" + ("" if r["bytes_match"] else " MISMATCH"),
                         f"{r['err_out']:.1e}", f"{r['err_grad']:.1e}"])
        lines += [table(header, body), ""]
        lines.append("Bytes by kind and pass (measured = formula, integers):")
        body = []
        for r in p1["rows"]:
            if r["na"] is not None:
                continue
            for kind in KINDS:
                if kind in r["fwd_formula"] or kind in r["fwd"]:
                    body.append([f"{r['hq']} ({r['hkv']})", r["name"], r["core"], kind,
                                 f"{r['fwd'].get(kind, 0):,}", f"{r['fwd_formula'].get(kind, 0):,}",
                                 f"{r['bwd'].get(kind, 0):,}",
                                 f"{r['bwd_formula'].get(kind, 0):,}"])
        lines += ["", table(["heads (kv)", "config", "core", "kind", "forward", "formula",
                             "backward", "formula"], body), ""]
        lines.append(f"reference {p1['reference_s']:.0f} s; ranks {p1['ranks_s']:.0f} s "
                     "(spawn, meshes, all reps)")
        lines.append("")
    if "part2" in res:
        p2 = res["part2"]
        lines += [
            f"## Part 2: dense vs window vs block-sparse, one process ({p2['threads']} threads)",
            "",
            f"masked_block_attention (and SDPA for dense causal), b=1, S={p2['seq']}, "
            f"{p2['heads']} heads, d={p2['head_dim']}, fp32, forward + backward; time: "
            f"median over reps after {args.sparse_warmup} warm-up, variants interleaved, and "
            "the min (other processes only ever add time: the min is the least disturbed rep); "
            "CPU s: "
            "process CPU time, median; computed: (query, key) elements of the blocks the "
            "kernel computes (computed_pairs x block^2) over dense causal's.", ""]
        body = []
        for r in p2["rows"]:
            body.append([r["mask"], r["kernel"], f"{r['time_s']:.2f}", f"{r['min_s']:.2f}",
                         f"{r['time_range_s'][1]:.2f}", len(r["wall"]), f"{r['cpu_s']:.1f}",
                         f"{r['time_ratio']:.3f}", f"{r['min_ratio']:.3f}",
                         f"{r['pairs']:,}" if r["pairs"] is not None else "-",
                         f"{r['fraction']:.3f}", f"{r['min_per_fraction']:.2f}"])
        lines.append(table(["mask", "kernel", "median s", "min s", "max s", "reps", "CPU s",
                            "median / dense block", "min / dense block", "block pairs",
                            "computed fraction", "(min / dense) / fraction"], body))
        lines.append("")
        chk = p2["block_vs_sdpa"]
        lines.append(f"dense causal, block kernel vs SDPA: max |diff| out {chk['out']:.1e}, "
                     f"grads {chk['grads']:.1e}")
        for r in p2["rows"]:
            if r["note"]:
                lines.append(f"{r['mask']} [{r['kernel']}]: {r['note']}")
        lines.append("")
    lines.append(f"total wall time: {res['wall_s']:.0f} s")
    return "\n".join(lines)


def problems(res: dict, args) -> list[str]:
    bad = []
    for r in res.get("part1", {}).get("rows", []):
        if r["na"] is not None:
            continue
        if not r["bytes_match"]:
            bad.append(f"{row_key(r)}: bytes {r['fwd']}/{r['bwd']} != formula "
                       f"{r['fwd_formula']}/{r['bwd_formula']}")
        if not r["bytes_equal_on_all_ranks"]:
            bad.append(f"{row_key(r)}: ranks sent different bytes")
        if not (r["err_out"] < args.tol and r["err_grad"] < args.tol):
            bad.append(f"{row_key(r)}: error {r['err_out']:.1e} / {r['err_grad']:.1e} "
                       f">= {args.tol}")
    return bad


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    res = {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "machine": machine(),
           "load_start": os.getloadavg(), "args": {k: v for k, v in vars(args).items()}}
    if 1 in args.parts:
        res["part1"] = part1(args)
        log(f"part 1 done in {time.perf_counter() - start:.0f} s")
    if 2 in args.parts:
        t0 = time.perf_counter()
        res["part2"] = part2(args, log)
        log(f"part 2 done in {time.perf_counter() - t0:.0f} s")
    res["load_end"] = os.getloadavg()
    res["wall_s"] = time.perf_counter() - start
    text = report(res, args)
    print()
    print(text)
    bad = problems(res, args)
    if bad:
        print("\nFAILED (nothing written):\n" + "\n".join(bad))
        return 1
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        md, js = (os.path.join(args.out_dir, "attention_grid" + ext) for ext in (".md", ".json"))
        with open(md, "w") as f:
            f.write(text + "\n")
        with open(js, "w") as f:
            json.dump(res, f, indent=1, default=_json_default)
        print(f"wrote {md} and {js}")
    return 0


def _json_default(x):
    if isinstance(x, tuple):
        return list(x)
    return str(x)


if __name__ == "__main__":
    sys.exit(main())
