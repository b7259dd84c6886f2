"""One training step of ours vs megatron-core's `GPTModel`, side by side in one run, at
tensor-parallel 1 and 2 on gloo (CPU, fp32).

Both sides start from the same weights and train on the same tokens, and a step is the
same work on both: forward with the loss, backward, gradient clipping at 1.0 by the global
norm, an AdamW update (lr 3e-4, weight decay 0.1 except on biases and norms), gradients
zeroed. Neither side has a data loader (the same batch every step), a learning-rate
schedule that moves, loss-mask reductions, NaN checks or logging.

    megatron-core  `GPTModel` of the local spec (no Transformer Engine or Apex: plain torch
                   layers), built and run on CPU by the test oracle
                   tests/tools/megatron_oracle.py (imported from tests/tools: a benchmark
                   may use test helpers; its module doc lists the CPU workarounds), wrapped
                   in its `DistributedDataParallel`, stepped as Megatron-LM's train_step
                   steps it: `zero_grad_buffer()`, forward (`labels=`: per-token losses)
                   `.mean()`, backward, `finalize_model_grads` (under sequence parallelism:
                   the norms' gradients all-reduced over tp), `get_megatron_optimizer`'s
                   `step()` (its grad norm and clipping, then torch's AdamW: without
                   Transformer Engine or Apex megatron-core falls back to
                   `torch.optim.AdamW` with torch's default implementation, the per-tensor
                   loop on CPU). A constant `OptimizerParamScheduler` is built once, not
                   stepped: its first step(0) sets each group's weight decay (x wd_mult).
    ours           our GPT loaded from megatron-core's own weights (saved by the oracle in
                   Megatron-LM's legacy format, read by our converter), the attention core
                   the trainer picks (`select_backend("auto")`), tensor parallelism as the
                   trainer applies it (`apply_tensor_parallel`, Megatron-SP inside tp), the
                   trainer's AdamW (`param_groups` + `adamw`: torch's fused kernel) and step
                   pieces: `step_context` (tp: DTensor's collectives counted, by a dispatch
                   mode on the first step only, as the trainer counts them), `Zero` at
                   stage 0 (gradients in their tp layouts), `unscale_and_clip` by the
                   global norm, `step()`, `zero_grad()`.

Before any timing, the first 3 steps of every side run and their losses are printed: from
the same weights and tokens they must agree to LOSS_RTOL (fp32), else the script stops
(exit 1): that checks that both compute the same function and take the same update.

Timing: `--warmup` more untimed steps of each, then `--reps` repetitions, each one step of
every side, interleaved (the order reversed every other repetition, so that load from
other processes and any order effect hit all sides alike). Each step starts at a barrier;
under tp 2 a step's time is the slower rank's. Threads: tp 1 runs both sides in one
process with `--threads` torch threads (the same for both; default 1, as each tp 2 rank
has: on a shared machine a multi-threaded step's wall time swings with every other
process, a single thread's far less); tp 2 runs 2 ranks of 1 thread each, forked from a
server that imported torch, megatron-core and ours once. Reported per side: min and median
seconds per step, tokens/s (micro-batch x seq per step, whole-model tokens at either tp);
then, per tp, `ratio ours/megatron-core (tpN): min X median Y`, a SPEED ratio:
megatron-core's time over ours (> 1: ours is faster), of the minima and of the medians.

`--compile` adds a third side, ours compiled as the trainer's --torch-compile compiles it
(parallel/compile.py: each block and the loss; a second copy from the same weights,
compiled during its check steps, not timed) and `ratio ours-compiled/megatron-core`. The
oracle turns torch._dynamo off process-wide (so megatron-core's jit_fuser functions, the
GPT shape's bias-GeLU, run eagerly); it is turned back on around the compiled side's
steps only. megatron-core's side stays eager.

    python benchmarks/megatron_step.py                    # Llama shape, tp 1 and 2
    python benchmarks/megatron_step.py --style gpt --tp 2
    python benchmarks/megatron_step.py --compile --reps 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from contextlib import nullcontext
from typing import Callable

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
sys.path.insert(0, os.path.join(REPO, "tests", "tools"))  # megatron_oracle

from _common import launch, table  # noqa: E402

# megatron-core's notes on what CPU lacks (Apex, TE, CUDA settings) and its calls of
# torch.distributed's renamed collectives: the same lines from every rank, no news (set at
# import: the ranks' forkserver imports megatron-core)
warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
warnings.filterwarnings("ignore", category=FutureWarning, message=".*is deprecated")

# fp32 mean losses of the first 3 steps, ours vs megatron-core's, relative to theirs
# (~16 down to ~8 from the oracle's weights); measured up to 6.6e-7 (7.6e-6 absolute: the
# Llama shape's second step at tp 1), see benchmarks/README.md
LOSS_RTOL = 1e-5
CHECK_STEPS = 3
OPT = dict(lr=3e-4, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
           clip_grad=1.0)
# imported once by the ranks' forkserver: every run's ranks are forked from it
PRELOAD = ["torch", "torch.distributed", "megatron_oracle", "megaulysses.training.megatron",
           "megaulysses.parallel.parallelize"]
STYLES = {  # (ffn hidden / hidden, query groups) defaults: Llama's SwiGLU, GPT-2's 4 h
    "llama": (8 / 3, 2), "gpt": (4, None)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--style", choices=tuple(STYLES), default="llama",
                   help="llama: RMSNorm, SwiGLU, RoPE, no biases, untied; gpt: LayerNorm, "
                        "GeLU, learned positions, biases, tied")
    p.add_argument("--tp", type=int, nargs="+", choices=(1, 2), default=[1, 2])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=None, help="default: 2 (llama), --heads (gpt)")
    p.add_argument("--ffn", type=int, default=None, help="default: 1024 (llama), 4 h (gpt)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--reps", type=int, default=10, help="timed steps per side, interleaved")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per side after the "
                                                          f"{CHECK_STEPS} checked ones")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the tp 1 process (both sides); tp 2: 1 per rank")
    p.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction,
                   default=True, help="Megatron-SP inside tp 2, both sides")
    p.add_argument("--compile", action="store_true", help="time ours compiled too")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    ratio, groups = STYLES[args.style]
    args.kv_heads = args.kv_heads or groups or args.heads
    args.ffn = args.ffn or round(ratio * args.hidden / 64) * 64
    _check(args)
    return args


def _check(args: argparse.Namespace) -> None:
    """One line naming the flag and the rule, exit 2."""
    rules = [("--hidden", args.hidden % args.heads == 0, "a multiple of --heads"),
             ("--kv-heads", args.heads % args.kv_heads == 0, "a divisor of --heads")]
    for flag in ("layers", "hidden", "heads", "ffn", "vocab", "seq", "micro_batch", "reps",
                 "threads"):
        rules.append((f"--{flag.replace('_', '-')}", getattr(args, flag) >= 1, ">= 1"))
    rules.append(("--warmup", args.warmup >= 0, ">= 0"))
    for tp in args.tp:  # megatron-core pads the vocabulary to a multiple of 128 x tp
        rules += [("--kv-heads", args.kv_heads % tp == 0, f"divisible by --tp {tp}"),
                  ("--vocab", args.vocab % (128 * tp) == 0, f"a multiple of 128 x --tp {tp}"),
                  ("--seq", not args.sequence_parallel or args.seq % tp == 0,
                   f"divisible by --tp {tp} under --sequence-parallel")]
    for flag, ok, rule in rules:
        if not ok:
            print(f"{flag}: must be {rule}", file=sys.stderr)
            sys.exit(2)


def shape(o: dict) -> dict:
    """The oracle's shape keys (megatron_oracle.model_shape)."""
    return dict(num_layers=o["layers"], hidden_size=o["hidden"],
                num_attention_heads=o["heads"], num_query_groups=o["kv_heads"],
                kv_channels=o["hidden"] // o["heads"], ffn_hidden_size=o["ffn"],
                vocab_size=o["vocab"], max_seq_length=o["seq"])


def batch(o: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's inputs and next-token labels, [b, seq] each; the same on every rank."""
    gen = torch.Generator().manual_seed(o["seed"])
    tokens = torch.randint(0, o["vocab"], (o["micro_batch"], o["seq"] + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


# -- the two sides (built in a rank) ---------------------------------------------------------


def build_theirs(o: dict, world: int, ckpt_dir: str) -> Callable[[], float]:
    """megatron-core's model, DDP and optimizer; its weights saved to `ckpt_dir` (legacy
    format) for ours. Returns the step: () -> loss."""
    import megatron_oracle as mo
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig, finalize_model_grads)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    sp = o["sequence_parallel"] and world > 1
    with mo.cuda_on_cpu():  # DDP's buffers and the optimizer allocate on "cuda"
        model = mo.build_model(o["style"], seed=o["seed"], sequence_parallel=sp, **shape(o))
        model.train()
        args = mo.megatron_args(o["style"], shape(o), tp=world, sequence_parallel=sp,
                                bias_gelu_fusion=True)
        mo.save_legacy_torch(model, ckpt_dir, 1, args)
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", **OPT), [ddp],
                                     use_gloo_process_groups=False)
        # constant; built for its first step(0), which sets each group's learning rate
        # and weight decay (x wd_mult: none on biases and norms), as in Megatron-LM
        never = 10 ** 9
        OptimizerParamScheduler(opt, init_lr=OPT["lr"], max_lr=OPT["lr"], min_lr=OPT["lr"],
                                lr_warmup_steps=0, lr_decay_steps=never,
                                lr_decay_style="constant", start_wd=OPT["weight_decay"],
                                end_wd=OPT["weight_decay"], wd_incr_steps=never,
                                wd_incr_style="constant")
    inputs, labels = batch(o)
    b, s = inputs.shape
    positions = torch.arange(s).expand(b, s)
    # Megatron-LM's get_ltor_masks_and_position_ids: True = masked (the local softmax
    # would otherwise build its default mask on "cuda")
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]

    def step() -> float:
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = ddp(inputs, positions, causal, labels=labels).mean()  # [b, s] -> []
        loss.backward()
        finalize_model_grads([ddp])
        assert opt.step()[0]
        return float(loss.detach())
    return step


def build_ours(o: dict, world: int, ckpt_dir: str, compiled: bool) -> Callable[[], float]:
    """Our model from megatron-core's saved weights, parallelized and stepped by the
    trainer's pieces. Returns the step: () -> loss."""
    from megaulysses.config import TrainConfig
    from megaulysses.model.attention import mask_from_config, select_backend
    from megaulysses.model.gpt import GPT
    from megaulysses.parallel.comm import Comm
    from megaulysses.parallel.compile import apply_compile
    from megaulysses.parallel.dims import TP, ParallelDims, build_mesh
    from megaulysses.parallel.grad_norm import unscale_and_clip
    from megaulysses.parallel.tensor import align_grads, apply_tensor_parallel, step_context
    from megaulysses.parallel.zero import Zero
    from megaulysses.training.megatron import read_megatron
    from megaulysses.training.optim import adamw, param_groups
    ckpt = read_megatron(ckpt_dir)
    _, core = select_backend("auto", torch.device("cpu"), torch.float32,
                             mask_from_config(ckpt.cfg))
    model = GPT(ckpt.cfg, core)
    model.load_state_dict(ckpt.state, strict=True)
    model.train()
    # a Comm per side: a compiled model's marks its own (comm.compiled)
    comm = Comm(build_mesh(ParallelDims(dp=1, tp=world, pp=1, sp=1), "cpu")
                if world > 1 else None)
    align = None
    if world > 1:
        apply_tensor_parallel(model, comm.mesh(TP), o["sequence_parallel"], comm)
        align = lambda params: align_grads(params, comm)  # noqa: E731
    if compiled:
        with torch._dynamo.config.patch(disable=False):
            apply_compile(model, tensor_parallel=world > 1)
        comm.compiled = True  # as parallelize() marks it: DTensor's collectives uncounted
    t = TrainConfig(**OPT)
    zero = Zero(model, comm, 0, param_groups(model, t.weight_decay),
                lambda groups: adamw(groups, t), torch.float32, [], align)
    inputs, labels = batch(o)

    def step() -> float:
        with step_context(comm, tuple(inputs.shape)):  # as training/step.py keys it
            loss = model(inputs, labels=labels).mean()  # [b, s] -> []
            zero.before_backward(last=True)
            loss.backward()
            zero.finish_grads()
            unscale_and_clip(zero.grad_parts(), 1.0, t.clip_grad, comm)
            zero.step()
            zero.zero_grad()
        return float(loss.detach())
    return step


# -- a rank ------------------------------------------------------------------------------------


def bench_rank(rank: int, world: int, o: dict, ckpt_dir: str) -> dict:
    """Every side's check losses and timed steps on this rank, and the seconds each phase
    took: {"sides": {side: {losses, times}}, "phases": {phase: s}}."""
    start = time.perf_counter()
    torch.set_num_threads(o["threads"] if world == 1 else 1)
    import megatron_oracle as mo
    mo.init_megatron(rank, world, world, 1)  # the process group exists: tp groups only
    sides = {"megatron-core": (build_theirs(o, world, ckpt_dir), mo.cuda_on_cpu),
             "ours": (build_ours(o, world, ckpt_dir, False), nullcontext)}
    if o["compile"]:
        sides["ours-compiled"] = (build_ours(o, world, ckpt_dir, True),
                                  lambda: torch._dynamo.config.patch(disable=False))
    phases = {"build": time.perf_counter() - start}
    out = {name: {"losses": [], "times": []} for name in sides}
    for name, (step, ctx) in sides.items():  # check steps (the compiled side compiles)
        for _ in range(CHECK_STEPS + o["warmup"]):
            out[name]["losses"].append(timed(step, ctx)[0])
        out[name]["losses"] = out[name]["losses"][:CHECK_STEPS]
    phases["check and warm-up"] = time.perf_counter() - start - sum(phases.values())
    for rep in range(o["reps"]):
        order = list(sides) if rep % 2 == 0 else list(reversed(sides))
        for name in order:
            out[name]["times"].append(timed(*sides[name])[1])
    phases["timed"] = time.perf_counter() - start - sum(phases.values())
    mo.destroy_megatron()
    return {"sides": out, "phases": phases}


def timed(step: Callable[[], float], ctx: Callable) -> tuple[float, float]:
    """(loss, seconds) of one step, started at a barrier (every rank at once)."""
    with ctx():
        dist.barrier()
        t0 = time.perf_counter()
        loss = step()
        return loss, time.perf_counter() - t0


# -- the report --------------------------------------------------------------------------------


def check_losses(tp: int, ranks: list[dict]) -> float:
    """Print every side's first losses (rank 0's); the largest distance from
    megatron-core's, relative to it. Exit 1 beyond LOSS_RTOL."""
    theirs = ranks[0]["sides"]["megatron-core"]["losses"]
    worst, rel = 0.0, 0.0
    for name, r in ranks[0]["sides"].items():
        print(f"tp{tp} {name:14s} losses: " + " ".join(f"{x:.7f}" for x in r["losses"]))
        for a, b in zip(r["losses"], theirs, strict=True):
            worst, rel = max(worst, abs(a - b)), max(rel, abs(a - b) / abs(b))
    print(f"tp{tp} largest |loss - megatron-core's| over {CHECK_STEPS} steps: {worst:.1e} "
          f"({rel:.1e} relative; fp32 tolerance {LOSS_RTOL:.0e} relative)")
    if not rel <= LOSS_RTOL:
        print(f"tp{tp}: the sides do not compute the same function; nothing timed",
              file=sys.stderr)
        sys.exit(1)
    return rel


def step_times(ranks: list[dict]) -> dict:
    """{side: seconds per repetition}, each the slowest rank's."""
    sides = [r["sides"] for r in ranks]
    return {name: [max(r[name]["times"][i] for r in sides)
                   for i in range(len(sides[0][name]["times"]))] for name in sides[0]}


def report(tp: int, times: dict, tokens: int) -> tuple[list, list]:
    """Table rows and ratio lines of one tp."""
    rows = [[f"tp{tp}", name, f"{min(ts):.3f}", f"{statistics.median(ts):.3f}",
             f"{tokens / statistics.median(ts):.0f}"] for name, ts in times.items()]
    base = times["megatron-core"]
    lines = [f"ratio {name}/megatron-core (tp{tp}): min {min(base) / min(ts):.2f} median "
             f"{statistics.median(base) / statistics.median(ts):.2f}"
             for name, ts in times.items() if name != "megatron-core"]
    return rows, lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    o = vars(args)
    import importlib.metadata as md
    tokens = args.micro_batch * args.seq
    print(f"{args.style}: {args.layers} layers, hidden {args.hidden}, heads {args.heads}/"
          f"{args.kv_heads} kv, ffn {args.ffn}, vocab {args.vocab}, seq {args.seq}, micro "
          f"batch {args.micro_batch} ({tokens} tokens/step), fp32; torch {torch.__version__}, "
          f"megatron-core {md.version('megatron-core')}; tp1: {args.threads} torch thread(s), "
          f"tp2: 2 ranks x 1 thread (gloo); sequence parallel at tp2: "
          f"{args.sequence_parallel}; load average {os.getloadavg()[0]:.2f}")
    rows, lines = [], []
    for tp in args.tp:
        start = time.time()
        with tempfile.TemporaryDirectory(prefix="megatron_step_") as ckpt_dir:
            ranks = launch(bench_rank, tp, o, ckpt_dir, preload=PRELOAD)
        check_losses(tp, ranks)
        r, l = report(tp, step_times(ranks), tokens)
        rows, lines = rows + r, lines + l
        phases = ", ".join(f"{k} {v:.0f} s" for k, v in ranks[0]["phases"].items())
        print(f"tp{tp}: {time.time() - start:.0f} s wall ({phases}), load average now "
              f"{os.getloadavg()[0]:.2f}")
    print()
    print(table(["tp", "side", "min s/step", "median s/step", "tokens/s"], rows))
    print(f"\n{args.reps} interleaved repetitions per side; ratio = megatron-core's s/step "
          f"over the side's (speed: > 1 means faster than megatron-core)")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
