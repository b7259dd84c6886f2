"""The longest sequence per cluster, from the planner: Llama-3-8B's shape and the paper's
7B/30B shapes on 8, 32 and 64 H100 or A100-80GB, beside ALST's and FPDT's published
numbers, with where each GiB goes at the limit.

    python benchmarks/long_context_frontier.py            # ~2 min; writes docs/long_context_frontier.md
    python benchmarks/long_context_frontier.py --out ''   # print only

The plan behind the headline rows (Llama-3-8B on 8 and 32 H100) is checked at small scale:
the same grid flags (Ulysses degree, ZeRO stage, recomputation, MLP tiles, offload, head
groups) and the same head layout (32 query, 8 kv heads) on a 4-layer model of hidden 512
at 8K tokens a rank, run as one rank of 8 (and of 32) on torch's fake process group
(benchmarks/fake_rank.py: the real trainer and step, shapes only), its measured peak
beside the plan's for the same flags (`small_scale_check`).

For each (model, cluster) the grid is Ulysses over as many ranks as the heads allow (sp),
ring attention over the rest (cp), tp = pp = dp = 1, one sample of S tokens; the planner
(planner/search.py) walks its recomputation levels (full recomputation, the tiled MLP,
activation offload, head groups) and ZeRO stages for the fastest setting that fits the
GPU less 4 GiB. The longest S: doubled from 128K while some setting fits, then bisected
to a multiple of 128K. The paper's 7B and 30B (GPT-2 blocks in the paper) are planned
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

from megaulysses.config import parse_args  # noqa: E402
from megaulysses.hardware import gpu_spec  # noqa: E402
from megaulysses.planner.memory import plan_memory  # noqa: E402
from megaulysses.planner.search import configure, search  # noqa: E402

GIB, K = 2 ** 30, 1024
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
PUBLISHED = [  # (system, model, GPUs, tokens): the figures issue 24 quotes
    ("DeepSpeed ALST", "Llama-3-8B", "8 x H100-80GB", 3.7e6),
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


def longest(name: str, gpus: int, gpu, extra: tuple = ()) -> tuple:
    """(S, Candidate, base config) of the longest S (a multiple of STEP) that fits."""
    fit, miss, best = 0, None, None
    seq = STEP
    while miss is None and seq <= 2 ** 28:
        c, cfg = fastest(name, gpus, gpu, seq, extra)
        if c is None:
            miss = seq
        else:
            fit, best = seq, (c, cfg)
            seq *= 2
    while miss is not None and miss - fit > STEP:
        mid = (fit + miss) // 2 // STEP * STEP
        c, cfg = fastest(name, gpus, gpu, mid, extra)
        if c is None:
            miss = mid
        else:
            fit, best = mid, (c, cfg)
    return fit, best


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


SMALL = ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "32",
         "--group-query-attention", "--num-query-groups", "8", "--ffn-hidden-size", "1408",
         "--vocab-size", "4096", "--train-iters", "3", "--lr-warmup-iters", "0",
         "--eval-iters", "0", "--log-interval", "1000", "--generate", "0"] + LLAMA[:-4]
SMALL_LOCAL = 8192  # tokens a rank


def small_scale_check(grid, world: int) -> dict:
    """`grid`'s flags on SMALL at SMALL_LOCAL tokens a rank, as rank 0 of `world` fake
    ranks: {measured, planned} bytes (held + step peak; the plan for cpu, as it runs)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import fake_rank
    from megaulysses.config import resolve
    from megaulysses.planner.memory import plan_memory as plan
    seq = SMALL_LOCAL * world
    flags = grid.flags() + ["--global-batch-size", "1"]
    flags = _with(flags, "--cpu-offloading-num-layers", "4" if grid.offload else None)
    flags = _with(flags, "--tiled-mlp-chunks",
                  str(min(grid.tiles, 8)) if grid.tiles > 1 else None)
    argv = SMALL + flags + ["--seq-length", str(seq), "--max-position-embeddings", str(seq)]
    r = fake_rank.run_fake_rank(0, world, argv, steps=2)
    cfg = resolve(parse_args(argv), world, 4096)
    return dict(world=world, flags=" ".join(flags), host=r["host"],
                measured=sum(r["held"].values()) + r["peak"],
                planned=plan(cfg, cfg.dims, 0, "cpu").peak_bytes)


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
                   help="skip the fake-rank check of the headline grids")
    args = p.parse_args(argv)
    tables, headline = [], None
    for title, host_gib, extra, only in TABLES:
        models = [m for m in args.models.split(",") if only is None or m in only]
        if not models:
            continue
        rows, found = frontier(models, host_gib, extra)
        headline = found if headline is None else headline
        tables += [title, "", *rows, ""]
    checks = []
    if not args.no_small_check:
        checks = ["| world | the grid's flags | measured MiB | planned MiB | plan error | "
                  "host MiB |", "|---|---|---|---|---|---|"]
        for gpus, grid in sorted(headline.items()):
            r = small_scale_check(grid, gpus)
            err = (r["planned"] - r["measured"]) / r["measured"]
            checks.append(f"| {gpus} | `{r['flags']}` | {r['measured'] / 2 ** 20:.1f} | "
                          f"{r['planned'] / 2 ** 20:.1f} | {err:+.1%} | "
                          f"{r['host'] / 2 ** 20:.1f} |")
            print(checks[-1], flush=True)
        checks = ["The headline grids (2 TB nodes) at small scale (fake ranks, "
                  f"{SMALL_LOCAL} tokens a rank, a 4-layer model of hidden 512 with 32 query "
                  "and 8 kv heads; MLP tiles capped at 8, offload of all 4 layers):", "",
                  *checks, ""]
    published = ["| system | model | GPUs | tokens |", "|---|---|---|---|"] + [
        f"| {s} | {m} | {g} | {t / 1e6:.1f}M |" for s, m, g, t in PUBLISHED]
    text = "\n".join(["# The longest sequence per cluster", "",
                      "Generated by `python benchmarks/long_context_frontier.py` (the planner: "
                      "`tools/plan.py`'s memory plan and time model; 4 GiB of each GPU "
                      "reserved). " + __doc__.split("\n\n")[2].replace("\n", " "), "",
                      *tables, *checks, "Published (as quoted in issue 24):", "",
                      *published, ""])
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        print(f"wrote {args.out}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
