"""The longest sequence per cluster, from the planner: issue 40's targets (Llama-3-8B on 1,
8 and 32 H100, the planner's own search over every grid), then Llama-3-8B's shape and the
paper's 7B/30B shapes on 8, 32 and 64 H100 or A100-80GB, beside ALST's, UPipe's and
FPDT's published numbers, with where each GiB goes at the limit.

    python benchmarks/long_context_frontier.py                  # ~8 min; writes docs/long_context_frontier.md
    python benchmarks/long_context_frontier.py --targets-only --out ''   # ~5 min, print only

The targets' grids are checked at small scale: the same grid flags (Ulysses and ring
degrees, ZeRO stage, parameters on the host, recomputation, MLP tiles, offloaded layers,
head groups) and the same head layout (32 query, 8 kv heads) on a 2-layer model of hidden
512 at 8K tokens a rank, run as one rank of the same world on torch's fake process group
(benchmarks/fake_rank.py: the real trainer and step, shapes only) and as a fake CUDA rank
(training/fake_cuda.py: CUDA's kernels and what autograd saves for them), each measured
peak beside the plan's for the same flags and device.

For the per-cluster tables the grid is Ulysses over as many ranks as the heads allow (sp),
ring attention over the rest (cp), tp = pp = dp = 1, one sample of S tokens; the planner
(planner/search.py) walks its recomputation levels (full recomputation, the tiled MLP,
activation offload of as many layers as the host holds, head groups, FPDT) and ZeRO
stages for the fastest setting that fits the GPU less 4 GiB. The longest S: doubled from
128K (the targets: from the target) while some setting fits, then bisected to a multiple
of 128K. The paper's 7B and 30B (GPT-2 blocks in the paper) are planned
with Llama blocks (RoPE, RMSNorm, SwiGLU at 8/3 h): a learned position table of S rows
would itself be S*h parameters (4.3B at 1M tokens for h 4096).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import provenance  # noqa: E402
from megaulysses.config import parse_args  # noqa: E402
from megaulysses.hardware import gpu_spec  # noqa: E402
from megaulysses.planner.memory import plan_memory  # noqa: E402
from megaulysses.planner.search import configure, search  # noqa: E402

GIB, MIB, K = 2 ** 30, 2 ** 20, 1024
LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--disable-bias-linear", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--untie-embeddings-and-output-weights", "--bf16", "--tokenizer-type",
         "NullTokenizer", "--mock-data", "--global-batch-size", "1", "--micro-batch-size", "1"]
MODELS = {  # name: (layers, hidden, heads, kv heads, ffn, vocab)
    "Llama-3-8B": (32, 4096, 32, 8, 14336, 128256),
    "paper 7B": (32, 4096, 32, 32, 11008, 50257),
    "paper 30B": (64, 6144, 64, 64, 16384, 50257),
}
CLUSTERS = [(8, "H100"), (32, "H100"), (64, "H100"), (8, "A100-80GB"), (32, "A100-80GB"),
            (64, "A100-80GB")]
PUBLISHED = [  # (system, model, GPUs, tokens): the figures issues 24 and 40 quote
    ("DeepSpeed ALST", "Llama-3-8B", "1 x H100-80GB", 0.5e6),
    ("DeepSpeed ALST", "Llama-3-8B", "8 x H100-80GB", 3.7e6),
    ("Together UPipe (Feb 2026)", "Llama-3-8B", "8 x H100-80GB", 5e6),
    ("DeepSpeed ALST", "Llama-3-8B", "32 x H100-80GB", 15e6),
    ("FPDT (Ulysses-Offload)", "8B", "4 x A100-40GB", 2e6),
]
STEP = 128 * K


def model_flags(name: str, seq: int) -> list:
    layers, hidden, heads, kv, ffn, vocab = MODELS[name]
    out = ["--num-layers", str(layers), "--hidden-size", str(hidden),
           "--num-attention-heads", str(heads), "--ffn-hidden-size", str(ffn),
           "--vocab-size", str(vocab), "--seq-length", str(seq),
           "--max-position-embeddings", str(seq)] + LLAMA
    if kv != heads:
        out += ["--group-query-attention", "--num-query-groups", str(kv)]
    return out


def shape(name: str, gpus: int) -> dict:
    """Ulysses over the most ranks the heads allow, ring attention over the rest."""
    heads = MODELS[name][2]
    sp = max(d for d in range(1, gpus + 1) if gpus % d == 0 and heads % d == 0)
    return dict(tp=1, pp=1, sp=sp, cp=gpus // sp, micro_batch=1)


def fastest(name: str, gpus: int, gpu, seq: int, extra: tuple = ()):
    """The fastest fitting Candidate at `seq` (with the flags `extra`), or None."""
    cfg = parse_args(model_flags(name, seq) + list(extra))
    cfg = replace(cfg, model=replace(cfg.model, vocab_size=MODELS[name][5]))  # NullTokenizer's
    result = search(cfg, gpus, gpu, shape(name, gpus))
    return (result.ranked[0], cfg) if result.ranked else (None, cfg)


def longest(name: str, gpus: int, gpu, extra: tuple = (), find=None, start: int = STEP
            ) -> tuple:
    """(S, (Candidate, base config)) of the longest S (a multiple of STEP) that fits:
    doubled from `start`, then bisected. `find(seq)`: (Candidate or None, config), by
    default `fastest` on the Ulysses-first shape."""
    find = find or (lambda seq: fastest(name, gpus, gpu, seq, extra))
    fit, miss, best = 0, None, None
    seq = start
    while miss is None and seq <= 2 ** 28:
        c, cfg = find(seq)
        if c is None:
            miss = seq
        else:
            fit, best = seq, (c, cfg)
            seq *= 2
    while miss is not None and miss - fit > STEP:
        mid = (fit + miss) // 2 // STEP * STEP
        c, cfg = find(mid)
        if c is None:
            miss = mid
        else:
            fit, best = mid, (c, cfg)
    return fit, best


# Issue 40's targets: (H100s, tokens), Llama-3-8B, beside what was measured elsewhere
TARGETS = ((1, 512 * K, "ALST 500K"), (8, 6 * 2 ** 20, "UPipe 5M, ALST 3.7M"),
           (32, 24 * 2 ** 20, "ALST 15M"))


def planned(gpus: int, seq: int, host_gib=None, **gpu) -> tuple:
    """(the fastest fitting Candidate or None, base config): Llama-3-8B at `seq` tokens on
    `gpus` H100, the planner's own search over every grid, offload, chunking and
    optimizer option (as `tools/plan.py --gpus N --gpu H100` with the model's flags)."""
    cfg = parse_args(model_flags("Llama-3-8B", seq))
    cfg = replace(cfg, model=replace(cfg.model, vocab_size=MODELS["Llama-3-8B"][5]))
    result = search(cfg, gpus, gpu_spec("H100", host_memory_gib=host_gib, **gpu))
    return (result.ranked[0], cfg) if result.ranked else (None, cfg)


ONE_GPU_MACHINE = dict(gpus_per_node=1)  # a machine of one GPU with a GPU's share of host


def headline_rows() -> tuple[list, dict]:
    """The targets' table (each the longest the search fits, from the target up; one GPU
    also on a one-GPU machine) and {gpus: the target's grid}."""
    rows = ["| H100s | target (measured elsewhere) | longest planned | grid (the planner's "
            "fastest there) | device GiB (usable) | free GiB (margin kept) | host GiB "
            "(usable) | tokens/s | MFU |", "|---|---|---|---|---|---|---|---|---|"]
    grids = {}
    for gpus, target, peers, gpu in [(*t, {}) for t in TARGETS] + [
            (1, 256 * K, "on a one-GPU machine: a GPU's share of host", ONE_GPU_MACHINE)]:
        c, _ = planned(gpus, target, **gpu)
        if c is not None and not gpu:
            grids[gpus] = c.grid
        seq, best = longest("Llama-3-8B", gpus, None, start=target,
                            find=lambda s, n=gpus, g=gpu: planned(n, s, **g)) if c else (0, None)
        if best is None:
            rows.append(f"| {gpus} | {tokens(target)} ({peers}) | < target | | | | | | |")
            continue
        pr = best[0].prediction
        rows.append(f"| {gpus} | {tokens(target)} ({peers}) | {tokens(seq)} ({seq:,}) | "
                    f"{best[0].grid} | {pr.memory_bytes / GIB:.1f} "
                    f"({pr.usable_bytes / GIB:.1f}) | "
                    f"{(pr.usable_bytes - pr.memory_bytes) / GIB:.1f} "
                    f"({pr.margin_bytes / GIB:.1f}) | {pr.host_bytes / GIB:.0f} "
                    f"({pr.host_usable_bytes / GIB:.0f}) | {pr.tokens_per_s:,.0f} | "
                    f"{pr.mfu:.0%} |")
        print(rows[-1], flush=True)
    return rows, grids


def check_rows(grids: dict) -> list:
    """The targets' grids at small scale: measured on a fake CPU rank and a fake CUDA rank
    beside the plan's cpu and cuda branches."""
    rows = ["| GPUs | the grid's flags at small scale | CPU rank: measured / planned MiB | "
            "fake CUDA rank: measured / planned MiB | of it unmeasured (kernel scratch) |",
            "|---|---|---|---|---|"]
    for gpus, (r, c) in sorted(small_scale_checks(grids).items()):
        cpu = f"{r['measured'] / MIB:.1f} / {r['planned'] / MIB:.1f} ({_err(r)})"
        if isinstance(c, str):
            gpu, scratch = f"error: {c}", ""
        else:
            gpu = f"{c['measured'] / MIB:.1f} / {c['planned'] / MIB:.1f} ({_err(c)})"
            scratch = f"{c['unfaked'] / MIB:.1f}"
        rows.append(f"| {gpus} | `{r['flags']}` | {cpu} | {gpu} | {scratch} |")
        print(rows[-1], flush=True)
    return rows


def _err(r: dict) -> str:
    return f"{(r['planned'] - r['measured']) / r['measured']:+.1%}"


def breakdown(c, cfg) -> str:
    """Where the GiB of the limit go (the plan's peak moment), and the host's share."""
    run = configure(cfg, c.grid)
    p = plan_memory(run, run.dims, 0, "cuda")
    parts = [("params", p.param_bytes), ("grads", p.grad_bytes),
             ("optimizer", p.optimizer_bytes), ("activations", p.activation_bytes),
             ("transient", p.transient_bytes)]
    text = ", ".join(f"{k} {v / GIB:.1f}" for k, v in parts)
    if p.offload_bytes or p.host_bytes:
        text += f"; host {(p.offload_bytes + p.host_bytes) / GIB:.0f}"
    return f"{text} (at {p.peak_moment})"


# Two layers: at these grids (ZeRO-3, full recomputation, offloaded inputs) the layers add
# next to nothing to the peak (worlds 1 and 8 measure the same bytes with 4), and a fake
# op costs the same at any size: the 32-way ring's ops (a pass, a kernel and a merge per
# step, per layer) were most of the check's time. (With 4, the 32-way fake CUDA rank
# measured 5% more than the plan: fake_device's autocast cache keeps 16-bit leaves, which
# CUDA's caches only fp32 ones; with CUDA's rule it measures as with 2, the plan 1.5% over.)
SMALL_LAYERS = 2
SMALL = ["--num-layers", str(SMALL_LAYERS), "--hidden-size", "512",
         "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups",
         "8", "--ffn-hidden-size", "1408", "--vocab-size", "4096", "--train-iters", "3",
         "--lr-warmup-iters", "0", "--eval-iters", "0", "--log-interval", "1000",
         "--generate", "0"] + LLAMA[:-4]
SMALL_LOCAL = 8192  # tokens a rank


def small_scale_checks(grids: dict) -> dict:
    """{world: (CPU check, fake CUDA check)} of `grids[world]`'s flags on SMALL at
    SMALL_LOCAL tokens a rank, as rank 0 of `world` fake ranks, all six measured in one
    spawned process (each start of one imports torch and the trainer: ~2.5 s of CPU).
    CPU: {world, flags, host, measured, planned} bytes, measured held + step peak, the
    plan's cpu branch as it runs; fake CUDA: `fake_cuda.measure` (flash kernels, 1-byte
    masks; the plan's cuda branch), or its error's last line."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    worlds = sorted(grids)
    runs = [(small_argv(grids[w], w), w) for w in worlds]
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        cuda, cpu = pool.submit(_measure_all, runs).result()
    return {w: (_cpu_check(argv, w, r), c)
            for (argv, w), r, c in zip(runs, cpu, cuda, strict=True)}


def _cpu_check(argv: list, world: int, r: dict) -> dict:
    from megaulysses.config import resolve
    from megaulysses.planner.memory import plan_memory as plan
    cfg = resolve(parse_args(argv), world, 4096)
    return dict(world=world, flags=" ".join(argv[len(SMALL):-4]), host=r["host"],
                measured=sum(r["held"].values()) + r["peak"],
                planned=plan(cfg, cfg.dims, 0, "cpu").peak_bytes)


def _measure_all(runs: list) -> tuple[list, list]:
    """In the spawned process: the fake CUDA ranks first (the fake device must exist
    before the process runs any backward), then the same runs as CPU fake ranks (each on
    a fake process group of its own, destroyed after it: measured as in fresh processes,
    to the byte), two steps each (the second with AdamW's states)."""
    import fake_rank
    cuda = _fake_cuda_all(runs)
    return cuda, [fake_rank.fake_rank(0, world, argv, steps=2) for argv, world in runs]


def small_argv(grid, world: int) -> list:
    """SMALL with `grid`'s flags at SMALL_LOCAL tokens a rank of `world`."""
    seq = SMALL_LOCAL * world
    flags = grid.flags() + ["--global-batch-size", "1"]
    flags = _with(flags, "--cpu-offloading-num-layers", small_offload(grid))
    flags = _with(flags, "--tiled-mlp-chunks",
                  str(min(grid.tiles, 8)) if grid.tiles > 1 else None)
    return SMALL + flags + ["--seq-length", str(seq), "--max-position-embeddings", str(seq)]


def _fake_cuda_all(runs: list) -> list:
    """`fake_cuda.measure` of each (argv, world), in this (fresh) process; a run's error
    as its traceback's last line."""
    from megaulysses.training import fake_cuda
    out = []
    for argv, world in runs:
        try:
            out.append(fake_cuda.measure(argv + ["--num-workers", "0"], world, 0))
        except Exception as e:  # reported in the table, the others still measured
            out.append(f"{type(e).__name__}: {e}")
    return out


def small_offload(grid):
    """`grid`'s offloaded layers of 32 as a count of SMALL's (at least 1; None: none)."""
    return str(max(1, grid.offload * SMALL_LAYERS // 32)) if grid.offload else None


def _with(flags: list, name: str, value) -> list:
    """`flags` with `name` set to `value` (None: removed)."""
    out, skip = [], False
    for f in flags:
        if skip:
            skip = False
        elif f == name:
            skip = True
        else:
            out.append(f)
    return out + ([name, value] if value is not None else [])


def tokens(n: float) -> str:
    return f"{n / 2 ** 20:.2f}M" if n >= 2 ** 20 else f"{n / K:.0f}K"


NODE_HOST_GIB = {"2 TB": None, "4 TB": 4e12 / 8 / GIB}  # a GPU's share (None: the table's)
FP32_RESIDUAL = ("--fp32-residual-connection",)
TABLES = [  # (title, host GiB a GPU, extra flags, models or None: all); the first: headline
    ("Nodes of 8 GPUs with 2 TB of host memory (15% of it reserved):",
     NODE_HOST_GIB["2 TB"], (), None),
    ("Nodes of 8 GPUs with 4 TB of host memory (15% of it reserved):",
     NODE_HOST_GIB["4 TB"], (), None),
    ("For comparison, an fp32 residual stream (`--fp32-residual-connection`; this "
     "framework's only stream before issue 24), 2 TB nodes: twice the bytes of every "
     "kept block input, offloaded or not, and of the stream's gradient:",
     NODE_HOST_GIB["2 TB"], FP32_RESIDUAL, ["Llama-3-8B"]),
]


def frontier(models: list, host_gib, extra: tuple = ()) -> tuple[list, dict]:
    """(table rows, {gpus: grid} of Llama-3-8B on H100) with `host_gib` of host memory a
    GPU (None: the GPU table's) and the flags `extra`."""
    headline = {}
    rows = ["| model | GPUs | longest sequence | grid (the planner's fastest there) | "
            "tokens/s | MFU | GiB per GPU: where they go |", "|---|---|---|---|---|---|---|"]
    for name in models:
        for gpus, kind in CLUSTERS:
            seq, best = longest(name, gpus, gpu_spec(kind, host_memory_gib=host_gib), extra)
            if best is None:
                rows.append(f"| {name} | {gpus} x {kind} | < {tokens(STEP)} | | | | |")
                continue
            c, cfg = best
            if name == "Llama-3-8B" and kind == "H100" and gpus in (8, 32):
                headline[gpus] = c.grid
            pr = c.prediction
            rows.append(f"| {name} | {gpus} x {kind} | {tokens(seq)} ({seq:,}) | {c.grid} | "
                         f"{pr.tokens_per_s:,.0f} | {pr.mfu:.0%} | "
                         f"{pr.memory_bytes / GIB:.1f}: {breakdown(*best)} |")
            print(rows[-1], flush=True)
    return rows, headline


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "long_context_frontier.md"))
    p.add_argument("--no-small-check", action="store_true",
                   help="skip the fake-rank checks of the targets' grids")
    p.add_argument("--targets-only", action="store_true",
                   help="the targets' table (and checks) alone, not the per-cluster tables")
    args = p.parse_args(argv)
    head, grids = headline_rows()
    checks = [] if args.no_small_check else [
        "The targets' grids at small scale (measured: one rank of the same world on torch's "
        f"fake process group, {SMALL_LOCAL} tokens a rank, a {SMALL_LAYERS}-layer model of "
        "hidden 512 with 32 query and 8 kv heads, MLP tiles capped at 8, the offloaded "
        f"share of 32 layers as a share of {SMALL_LAYERS}; the CUDA rank is "
        "training/fake_cuda.py's):", "",
        *check_rows(grids), ""]
    tables = []
    for title, host_gib, extra, only in [] if args.targets_only else TABLES:
        models = [m for m in args.models.split(",") if only is None or m in only]
        if models:
            tables += [title, "", *frontier(models, host_gib, extra)[0], ""]
    published = ["| system | model | GPUs | tokens |", "|---|---|---|---|"] + [
        f"| {s} | {m} | {g} | {t / 1e6:.1f}M |" for s, m, g, t in PUBLISHED]
    text = "\n".join([
        "# The longest sequence per cluster", "",
        provenance("python benchmarks/long_context_frontier.py", "plans for CUDA (H100, "
                   "A100-80GB); measured at small scale on CPU and fake CUDA ranks."), "",
        "Planned: the planner (`tools/plan.py`'s search, memory plan and time model, the "
        "plan's CUDA branch; 4 GiB of each GPU reserved, and 10% of the attention "
        "backward's unmeasured kernel buffers kept free). Measured: the small-scale checks "
        "alone. " + __doc__.split("\n\n")[2].replace("\n", " "), "",
        "Issue 40's targets, Llama-3-8B on H100 (2 TB nodes of 8; a job on fewer GPUs than "
        "a node has the node's host memory):", "", *head, "", *checks, *tables,
        "Published (as quoted in issues 24 and 40):", "", *published, ""])
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        print(f"wrote {args.out}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
