"""Plan a run before renting GPUs: memory and speed of every grid, the fastest that fit.

    python tools/plan.py --gpus 32 --gpu A100-80GB \\
        --num-layers 32 --hidden-size 4096 --num-attention-heads 32 \\
        --seq-length 131072 --max-position-embeddings 131072 --global-batch-size 4 \\
        --vocab-size 50257 --bf16

Every flag that is not the planner's own is a pretrain_gpt.py flag and describes the run
(the model, the sequence, the global batch, bf16, the mask). Grid flags among them
(--tensor-model-parallel-size, --pipeline-model-parallel-size,
--ds-sequence-parallel-size, --context-parallel-size, --zero-stage,
--recompute-granularity, --tiled-mlp-chunks, --micro-batch-size) hold that part of the
grid fixed; the rest is searched (all of them given: that one grid is predicted). No
data is read: without --data-path the run is planned on mock data, and --vocab-size
alone means a NullTokenizer of that size.

Prints the top grids (memory per GPU, iteration time, tokens/s, TFLOP/s per GPU, MFU),
the grids faster than the best that did not fit, and why the others were rejected. The
model behind the numbers, its assumptions and where it is wrong: docs/guides/planning.md.
Bad input (unknown GPU, an impossible grid, a model that fits nowhere): one line, exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import replace

try:
    import megaulysses  # noqa: F401
except ImportError:  # run from a checkout without pip install
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megaulysses.config import ConfigError, parse_args  # noqa: E402

GIB = 2 ** 30
GRID_FLAGS = {"--tensor-model-parallel-size": "tp", "--pipeline-model-parallel-size": "pp",
              "--ds-sequence-parallel-size": "sp", "--ulysses-degree": "sp",
              "--context-parallel-size": "cp", "--zero-stage": "zero",
              "--recompute-granularity": "recompute", "--recompute-activations": "recompute",
              "--tiled-mlp-chunks": "tiles", "--micro-batch-size": "micro_batch",
              "--sequence-parallel": "megatron_sp", "--use-distributed-optimizer": "dist_opt",
              # given, that many layers of each stage offloaded; else searched
              "--cpu-offloading-num-layers": "offload", "--attention-head-groups": "head_groups"}


class PlanError(Exception):
    """Bad input: one line, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise PlanError(message)


def planner_parser() -> argparse.ArgumentParser:
    from megaulysses.hardware import GPUS, RESERVE_GIB
    p = _Parser(description="Predict memory and speed of every grid; print the fastest "
                "that fit. Other flags are pretrain_gpt.py's.", add_help=True)
    p.add_argument("--gpus", type=int, required=True, help="GPUs of the run")
    p.add_argument("--gpu", default="A100-80GB",
                   help=f"GPU kind, one of {', '.join(GPUS)} (default A100-80GB)")
    p.add_argument("--top", type=int, default=5, help="grids to print (default 5)")
    p.add_argument("--reserve-gib", type=float, default=RESERVE_GIB,
                   help="GiB of each GPU the plan's tensors cannot use: CUDA context, NCCL, "
                        f"workspaces, allocator fragmentation (default {RESERVE_GIB:g})")
    p.add_argument("--calibration", metavar="DEVICE_CHECK_JSON",
                   help="benchmarks/device_check.sh's device_check.json: the efficiency "
                        "its measured 1-GPU step reached replaces the table's")
    p.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    g = p.add_argument_group("GPU table overrides (default: the --gpu row)")
    g.add_argument("--gpu-peak-tflops", dest="peak_tflops", type=float,
                   help="dense bf16 TFLOP/s")
    g.add_argument("--gpu-memory-gib", dest="memory_gib", type=float)
    g.add_argument("--hbm-gbps", dest="hbm_gbps", type=float)
    g.add_argument("--nvlink-gbps", dest="nvlink_gbps", type=float,
                   help="collective bandwidth inside a node, GB/s per GPU")
    g.add_argument("--ib-gbps", dest="ib_gbps", type=float,
                   help="collective bandwidth between nodes, GB/s per GPU")
    g.add_argument("--gpus-per-node", type=int)
    g.add_argument("--efficiency", type=float,
                   help="fraction of peak reached on hardware FLOPs")
    g.add_argument("--ring-kernel-speed", type=float,
                   help="the ring attention kernel's speed relative to flash attention")
    g.add_argument("--host-gbps", dest="host_gbps", type=float,
                   help="host link, GB/s per GPU each way (--optimizer-cpu-offload's copies)")
    g.add_argument("--host-memory-gib", dest="host_memory_gib", type=float,
                   help="a GPU's share of its node's host memory (offloaded activations "
                   "and optimizer states; 15%% of it reserved); a job on fewer GPUs than a "
                   "node shares the whole node's among its ranks")
    g.add_argument("--host-adam-gparams", dest="host_adam_gparams", type=float,
                   help="host AdamW speed, 1e9 parameters/s per GPU")
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        result, base, fixed = plan(argv)
    except (PlanError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0 if result else 2


def plan(argv: list):
    """(SearchResult, the run's Config, the fixed grid fields), or raises PlanError."""
    from megaulysses.training.data import load_tokenizer
    from megaulysses.hardware import OVERRIDABLE, UnknownGPU, gpu_spec
    from megaulysses.planner.search import search
    args, rest = planner_parser().parse_known_args(argv)
    if args.gpus <= 0 or args.top <= 0:
        raise PlanError(f"--{'gpus' if args.gpus <= 0 else 'top'}: must be > 0")
    try:
        gpu = gpu_spec(args.gpu, **{k: getattr(args, k) for k in OVERRIDABLE})
    except UnknownGPU as e:
        raise PlanError(f"--gpu: {e} (for another part, take the closest and override "
                        "its fields: --gpu-peak-tflops, --gpu-memory-gib, ...)") from None
    except ValueError as e:
        raise PlanError(f"--gpu overrides: {e}") from None
    if args.calibration:
        gpu = calibrated(gpu, args.calibration)
    base = parse_args(_run_flags(rest))
    # grids are compared at one batch: by default one sample per GPU
    base = replace(base, model=replace(base.model, vocab_size=load_tokenizer(base).vocab_size),
                   train=replace(base.train, global_batch_size=base.train.global_batch_size
                                 or args.gpus))
    fixed = _fixed(rest, base)
    result = search(base, args.gpus, gpu, fixed, args.reserve_gib)
    _check_found(result, args, gpu, fixed)
    print(report(result, base, args.top, args.reserve_gib))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_json(result, args.top), f, indent=1)
    return result, base, fixed


def _run_flags(rest: list) -> list:
    """The run's flags: mock data unless --data-path is given (nothing is read), a
    NullTokenizer for --vocab-size alone, micro-batch 1 unless given (it is searched)."""
    flags = list(rest)
    given = {a.split("=")[0] for a in flags if a.startswith("--")}
    if "--data-path" not in given and "--mock-data" not in given:
        flags.append("--mock-data")
    if "--vocab-size" in given and "--tokenizer-type" not in given:
        flags += ["--tokenizer-type", "NullTokenizer"]
    if "--micro-batch-size" not in given:  # searched; 1 divides any global batch
        flags += ["--micro-batch-size", "1"]
    return flags


def _fixed(rest: list, cfg) -> dict:
    """The grid fields the user's flags hold fixed, with their parsed values."""
    given = {GRID_FLAGS[a.split("=")[0]] for a in rest if a.split("=")[0] in GRID_FLAGS}
    par, mem = cfg.parallel, cfg.memory
    values = dict(tp=par.tensor_model_parallel_size, pp=par.pipeline_model_parallel_size,
                  sp=par.ds_sequence_parallel_size, cp=par.context_parallel_size,
                  zero=par.zero_stage, recompute=mem.recompute_granularity or "none",
                  tiles=mem.tiled_mlp_chunks, micro_batch=cfg.train.micro_batch_size,
                  megatron_sp=par.tp_sequence_parallel, dist_opt=par.use_distributed_optimizer,
                  offload=mem.cpu_offloading_num_layers,
                  head_groups=mem.attention_head_groups)
    return {k: values[k] for k in given}


def _check_found(result, args, gpu, fixed: dict):
    """Nothing valid, or nothing that fits: one line saying why."""
    if result.ranked:
        return
    where = f"{args.gpus} x {gpu.name}"
    if not result.rejected:  # the fixed sizes leave no shape at all
        held = ", ".join(f"{k} {fixed[k]}" for k in ("tp", "pp", "sp", "cp") if k in fixed)
        raise PlanError(f"no grid of {where} is valid: tp*pp*sp*cp must divide {args.gpus} "
                        f"(held: {held or 'nothing'}; tp <= heads, pp <= layers)")
    too_big = [c for c in result.rejected if c.kind == "memory"]
    if not too_big:
        _, _, example = result.reasons()[0]
        # one grid given in full, tried with Megatron-SP off and on: still one grid
        if len({dataclasses.replace(c.grid, megatron_sp=False) for c in result.rejected}) == 1:
            raise PlanError(f"the grid is not valid on {where}: {example}")
        raise PlanError(f"no grid of {where} is valid ({len(result.rejected)} tried); e.g. "
                        f"{example}")
    least = min(too_big, key=lambda c: c.prediction.memory_bytes)
    raise PlanError(f"the model fits on no grid of {where}: the smallest, {least.grid}, "
                    f"{least.reason}")


def calibrated(gpu, path: str):
    """`gpu` with the efficiency that device_check.json's 1-GPU step reached: the planner's
    compute time at efficiency 1 over the measured step time (less the optimizer's)."""
    import dataclasses
    from megaulysses.training.data import load_tokenizer
    from megaulysses.config import resolve
    from megaulysses.planner.time_model import predict
    try:
        with open(path) as f:
            part = json.load(f)["parts"]["throughput"]
        device, step_s, flags = part["device"], part["step_s"], part["flags"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PlanError(f"--calibration: {path}: no measured throughput part ({e})") from None
    if gpu.name.split("-")[0] not in device:
        raise PlanError(f"--calibration: {path} was measured on {device}, not {gpu.name}")
    cfg = parse_args(flags)
    cfg = resolve(cfg, 1, load_tokenizer(cfg).vocab_size)
    ideal = predict(cfg, cfg.dims, dataclasses.replace(gpu, efficiency=1))
    efficiency = ideal.compute_s / (step_s - ideal.optimizer_s)
    print(f"calibration: {device} ran {path}'s 1-GPU step in {step_s:.3f} s: efficiency "
          f"{efficiency:.3f} (table: {gpu.efficiency})")
    return dataclasses.replace(gpu, efficiency=min(1.0, efficiency))


# -- the report --------------------------------------------------------------------------------

def report(result, base, top: int, reserve_gib: float) -> str:
    gpu, m = result.gpu, base.model
    lines = [f"plan: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} "
             f"heads, seq {m.seq_length}, global batch {base.train.global_batch_size}, vocab "
             f"{m.padded_vocab_size} (padded), {_dtype(base.train)}; "
             f"{result.gpus} x {gpu.name} ({gpu.peak_tflops:g} TFLOP/s at efficiency "
             f"{gpu.efficiency:.2f}, {gpu.memory_gib:g} GiB less {reserve_gib:g} reserved, "
             f"NVLink {gpu.nvlink_gbps:g} / InfiniBand {gpu.ib_gbps:g} GB/s, "
             f"{gpu.gpus_per_node} a node)",
             f"{len(result.ranked)} grids fit, {len(result.rejected)} rejected, "
             f"{result.dominated} not predicted (a lighter setting of the grid fits)", ""]
    lines += _table(result.ranked[:top])
    faster = result.faster_rejected(top)
    if faster:
        lines += ["", "faster, but do not fit:"]
        lines += [f"  {c.grid}: {c.prediction.time_s:.2f} s/it; {c.reason}" for c in faster]
    if result.rejected:
        lines += ["", "rejected:"]
        lines += [f"  {n} x {key}, e.g. {example}" for key, n, example in result.reasons()]
    return "\n".join(lines)


def _dtype(train) -> str:
    return "bf16" if train.bf16 else "fp16" if train.fp16 else "fp32"


def _table(cands: list) -> list:
    head = ("#", "grid", "GiB/GPU", "host GiB/GPU", "s/iter", "tokens/s", "TFLOP/s/GPU",
            "MFU", "paper TFLOP/s", "exposed comm s", "bubble s")
    rows = [(str(i + 1), str(c.grid), f"{c.prediction.memory_bytes / GIB:.1f}",
             f"{c.prediction.host_bytes / GIB:.1f}",
             f"{c.prediction.time_s:.3f}", f"{c.prediction.tokens_per_s:,.0f}",
             f"{c.prediction.model_tflops:.0f}", f"{100 * c.prediction.mfu:.0f}%",
             f"{c.prediction.paper_tflops:.0f}",
             f"{c.prediction.exposed_comm_s:.3f}", f"{c.prediction.bubble_s:.3f}")
            for i, c in enumerate(cands)]
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    fmt = lambda r: "  ".join(v.ljust(w) if i == 1 else v.rjust(w)  # noqa: E731
                              for i, (v, w) in enumerate(zip(r, widths, strict=True)))
    return [fmt(head)] + [fmt(r) for r in rows]


def to_json(result, top: int) -> dict:
    def cand(c):
        p = c.prediction
        out = dict(grid=str(c.grid), flags=c.grid.flags(), reason=c.reason)
        if p is not None:
            out.update(memory_gib=p.memory_bytes / GIB, host_gib=p.host_bytes / GIB,
                       time_s=p.time_s,
                       tokens_per_s=p.tokens_per_s, model_tflops=p.model_tflops,
                       hardware_tflops=p.hardware_tflops, paper_tflops=p.paper_tflops,
                       mfu=p.mfu,
                       compute_s=p.compute_s, exposed_comm_s=p.exposed_comm_s,
                       bubble_s=p.bubble_s, links=p.links,
                       comm_bytes={f"{g}/{k}": n for (g, k), n in p.comm_bytes.items()})
        return out
    return dict(gpus=result.gpus, gpu=vars(result.gpu), top=[cand(c) for c in result.ranked[:top]],
                faster_rejected=[cand(c) for c in result.faster_rejected(top)],
                rejected=[dict(reason=k, count=n, example=e) for k, n, e in result.reasons()],
                dominated=result.dominated)


if __name__ == "__main__":
    sys.exit(main())
