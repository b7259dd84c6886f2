"""Sequence parallelism for one attention layer: Ulysses (ours) vs Megatron-SP vs DeepSpeed.

One causal multi-head attention layer, b=1, S=8192, h=1024, 16 heads of 64, fp32, runs
forward and backward on P = 2, 4, 8 gloo ranks (spawned processes on 127.0.0.1, one torch
thread each), three ways:

    ulysses      megaulysses.parallel.ulysses.UlyssesAttention around sdpa_attention.
                 Each rank projects its own S/P tokens with the full h x h weights, an
                 all-to-all per q, k, v trades sequence for heads, attention runs over the
                 whole sequence for heads/P heads, an all-to-all trades back, then the
                 output projection (full weights, own tokens).
    megatron-sp  Megatron-LM's sequence parallelism inside a tensor-parallel group of P:
                 all-gather the sequence ([b, S/P, h] -> [b, S, h]), column-parallel q/k/v
                 (h -> h/P: this rank's heads), sdpa_attention over the whole sequence,
                 row-parallel output projection (h/P -> h, partial sums), reduce-scatter
                 back to [b, S/P, h]. Collectives from megaulysses.parallel.comm.
    deepspeed    deepspeed.sequence.layer.DistributedAttention around sdpa_attention, with
                 the same projections as ulysses. Skipped (with a note) when DeepSpeed is not
                 importable; it is not a project requirement.

Timed scope, identical for all three: q/k/v projections + communication + attention core +
output projection, forward and backward (the weights' and the input's gradients). All three
compute the same function from the same weights, so their outputs are compared too.

Bytes are what one rank sends (megaulysses.parallel.comm's convention: the chunk a rank
keeps is not counted). ulysses and megatron-sp: `comm.stats.pop()` after forward and after
backward. deepspeed calls torch.distributed directly, so this script wraps
`torch.distributed.all_to_all_single` and counts input bytes minus the chunk kept (input
bytes * (P-1)/P for its even splits); the same wrapper sees ulysses' all-to-alls too, which
cross-checks comm.stats against the wire. Theory, per layer, forward (backward the same):
    ulysses, deepspeed  ulysses_bytes_per_layer(b, S, hq, hkv, d, P, 4)
                        = 4 b S h 4 (P-1)/P^2 for MHA (q, k, v, out)
    megatron-sp         half of megatron_sp_bytes_per_layer(b, S, h, P, 4): that function
                        counts a whole transformer layer (attention and MLP: two
                        all-gathers, two reduce-scatters); an attention-only layer has one of
                        each, b S h 4 (P-1)/P bytes apiece.
So ours/megatron-sp bytes = 2/P: equal at P=2, half at P=4, a quarter at P=8.

Time per layer: each rep starts at a barrier; a rep's time is the slowest rank's forward +
backward; the reported time is the median over --reps reps after --warmup warm-ups. Methods
are interleaved within each rep so that load from other processes hits all alike. With P
ranks on fewer cores (2 here) the time mostly measures oversubscription, not the methods.

    python benchmarks/sequence_parallel.py                              # the full default
    python benchmarks/sequence_parallel.py --seq 2048 --ranks 2 4       # a quicker one
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import launch, max_per_kind, table  # noqa: E402

from megaulysses.model.attention import sdpa_attention  # noqa: E402
from megaulysses.parallel.comm import Comm  # noqa: E402
from megaulysses.parallel.dims import ParallelDims, build_mesh  # noqa: E402
from megaulysses.parallel.tensor import megatron_sp_bytes_per_layer  # noqa: E402
from megaulysses.parallel.ulysses import UlyssesAttention, ulysses_bytes_per_layer  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ("ulysses", "megatron-sp", "deepspeed")
ELEMENT_SIZE = 4  # fp32


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seq", type=int, default=8192, help="global sequence length S")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8], help="values of P")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per method first")
    p.add_argument("--reps", type=int, default=5, help="timed runs per method")
    p.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed column")
    p.add_argument("--plot", default=os.path.join(REPO, "docs", "sequence_parallel_bytes.png"),
                   help="PNG of bytes per rank vs P; '' for none")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per P before giving up")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    if args.hidden % args.heads:
        p.error("--hidden must be divisible by --heads")
    for P in args.ranks:
        if args.heads % P or args.seq % P:
            p.error(f"--heads and --seq must be divisible by every P (got P={P})")
    return args


# -- theory ---------------------------------------------------------------------------

def theory(method: str, args, P: int) -> tuple[dict, dict]:
    """(forward, backward) bytes one rank sends per layer, by collective kind."""
    b, S, h, heads = args.batch, args.seq, args.hidden, args.heads
    if method == "megatron-sp":
        layer = megatron_sp_bytes_per_layer(b, S, h, P, ELEMENT_SIZE)  # attention + MLP
        fwd = {kind: n // 2 for kind, n in layer.items()}  # attention only: one of each
        bwd = {"all_gather": fwd["reduce_scatter"], "reduce_scatter": fwd["all_gather"]}
        return fwd, bwd
    n = ulysses_bytes_per_layer(b, S, heads, heads, h // heads, P, ELEMENT_SIZE)
    return {"all_to_all": n}, {"all_to_all": n}


# -- counting torch.distributed.all_to_all_single (for DeepSpeed) ---------------------

WIRE: dict = {}  # kind -> bytes this process sent since the last pop_wire()


def _install_all_to_all_counter():
    real = dist.all_to_all_single

    def counted(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                async_op=False):
        P = dist.get_world_size(group)
        nbytes = input.numel() * input.element_size()
        if input_split_sizes:  # uneven: everything but the rows this rank keeps
            kept = input_split_sizes[dist.get_rank(group)] * nbytes // input.shape[0]
        else:
            kept = nbytes // P
        WIRE["all_to_all"] = WIRE.get("all_to_all", 0) + nbytes - kept
        return real(output, input, output_split_sizes, input_split_sizes, group=group,
                    async_op=async_op)

    dist.all_to_all_single = counted


def pop_wire() -> dict:
    out = dict(WIRE)
    WIRE.clear()
    return out


# -- the three layers -----------------------------------------------------------------

def projected_attention(x, w, attention, heads: int):
    """ulysses / deepspeed: own tokens, full weights. x [b, S/P, h] -> [b, S/P, h]."""
    b, s, h = x.shape
    q, k, v = (F.linear(x, w[name]).view(b, s, heads, h // heads) for name in "qkv")
    out = attention(q, k, v)  # [b, S/P, heads, d]
    return F.linear(out.reshape(b, s, h), w["o"])


def megatron_sp_attention(x, w_shard, comm: Comm, heads_local: int):
    """megatron-sp: x [b, S/P, h] -> all-gather -> this rank's heads -> reduce-scatter."""
    full = comm.all_gather(x, "sp", gather_dim=1)  # [b, S, h]
    b, S, _ = full.shape
    d = w_shard["q"].shape[0] // heads_local
    q, k, v = (F.linear(full, w_shard[name]).view(b, S, heads_local, d) for name in "qkv")
    out = sdpa_attention(q, k, v)  # [b, S, heads/P, d]
    partial = F.linear(out.reshape(b, S, heads_local * d), w_shard["o"])  # [b, S, h] summands
    return comm.reduce_scatter(partial, "sp", scatter_dim=1)  # [b, S/P, h]


def _import_deepspeed():
    """DistributedAttention, or the reason it is unavailable."""
    try:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import logging
        import deepspeed
        from deepspeed.sequence.layer import DistributedAttention
        deepspeed.utils.logger.setLevel(logging.ERROR)
        deepspeed.init_distributed(dist_backend="gloo")  # wraps the running process group
        return DistributedAttention, None
    except Exception as e:  # ImportError, or a DeepSpeed that fails on this machine
        return None, f"{type(e).__name__}: {e}".splitlines()[0]


# -- one rank ---------------------------------------------------------------------------

def run_rank(rank: int, P: int, args) -> dict:
    _install_all_to_all_counter()
    comm = Comm(build_mesh(ParallelDims(dp=1, tp=1, pp=1, sp=P), "cpu"))
    b, S, h, heads = args.batch, args.seq, args.hidden, args.heads
    s = S // P

    torch.manual_seed(args.seed)  # the same global tensors on every rank
    x_full = torch.randn(b, S, h)
    grad_full = torch.randn(b, S, h)
    weights = {name: torch.randn(h, h) / h ** 0.5 for name in "qkvo"}
    x = x_full[:, rank * s:(rank + 1) * s].clone()
    grad_y = grad_full[:, rank * s:(rank + 1) * s].clone()
    del x_full, grad_full

    cols = slice(rank * h // P, (rank + 1) * h // P)  # this rank's heads under megatron-sp
    w_full = {n: t.clone().requires_grad_() for n, t in weights.items()}
    w_shard = {n: (t[:, cols] if n == "o" else t[cols]).clone().requires_grad_()
               for n, t in weights.items()}

    ulysses = UlyssesAttention(sdpa_attention, comm, "sp")
    layers = {  # method -> (x -> y, the parameters it trains)
        "ulysses": (lambda x: projected_attention(x, w_full, ulysses, heads), w_full),
        "megatron-sp": (lambda x: megatron_sp_attention(x, w_shard, comm, heads // P), w_shard),
    }
    ds_error = "disabled by --no-deepspeed"
    if not args.no_deepspeed:
        DistributedAttention, ds_error = _import_deepspeed()
        if DistributedAttention is not None:
            # [b, s, heads, d] layout: batch_dim_idx=0, scatter heads (2), gather sequence (1)
            ds = DistributedAttention(sdpa_attention, comm.group("sp"), scatter_idx=2,
                                      gather_idx=1)
            layers["deepspeed"] = (lambda x: projected_attention(
                x, w_full, lambda q, k, v: ds(q, k, v, 0), heads), w_full)
    torch.set_num_threads(1)  # again, after the imports: one thread per rank

    result = {"times": {m: [] for m in layers}, "fwd": {}, "bwd": {}, "diff": {},
              "wire_ours": None, "ds_error": None if "deepspeed" in layers else ds_error,
              "threads": torch.get_num_threads()}
    first = {}  # method -> (y, dx) of its first run, for the cross-method comparison
    for run in range(args.warmup + args.reps):
        for method, (layer, params) in layers.items():
            xr = x.clone().requires_grad_()
            for t in params.values():
                t.grad = None
            comm.stats.pop(), pop_wire()
            dist.barrier()
            t0 = time.perf_counter()
            y = layer(xr)
            fwd, fwd_wire = comm.stats.pop(), pop_wire()
            y.backward(grad_y)
            bwd, bwd_wire = comm.stats.pop(), pop_wire()
            elapsed = time.perf_counter() - t0
            if method == "deepspeed":  # it bypasses comm: the wire counter is its ledger
                fwd, bwd = fwd_wire, bwd_wire
            elif method == "ulysses":
                result["wire_ours"] = (fwd_wire, bwd_wire)
            if run >= args.warmup:
                result["times"][method].append(elapsed)
            if method in result["fwd"] and (fwd, bwd) != (result["fwd"][method],
                                                         result["bwd"][method]):
                raise RuntimeError(f"{method}: bytes differ between runs")
            result["fwd"][method], result["bwd"][method] = fwd, bwd
            if method not in first:
                first[method] = (y.detach(), xr.grad)
    y0, dx0 = first["ulysses"]
    for method, (y1, dx1) in first.items():
        result["diff"][method] = ((y1 - y0).abs().max().item(), (dx1 - dx0).abs().max().item())
    return result


# -- summary ----------------------------------------------------------------------------

def summarize(P: int, ranks: list[dict], args) -> dict:
    """Per method: bytes (the most any rank sent), theory, median time, output diffs."""
    rows = {}
    for method in ranks[0]["times"]:
        reps = [max(r["times"][method][i] for r in ranks) for i in range(args.reps)]
        fwd = max_per_kind(r["fwd"][method] for r in ranks)
        bwd = max_per_kind(r["bwd"][method] for r in ranks)
        fwd_theory, bwd_theory = theory(method, args, P)
        rows[method] = {
            "fwd": fwd, "bwd": bwd, "fwd_theory": fwd_theory, "bwd_theory": bwd_theory,
            "match": fwd == fwd_theory and bwd == bwd_theory,
            "time": statistics.median(reps), "time_range": (min(reps), max(reps)),
            "diff": tuple(max(r["diff"][method][i] for r in ranks) for i in (0, 1)),
        }
    wire_ok = all(r["wire_ours"] == (r["fwd"]["ulysses"], r["bwd"]["ulysses"]) for r in ranks)
    return {"rows": rows, "wire_ok": wire_ok, "ds_error": ranks[0]["ds_error"],
            "threads": sorted({r["threads"] for r in ranks})}


def report(results: dict, args, wall: float) -> str:
    cores = len(os.sched_getaffinity(0))
    lines = [
        f"Sequence-parallel attention layer: b={args.batch} S={args.seq} h={args.hidden} "
        f"heads={args.heads} d={args.hidden // args.heads} fp32 causal, sdpa core, gloo",
        "timed (all methods alike): q/k/v projections + communication + attention core + "
        "output projection, forward + backward;",
        f"time = median of {args.reps} reps after {args.warmup} warm-up, slowest rank per rep.",
        f"{cores} CPU cores, 1 thread per rank: with P > {cores} ranks the time mostly "
        "measures oversubscription, not the method.",
        "bytes: sent per rank per layer; measured (theory); megatron-sp theory = half of "
        "megatron_sp_bytes_per_layer (one all-gather + one reduce-scatter: attention only).",
        "",
    ]
    rows = []
    for P, res in results.items():
        for method, r in res["rows"].items():
            rows.append([P, method, _bytes_cell(r["fwd"], r["fwd_theory"]),
                         _bytes_cell(r["bwd"], r["bwd_theory"]), "yes" if r["match"] else "NO",
                         f"{r['time'] * 1e3:.0f} ({r['time_range'][0] * 1e3:.0f}-"
                         f"{r['time_range'][1] * 1e3:.0f})",
                         "-" if method == "ulysses" else
                         f"{r['diff'][0]:.1e} / {r['diff'][1]:.1e}"])
    lines.append(table(["P", "method", "forward bytes", "backward bytes", "bytes = theory",
                        "time ms (min-max)", "max |diff| vs ours (y / dx)"], rows))
    lines += ["", "ratios (bytes: forward + backward):"]
    rows = []
    for P, res in results.items():
        r = res["rows"]
        rows.append([P] + [_ratio(r, "ulysses", other, what)
                           for other in ("megatron-sp", "deepspeed") for what in ("bytes", "time")])
    lines.append(table(["P", "bytes ours/megatron-sp", "time ours/megatron-sp",
                        "bytes ours/deepspeed", "time ours/deepspeed"], rows))
    lines.append("")
    first = next(iter(results.values()))
    if first["ds_error"]:
        lines.append(f"deepspeed: skipped ({first['ds_error']})")
    else:
        lines.append("deepspeed: DistributedAttention, [b, s, heads, d] (batch_dim_idx=0, "
                     "scatter_idx=2, gather_idx=1); bytes counted at "
                     "torch.distributed.all_to_all_single")
    wire = all(res["wire_ok"] for res in results.values())
    lines.append("ours: comm.stats all-to-all bytes == bytes counted at "
                 f"torch.distributed.all_to_all_single: {'yes' if wire else 'NO'}")
    threads = sorted({t for res in results.values() for t in res["threads"]})
    lines.append(f"torch threads per rank: {threads}")
    lines.append(f"total wall time: {wall:.0f} s")
    return "\n".join(lines)


def _bytes_cell(measured: dict, expected: dict) -> str:
    return f"{sum(measured.values())} ({sum(expected.values())})"


def _ratio(rows: dict, a: str, b: str, what: str) -> str:
    if a not in rows or b not in rows:
        return "-"
    if what == "time":
        return f"{rows[a]['time'] / rows[b]['time']:.2f}"
    total = lambda r: sum(r["fwd"].values()) + sum(r["bwd"].values())  # noqa: E731
    return f"{total(rows[a]) / total(rows[b]):.3f}"


# -- plot -------------------------------------------------------------------------------

def plot(results: dict, args, path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Ps = sorted(results)
    grid = list(range(min(Ps), max(Ps) + 1))
    mb = lambda fb: (sum(fb[0].values()) + sum(fb[1].values())) / 1e6  # noqa: E731
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    style = {"ulysses": ("tab:blue", "o", 9), "megatron-sp": ("tab:orange", "s", 8),
             "deepspeed": ("tab:green", "x", 9)}
    for method in ("ulysses", "megatron-sp"):
        color = style[method][0]
        ax.plot(grid, [mb(theory(method, args, P)) for P in grid], "-", color=color,
                label=f"{method} theory")
    for method, (color, marker, size) in style.items():
        pts = [(P, results[P]["rows"][method]) for P in Ps if method in results[P]["rows"]]
        if pts:
            ax.plot([P for P, _ in pts], [mb((r["fwd"], r["bwd"])) for _, r in pts], marker,
                    color=color, markersize=size, fillstyle="none" if marker != "x" else "full",
                    linestyle="none", label=f"{method} measured")
    ax.set_xscale("log", base=2)
    ax.set_xticks(Ps, [str(P) for P in Ps])
    ax.set_xlabel("P (ranks)")
    ax.set_ylabel("MB sent per rank per layer (forward + backward)")
    ax.set_title(f"One causal attention layer, b={args.batch} S={args.seq} h={args.hidden} "
                 f"heads={args.heads} fp32", fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    start = time.perf_counter()
    results = {}
    for P in args.ranks:
        t0 = time.perf_counter()
        results[P] = summarize(P, launch(run_rank, P, args, timeout=args.timeout), args)
        print(f"P={P} done in {time.perf_counter() - t0:.0f} s", flush=True)
    print()
    print(report(results, args, time.perf_counter() - start))
    if args.plot:
        try:
            plot(results, args, args.plot)
            print(f"plot: {args.plot}")
        except ImportError as e:
            print(f"plot: skipped ({e})")
    bad = [(P, m) for P, res in results.items() for m, r in res["rows"].items() if not r["match"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
