"""Part (f) of the device check (issue 43): Llama-3-8B's shape on one GPU, eager and
`--torch-compile`, at 8K and 32K tokens, beside torchtitan's published per-GPU figures.

`benchmarks/device_check.py 8b` runs it (`device_check.sh`: part (f)); here are its
runner and its lines of the report.

    model     Llama 3 8B's layer (hidden 4096, 32 heads / 8 kv heads, SwiGLU ffn 14336,
              RoPE theta 500000, RMSNorm, no bias) and its untied 128256-token embedding
              and output layer (padded 128384: the NullTokenizer adds an end-of-document
              token, as Megatron-LM's does), bf16 autocast over fp32 weights and AdamW
              states, full recomputation, micro-batch 1, through the real Trainer and
              train_step. The whole model with AdamW needs ~16 bytes a parameter (128 GB):
              it runs `LAYERS[0]` of its 32 layers, the first count whose memory plan
              (plan_memory) at 32K fits 90% of the GPU (the planner fits up to 16 on an
              80 GB H100 at 32K, 69.4 GiB; 4 keep the part's four runs in its time limit).
              `--layers N` asks for N.
    runs      8K eager, 8K compiled, 32K compiled, 32K eager: the order keeps what matters
              most should the time limit stop the part (every run's result is written as
              it ends). Each: 2 warm-up steps (the compile happens in the first; the
              second is still slower on inductor), then `--steps` timed steps (median).
    figures   tokens/s, TFLOP/s (Megatron's count, model/flops.py, the count torchtitan's
              MFU uses too: 6 x parameters without the embedding + 12 x layers x hidden x
              seq per token), MFU against the bf16 dense peak of the GPU (metrics.GPU_PEAKS,
              the trainer's own table), peak memory beside the plan, the compile time the
              trainer logs (parallel/compile.py), the attention backend and kernels
              (model/ops/kernels.py) as logged; per sequence compiled/eager, and the
              tokens/s the whole 32-layer model would run at the same MFU.

The setups differ from torchtitan's (TORCHTITAN): they train all 32 layers over 8 GPUs
with FSDP (each GPU holds 1/8 of the weights and optimizer states and gathers the rest),
selective activation checkpointing at 8K, a 500 W H100 with 96 GB of HBM2e; this part
trains 4 layers on one GPU without communication, with full recomputation, and its
output layer is a larger share of the FLOPs (31% at 8K, vs 5% in the whole model).
MFU is the comparable figure; tokens/s only after the projection to 32 layers.

`--cpu-smoke`: a tiny shape, eagerly on the CPU (inductor's CPU compile takes ~90 s)."""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import statistics
import sys
import time
from contextlib import contextmanager
from typing import Callable, Optional

GIB = 2 ** 30
LLAMA3_8B = dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256,
                 rope_base=500000)
SMOKE = dict(layers=4, hidden=64, heads=4, kv_heads=2, ffn=192, vocab=500, rope_base=500000)
SEQS, SMOKE_SEQS = (8192, 32768), (64, 128)
LAYERS = (4, 2)  # tried in order at the longest sequence (fewer than all); the first
# that fits runs
FIT = 0.9  # of the GPU's memory the plan may take (compiled code may hold a little more)
WARMUP = 2
RUNS = ((0, False), (0, True), (1, True), (1, False))  # (index into the seqs, compiled)

# torchtitan's published Llama 3.1 8B figures on H100s (same layer shape as Llama 3 8B).
TORCHTITAN_SOURCE = (
    "github.com/pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (before "
    "2025-06: docs/performance.md), Tables 1 and 2; torch 1963fc8, torchtitan 9dec370 "
    "(2024-12); sequence 8192 is train_configs/llama3_8b.toml's seq_len at 9dec370")
TORCHTITAN_HARDWARE = ("8 x H100 SXM with 96 GB HBM2e at a 500 W power limit (Grand Teton), "
                       "NVLink; TPS/GPU read at iteration 90")
TORCHTITAN = (  # (setup, sequence, tokens/s per GPU, memory GiB)
    ("FSDP 8, local batch 2, selective op AC, bf16", 8192, 5762, 82.4),
    ("FSDP 8, local batch 2, selective op AC, torch.compile, bf16", 8192, 6667, 77.0),
    ("FSDP 8, local batch 2, selective op AC, torch.compile, Float8", 8192, 8532, 76.8),
    ("FSDP 8, CP 1, local batch 1, full AC, torch.compile, Float8", 32768, 3890, 83.9),
)
TORCHTITAN_MFU_NOTE = (
    "torchtitan states 33% (eager) to 39% (compiled) MFU for bf16 8B on 8 or 128 H100s, "
    "against the SXM peak (their 500 W GPUs peak lower: understated); Float8 rows' MFU "
    "here is bf16-equivalent (Float8 matmuls have twice the peak)")


def run_8b(args, base_flags: Callable, peak_of: Callable) -> dict:
    """Part (f): `base_flags(shape, seq)` is device_check.model_flags, `peak_of(device,
    name)` device_check._peak_tflops. Writes part_8b.json after every run."""
    import torch
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (use --cpu-smoke on a CPU machine)")
    device = torch.device("cpu" if smoke else "cuda")
    name = "cpu" if smoke else torch.cuda.get_device_name(0)
    shape, seqs = (SMOKE, SMOKE_SEQS) if smoke else (LLAMA3_8B, SEQS)
    total = None if smoke else torch.cuda.get_device_properties(0).total_memory
    layers, considered = pick_layers(args.layers, shape, seqs[-1], base_flags, device.type,
                                     total)
    rec = new_record(name, shape, seqs, layers, considered, peak_of(device, name), total)
    if layers is None:
        return dict(rec, status="fail", error="no layer count's plan fits the GPU")
    for index, compiled in RUNS:
        seq = seqs[index]
        if compiled and smoke:
            rec["runs"].append(dict(seq=seq, compiled=True, status="skipped",
                                    reason="CPU smoke: eager only (inductor's CPU compile "
                                           "takes ~90 s)"))
            continue
        flags = flags_8b(base_flags, shape, layers, seq, compiled)
        rec["runs"].append(measure(flags, device, args.steps, rec["peak_tflops"], shape, seq))
        rec.update(summarize(rec))
        _save(args.out, rec)
    bad = [r for r in rec["runs"] if r["status"] not in ("ok", "skipped")]
    return dict(rec, status="fail" if bad else "ok")


def new_record(device: str, shape: dict, seqs, layers: Optional[int], considered: list,
               peak: tuple, total: Optional[int]) -> dict:
    """part_8b.json before its runs: `peak` (TFLOP/s, where it came from)."""
    return dict(part="8b", status="running", device=device, layers=layers,
                layers_of=shape["layers"], layers_plans=considered, seqs=list(seqs),
                dtype="bf16 autocast, fp32 weights and AdamW states", recompute="full",
                peak_tflops=peak[0], peak_tflops_source=peak[1], torchtitan=torchtitan_rows(),
                torchtitan_source=TORCHTITAN_SOURCE, torchtitan_hardware=TORCHTITAN_HARDWARE,
                torchtitan_mfu_note=TORCHTITAN_MFU_NOTE,
                gpu_total_gib=None if total is None else total / GIB, runs=[])


def flags_8b(base_flags: Callable, shape: dict, layers: int, seq: int,
             compiled: bool) -> list:
    """pretrain_gpt.py's flags of one run: (c)'s (device_check.model_flags) with the 8B's
    grouped-query attention and RoPE base, and --torch-compile."""
    flags = base_flags(dict(shape, layers=layers), seq) + [
        "--group-query-attention", "--num-query-groups", str(shape["kv_heads"]),
        "--rotary-base", str(shape["rope_base"])]
    return flags + ["--torch-compile"] if compiled else flags


def _config(flags: list):
    from megaulysses.config import parse_args as parse_flags, resolve
    from megaulysses.training.data import load_tokenizer
    cfg = parse_flags(flags)
    return resolve(cfg, 1, load_tokenizer(cfg).vocab_size)


def pick_layers(asked: Optional[int], shape: dict, seq: int, base_flags: Callable,
                device_type: str, total: Optional[int]) -> tuple[Optional[int], list]:
    """(the layers to run: the first of `asked` or LAYERS whose eager plan at `seq` fits
    FIT of `total` bytes, or None; [{layers, plan_gib}] of those considered)."""
    from megaulysses.planner.memory import plan_memory
    considered = []
    for layers in [asked] if asked else [n for n in LAYERS if n < shape["layers"]]:
        cfg = _config(flags_8b(base_flags, shape, layers, seq, False))
        plan = plan_memory(cfg, cfg.dims, 0, device_type)
        considered.append(dict(layers=layers, seq=seq, plan_gib=plan.peak_bytes / GIB))
        if total is None or plan.peak_bytes <= FIT * total:
            return layers, considered
    return None, considered


class _Lines(logging.Handler):
    """The megaulysses loggers' records of one run; warnings and errors also printed."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.lines.append(message)
        if record.levelno >= logging.WARNING:
            print(message, file=sys.stderr, flush=True)


@contextmanager
def _captured_log():
    """The trainer's info lines (the compile and kernel lines among them) kept, not
    printed: device_check.py logs at WARNING, and the settings run to 200 lines."""
    logger, handler = logging.getLogger("megaulysses"), _Lines()
    saved = logger.level, logger.propagate
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])  # (setLevel clears the loggers' isEnabledFor cache)
        logger.propagate = saved[1]


def measure(flags: list, device, steps: int, peak: float, shape: dict, seq: int) -> dict:
    """One run: build the Trainer, WARMUP steps, `steps` timed ones; its record (an out
    of memory or an error is recorded, not raised: the next run still runs)."""
    import torch
    compiled = "--torch-compile" in flags
    run = dict(seq=seq, compiled=compiled)
    cuda = device.type == "cuda"
    try:
        with _captured_log() as lines:
            run.update(_steps(_config(flags), device, steps, cuda))
    except torch.cuda.OutOfMemoryError as e:  # its traceback holds the step's tensors
        run.update(status="out of memory", error=str(e).splitlines()[0][:300])
    except Exception as e:
        run.update(status="fail", error=f"{type(e).__name__}: {str(e)[:300]}")
    run.update(_logged(lines))
    gc.collect()  # the trainer, and the except block's traceback, are gone now
    if compiled:
        torch._dynamo.reset()  # the next run compiles afresh (and frees these graphs)
    if cuda:
        torch.cuda.empty_cache()
    if run.get("status", "ok") == "ok":
        run.update(_rates(run, shape, seq, peak))
    print(f"[8b] {describe_run(run)}", flush=True)
    return run


def _steps(cfg, device, steps: int, cuda: bool) -> dict:
    """Build, warm up, time; the trainer is dropped on return."""
    import torch
    from megaulysses.model.flops import flops_per_iteration
    from megaulysses.planner.memory import plan_memory
    from megaulysses.training.step import train_step
    from megaulysses.training.trainer import Trainer

    plan = plan_memory(cfg, cfg.dims, 0, device.type)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    build_s = time.perf_counter() - t0
    t = cfg.train

    def step(i):
        batches = trainer.train_data.micro_batches(i * t.global_batch_size)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        r = train_step(trainer.model, batches, trainer.zero, trainer.scaler, t.clip_grad,
                       trainer.device, trainer.dtype, trainer.comm, trainer.pipeline)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start, r.loss

    warm = [step(i) for i in range(WARMUP)]
    first_peak = torch.cuda.max_memory_allocated() if cuda else None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    timed = [step(i) for i in range(WARMUP, WARMUP + steps)]
    steady_peak = torch.cuda.max_memory_allocated() if cuda else None
    return dict(status="ok", attention_backend=trainer.run.backend, build_s=build_s,
                warmup_s=[s for s, _ in warm], step_s_all=[s for s, _ in timed],
                step_s=statistics.median(s for s, _ in timed),
                losses=[float(x) for _, x in warm + timed],
                model_flop_per_step=flops_per_iteration(cfg.model, 1),
                params=sum(p.numel() for p in trainer.model.parameters()),
                plan_peak_gib=plan.peak_bytes / GIB,
                first_steps_peak_gib=None if first_peak is None else first_peak / GIB,
                measured_peak_gib=None if steady_peak is None else steady_peak / GIB)


def _logged(lines: list) -> dict:
    """What the trainer said of the attention, the kernels and the compile."""
    found = {}
    for line in lines:
        timing = re.match(r"--torch-compile: (\d+) compilations in ([\d.]+) s", line)
        if timing:
            found.update(compile_time_line=line, compile_s=float(timing.group(2)))
        elif line.startswith("--torch-compile:"):
            found["compile_line"] = line
        elif line.startswith("kernels ("):
            found["kernels_line"] = line
        elif line.startswith("attention backend:"):
            found["attention_line"] = line
    return found


def whole_model_flop_per_token(shape: dict, seq: int) -> float:
    """Megatron's count (model/flops.py) for all of the shape's layers, its vocabulary
    unpadded (as torchtitan counts it) and without the embedding."""
    from megaulysses.config import ModelConfig
    from megaulysses.model.flops import flops_per_iteration
    m = ModelConfig(num_layers=shape["layers"], hidden_size=shape["hidden"],
                    num_attention_heads=shape["heads"], num_query_groups=shape["kv_heads"],
                    ffn_hidden_size=shape["ffn"], vocab_size=shape["vocab"], seq_length=seq,
                    make_vocab_size_divisible_by=1, untie_embeddings_and_output_weights=True,
                    position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                    add_bias_linear=False)
    return flops_per_iteration(m, 1) / seq


def _rates(run: dict, shape: dict, seq: int, peak: float) -> dict:
    flops = run["model_flop_per_step"] / run["step_s"]  # model FLOP/s
    return dict(tokens_per_s=seq / run["step_s"], tflops=flops / 1e12, mfu=flops / 1e12 / peak,
                whole_model_tokens_per_s=flops / whole_model_flop_per_token(shape, seq))


def torchtitan_rows() -> list:
    """TORCHTITAN with each row's MFU by the same count (all 32 layers) over the H100 SXM
    bf16 peak (metrics.GPU_PEAKS), as torchtitan computes it."""
    from megaulysses.training.metrics import gpu_peak
    peak = gpu_peak("H100")[1].half
    return [dict(setup=setup, seq=seq, tokens_per_s=tps, memory_gib=gib, mfu_peak_tflops=peak,
                 mfu=tps * whole_model_flop_per_token(LLAMA3_8B, seq) / peak / 1e12)
            for setup, seq, tps, gib in TORCHTITAN]


def summarize(rec: dict) -> dict:
    """Per sequence: eager and compiled tokens/s and MFU, the ratio compiled/eager."""
    rows = []
    for seq in rec["seqs"]:
        got = {r["compiled"]: r for r in rec["runs"] if r["seq"] == seq and "tokens_per_s" in r}
        eager, comp = got.get(False, {}), got.get(True, {})
        row = dict(seq=seq, eager_tokens_per_s=eager.get("tokens_per_s"),
                   compiled_tokens_per_s=comp.get("tokens_per_s"), eager_mfu=eager.get("mfu"),
                   compiled_mfu=comp.get("mfu"), compile_s=comp.get("compile_s"))
        if eager and comp:
            row["ratio_compiled_over_eager"] = comp["tokens_per_s"] / eager["tokens_per_s"]
        rows.append(row)
    kernels = next((r["kernels_line"] for r in rec["runs"] if "kernels_line" in r), None)
    backend = next((r["attention_line"] for r in rec["runs"] if "attention_line" in r), None)
    return dict(summary=rows, kernels_line=kernels, attention_line=backend)


def _save(out: str, rec: dict) -> None:
    """part_8b.json as it stands: a time limit that stops the part leaves it."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "part_8b.json"), "w") as f:
        json.dump(rec, f, indent=1, default=str)


def _f(x, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def describe_run(run: dict) -> str:
    what = f"{run['seq']} tokens, {'compiled' if run['compiled'] else 'eager'}"
    if "tokens_per_s" not in run:
        return f"{what}: {run.get('status')} {run.get('error') or run.get('reason') or ''}"
    compile_s = f"; compile {run['compile_s']:.1f} s" if "compile_s" in run else ""
    return (f"{what}: {run['step_s']:.3f} s a step: {run['tokens_per_s']:,.0f} tokens/s, "
            f"{run['tflops']:.0f} TFLOP/s, MFU {100 * run['mfu']:.1f}%, peak "
            f"{_f(run.get('measured_peak_gib'), '.1f')} GiB (plan {run['plan_peak_gib']:.1f})"
            f"{compile_s}")


def report_row(rec: dict) -> Optional[str]:
    """The (f) row's result cell of device_check.md, or None: device_check.py says why."""
    if not rec.get("runs"):
        return None
    per_seq = [f"{row['seq']}: eager {_f(row['eager_tokens_per_s'], ',.0f')} / compiled "
               f"{_f(row['compiled_tokens_per_s'], ',.0f')} tokens/s "
               f"(x{_f(row.get('ratio_compiled_over_eager'), '.2f')}), MFU "
               f"{_pct(row['eager_mfu'])} / {_pct(row['compiled_mfu'])}"
               for row in rec.get("summary", [])]
    return (f"{rec['layers']} of Llama-3-8B's {rec['layers_of']} layers, bf16, full "
            f"recompute: " + "; ".join(per_seq) + " (table below)")


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def report_section(rec: dict) -> list:
    """The lines below device_check.md's table: every run, torchtitan's rows beside."""
    if not rec.get("runs"):
        return []
    plan = rec["layers_plans"][-1]
    lines = ["", "### (f) Llama-3-8B's shape on one GPU, beside torchtitan", "",
             f"{rec['device']}: {rec['layers']} of the {rec['layers_of']} layers (the memory "
             f"plan at {plan['seq']} tokens: {plan['plan_gib']:.1f} GiB of "
             f"{_f(rec['gpu_total_gib'], '.1f')}), {rec['dtype']}, full recomputation, "
             f"micro-batch 1; MFU over {rec['peak_tflops']:.1f} TFLOP/s "
             f"({rec['peak_tflops_source']}).",
             f"{rec.get('attention_line') or ''} | {rec.get('kernels_line') or ''}", "",
             f"| run | seq | tokens/s | {rec['layers_of']} layers at this MFU, tokens/s "
             "| TFLOP/s | MFU "
             "| peak GiB (plan) | compile s |", "|---|---|---|---|---|---|---|---|"]
    for r in rec["runs"]:
        what = "ours, " + ("--torch-compile" if r["compiled"] else "eager")
        if "tokens_per_s" not in r:
            lines.append(f"| {what} | {r['seq']} | {r['status']}: "
                         f"{(r.get('error') or r.get('reason') or '').replace('|', '/')} "
                         "| | | | | |")
            continue
        lines.append(
            f"| {what} | {r['seq']} | {r['tokens_per_s']:,.0f} | "
            f"{r['whole_model_tokens_per_s']:,.0f} | {r['tflops']:.0f} | "
            f"{_pct(r['mfu'])} | {_f(r.get('measured_peak_gib'), '.1f')} "
            f"({r['plan_peak_gib']:.1f}) | {_f(r.get('compile_s'), '.0f')} |")
    for t in rec["torchtitan"]:
        lines.append(f"| torchtitan, {t['setup']} | {t['seq']} | {t['tokens_per_s']:,} "
                     f"(32 layers) | {t['tokens_per_s']:,} | "
                     f"{t['mfu'] * t['mfu_peak_tflops']:.0f} | {_pct(t['mfu'])} | "
                     f"{t['memory_gib']} | |")
    ratios = ", ".join(f"{row['seq']}: x{row['ratio_compiled_over_eager']:.2f}"
                       for row in rec.get("summary", []) if "ratio_compiled_over_eager" in row)
    lines += ["", f"Compiled over eager, tokens/s: {ratios or 'n/a'}.",
              f"torchtitan: {rec['torchtitan_source']}; {rec['torchtitan_hardware']}. "
              f"{rec['torchtitan_mfu_note']}. Not the same setup: torchtitan trains all 32 "
              "layers over 8 GPUs with FSDP (communication, 1/8 of the states a GPU), "
              "selective AC at 8K; ours a slice of the layers on one GPU, full "
              "recomputation, the output layer a larger share of the FLOPs. Compare MFU, "
              "and tokens/s only as projected to 32 layers."]
    return lines
