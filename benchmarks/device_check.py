"""The prepared single-GPU check (issue 14, item 3): parts (b)-(d) and the report.

`benchmarks/device_check.sh [OUT_DIR]` runs every part under its own time limit, part (a)
(`pytest -m cuda`) included; this script runs one part per process, so that a part that
fails, runs out of memory or runs out of time leaves the next one a clean device:

    parity      (b) one training step of a tiny GPT on CUDA, bf16 autocast, against the
                same step on CPU in fp32: same seed, same weights (copied from the CPU
                model), same tokens. Compared: the first-step loss (|rel diff| <=
                LOSS_RTOL) and the gradient norm (|rel diff| <= GRAD_NORM_RTOL); the loss
                after one AdamW step and the smallest per-parameter cosine of the
                gradients are reported, not gated.
    throughput  (c) the 1.2B model (Llama style: RoPE, RMSNorm, SwiGLU ffn 5504, untied
                embeddings, no bias; 24 layers, hidden 2048, 16 heads; vocab 50257 padded
                to 50304: 1.21B parameters without embeddings, 1.42B with) at 32K tokens,
                bf16, `--attention-backend auto` (flash_attn where installed, else SDPA),
                `--recompute-granularity full`, through the real Trainer and train_step
                (micro-batch 1, no gradient clipping): tokens/s, TFLOP/s (Megatron's
                count, metrics.flops_per_iteration), MFU against metrics.GPU_PEAKS, peak
                memory (torch.cuda.max_memory_allocated over the timed steps) against
                plan_memory(cfg, dims, 0, "cuda"). If 32K does not fit (the plan exceeds
                the GPU, or a step runs out of memory) it steps down to 16K, 8K, 4K and
                says so.
    hf          (d) the same step of transformers' LlamaForCausalLM of the same shape (same
                padded vocabulary, sdpa attention, gradient checkpointing, fused AdamW,
                bf16 autocast over fp32 weights like ours) at the sequence (c) reached;
                the ratio ours/hf of tokens/s.
    8b          (f) Llama-3-8B's shape (4 of its 32 layers by default) on one GPU at 8K and
                32K tokens, eager and --torch-compile: tokens/s, MFU, compiled/eager,
                peak memory, compile time, beside torchtitan's published per-GPU figures
                (benchmarks/device_check_8b.py says what and how).
    report      device_check.json and device_check.md in OUT_DIR from the parts' JSON
                files and the shell's parts.tsv (part, exit status, seconds, limit).

`--cpu-smoke` runs parity, throughput, hf and 8b tiny on the CPU (the "device" side is CPU
bf16 autocast; 8b eagerly only) and then the report, so their code paths run without a GPU.

    python benchmarks/device_check.py parity --out /tmp/dc
    python benchmarks/device_check.py --cpu-smoke --out /tmp/dc_smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import statistics
import sys
import time
import traceback

# The Llama-style architecture (the ModelConfig defaults are Megatron-LM's GPT-2 style).
LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
             add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GIB = 2 ** 30
LOSS_RTOL = 1e-2  # bf16 keeps 8 significant bits (2^-8 = 0.4%); a first loss ~ ln(vocab)
GRAD_NORM_RTOL = 5e-2  # gradients go through every bf16 matmul of forward and backward
PARTS = ("parity", "throughput", "hf", "8b")
LETTER = {"pytest": "a", "parity": "b", "throughput": "c", "hf": "d", "8b": "f"}

# (c)'s model: the paper's 1.2B, Llama style.
BIG = dict(layers=24, hidden=2048, heads=16, ffn=5504, vocab=50257, seq=32768)
SMOKE = dict(layers=2, hidden=64, heads=4, ffn=192, vocab=500, seq=128)
STEP_DOWN = (32768, 16384, 8192, 4096)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("part", nargs="?", choices=PARTS + ("report",),
                   help="the part to run (omit with --cpu-smoke: all of them)")
    p.add_argument("--out", default=None,
                   help="output folder; default $OUT/device_check, else device_check_out")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="parts (b)-(d) tiny on the CPU, then the report (no GPU needed)")
    p.add_argument("--seq", type=int, default=None,
                   help="(c)/(d): the first sequence length to try; default 32768 "
                        "((d): the one (c) reached)")
    p.add_argument("--steps", type=int, default=3,
                   help="(c)/(d)/(f): timed steps after the warm-up (1; (f): 2)")
    p.add_argument("--layers", type=int, default=None,
                   help="(f): layers of the 8B shape; default: the first of 4, 2 whose "
                        "memory plan at 32K fits the GPU")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    if args.part is None and not args.cpu_smoke:
        p.error("name a part, or pass --cpu-smoke")
    if args.layers is not None and args.layers < 1:
        p.error("--layers: at least 1")
    if args.out is None:
        args.out = (os.path.join(os.environ["OUT"], "device_check") if os.environ.get("OUT")
                    else "device_check_out")
    return args


def _write(out: str, name: str, record: dict) -> dict:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"part_{name}.json"), "w") as f:
        json.dump(record, f, indent=1, default=str)
    print(f"[{name}] {json.dumps(record, default=str)}", flush=True)
    return record


def _devices(smoke: bool):
    import torch
    if smoke:
        return torch.device("cpu"), "cpu"
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device (use --cpu-smoke on a CPU machine)")
    return torch.device("cuda"), torch.cuda.get_device_name(0)


def _sync(device):
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize()


# -- (b) parity ------------------------------------------------------------------------------

def part_parity(args) -> dict:
    import torch
    from megaulysses.config import ModelConfig, TrainConfig
    from megaulysses.model.attention import select_backend
    from megaulysses.model.gpt import build_model
    from megaulysses.training.optim import build_optimizer

    device, name = _devices(args.cpu_smoke)
    cfg = ModelConfig(num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2,
                      seq_length=256, vocab_size=1000, make_vocab_size_divisible_by=8,
                      untie_embeddings_and_output_weights=True, **LLAMA)
    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=gen)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def one_step(dev, dtype, state=None):
        backend, core = select_backend("auto", dev, dtype)
        model = build_model(cfg, core, args.seed, dev)
        if state is not None:  # the very same initial weights as the reference
            model.load_state_dict(state)
        model.train()
        opt = build_optimizer(model, TrainConfig(lr=1e-3, weight_decay=0.1, adam_beta1=0.9,
                                                 adam_beta2=0.95, adam_eps=1e-8))
        x, y = inputs.to(dev), targets.to(dev)

        def loss_now():
            with torch.autocast(dev.type, dtype=dtype, enabled=dtype != torch.float32):
                return model(x, labels=y).mean()

        loss = loss_now()
        loss.backward()
        loss = loss.detach()
        grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters()}
        norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            loss2 = float(loss_now())
        init = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()} \
            if state is None else None
        return dict(backend=backend, loss=float(loss), grad_norm=norm, loss_after_step=loss2,
                    grads=grads, init=init)

    # the reference's initial weights: build_model's init, before its step
    ref_model = build_model(cfg, select_backend("auto", torch.device("cpu"))[1], args.seed)
    init = {k: v.detach().clone() for k, v in ref_model.state_dict().items()}
    del ref_model
    ref = one_step(torch.device("cpu"), torch.float32, None)
    dev = one_step(device, torch.bfloat16, init)
    cos = min(float(torch.nn.functional.cosine_similarity(
        ref["grads"][n].flatten(), dev["grads"][n].flatten(), dim=0)) for n in ref["grads"])
    rel = lambda a, b: abs(a - b) / max(abs(b), 1e-12)  # noqa: E731
    loss_rel = rel(dev["loss"], ref["loss"])
    norm_rel = rel(dev["grad_norm"], ref["grad_norm"])
    ok = loss_rel <= LOSS_RTOL and norm_rel <= GRAD_NORM_RTOL
    return dict(
        part="parity", status="ok" if ok else "fail", device=name,
        model="2 layers, hidden 128, 4 heads / 2 kv, seq 256, batch 2, vocab 1000",
        reference=f"cpu fp32 ({ref['backend']})",
        checked=f"{device.type} bf16 autocast ({dev['backend']})",
        loss_ref=ref["loss"], loss_dev=dev["loss"], loss_rel_diff=loss_rel,
        loss_rtol=LOSS_RTOL, grad_norm_ref=ref["grad_norm"], grad_norm_dev=dev["grad_norm"],
        grad_norm_rel_diff=norm_rel, grad_norm_rtol=GRAD_NORM_RTOL,
        min_grad_cosine=cos, loss_after_step_ref=ref["loss_after_step"],
        loss_after_step_dev=dev["loss_after_step"])


# -- (c) our throughput ----------------------------------------------------------------------

def model_flags(shape: dict, seq: int) -> list:
    return ["--num-layers", str(shape["layers"]), "--hidden-size", str(shape["hidden"]),
            "--num-attention-heads", str(shape["heads"]), "--seq-length", str(seq),
            "--max-position-embeddings", str(seq), "--micro-batch-size", "1",
            "--global-batch-size", "1", "--train-iters", "100", "--lr-warmup-iters", "0",
            "--eval-iters", "0", "--log-interval", "1000", "--generate", "0",
            "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(shape["vocab"]), "--untie-embeddings-and-output-weights",
            "--ffn-hidden-size", str(shape["ffn"]),
            "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
            "--disable-bias-linear", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--recompute-granularity", "full", "--clip-grad", "0",
            "--attention-backend", "auto", "--bf16", "--seed", "1234",
            "--peak-tflops", "1"]  # MFU is computed here; no matmul timing at start-up


def _peak_tflops(device, name: str):
    """(TFLOP/s, where it came from): the bf16 peak of metrics.GPU_PEAKS' entry for this
    GPU (most specific name first), else a measured matmul."""
    import torch
    from megaulysses.training.metrics import gpu_peak, peak_tflops
    hit = gpu_peak(name)
    if hit is not None:
        return hit[1].half, f"GPU_PEAKS[{' '.join(hit[0])!r}] (bf16 dense)"
    return peak_tflops(device, torch.bfloat16, None), "measured matmul (not in GPU_PEAKS)"


def part_throughput(args) -> dict:
    import torch
    from megaulysses.config import parse_args as parse_flags, resolve
    from megaulysses.planner.memory import plan_memory
    from megaulysses.training.data import load_tokenizer
    from megaulysses.model.gpt import parameter_count
    from megaulysses.training.metrics import flops_per_iteration
    from megaulysses.training.step import train_step
    from megaulysses.training.trainer import Trainer

    device, name = _devices(args.cpu_smoke)
    shape = SMOKE if args.cpu_smoke else BIG
    seqs = [args.seq or shape["seq"]] if args.cpu_smoke else \
        [s for s in STEP_DOWN if s <= (args.seq or shape["seq"])]
    peak, peak_source = _peak_tflops(device, name)
    total = torch.cuda.get_device_properties(0).total_memory if device.type == "cuda" else None
    tried = []
    for seq in seqs:
        cfg = parse_flags(model_flags(shape, seq))
        cfg = resolve(cfg, 1, load_tokenizer(cfg).vocab_size)
        plan = plan_memory(cfg, cfg.dims, 0, device.type)
        if total is not None and plan.peak_bytes > 0.95 * total:
            tried.append(dict(seq=seq, result=f"skipped: the plan predicts "
                                             f"{plan.peak_bytes / GIB:.1f} GiB of "
                                             f"{total / GIB:.1f}"))
            continue
        trainer = None
        try:
            trainer = Trainer(cfg)
            backend = trainer.run.backend
            t = cfg.train

            def step(i, trainer=trainer, t=t):
                batches = trainer.train_data.micro_batches(i * t.global_batch_size)
                _sync(device)
                t0 = time.perf_counter()
                r = train_step(trainer.model, batches, trainer.zero, trainer.scaler,
                               t.clip_grad, trainer.device, trainer.dtype, trainer.comm,
                               trainer.pipeline)
                _sync(device)
                return time.perf_counter() - t0, r

            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            warm, r0 = step(0)
            first_peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            times, losses = [], [r0.loss]
            for i in range(1, args.steps + 1):
                dt, r = step(i)
                times.append(dt)
                losses.append(r.loss)
            steady_peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
        except torch.cuda.OutOfMemoryError as e:  # its traceback holds the step's tensors:
            tried.append(dict(seq=seq, result=f"out of memory: {str(e).splitlines()[0]}"))
            oom = True  # freed below, once the except block has dropped it
        else:
            oom = False
        if oom:
            trainer = step = None
            gc.collect()
            torch.cuda.empty_cache()
            continue
        sec = statistics.median(times)
        flops = flops_per_iteration(cfg.model, 1)
        tflops = flops / sec / 1e12
        tried.append(dict(seq=seq, result="ok"))
        m = cfg.model
        rec = dict(
            part="throughput", status="ok", device=name,
            flags=model_flags(shape, seq),  # tools/plan.py --calibration re-plans this step
            model=(f"Llama style (RoPE, RMSNorm, SwiGLU, untied, no bias): {m.num_layers} "
                   f"layers, hidden {m.hidden_size}, ffn {m.ffn_size}, {m.num_attention_heads}"
                   f" heads, vocab {m.vocab_size} (padded {m.padded_vocab_size})"),
            params=parameter_count(m),
            params_without_embeddings=parameter_count(m) - 2 * m.padded_vocab_size
            * m.hidden_size,
            seq=seq, requested_seq=seqs[0], stepped_down=seq != seqs[0], tried=tried,
            attention_backend=backend, dtype="bf16 autocast, fp32 weights and AdamW states",
            recompute="full (uniform, 1 layer)", warmup_step_s=warm, step_s=sec,
            step_s_all=times, losses=losses, tokens_per_s=seq / sec,
            model_tflop_per_step=flops / 1e12, tflops=tflops, peak_tflops=peak,
            peak_tflops_source=peak_source, mfu=tflops / peak,
            plan_peak_gib=plan.peak_bytes / GIB, plan_peak_moment=plan.peak_moment,
            plan_attention=plan.attention,
            measured_peak_gib=None if steady_peak is None else steady_peak / GIB,
            first_step_peak_gib=None if first_peak is None else first_peak / GIB,
            gpu_total_gib=None if total is None else total / GIB)
        if steady_peak is not None:
            rec["plan_error"] = (plan.peak_bytes - steady_peak) / steady_peak
        else:
            rec["measured_peak_gib_note"] = "no CUDA allocator on CPU: not measured"
        return rec
    return dict(part="throughput", status="fail", device=name, tried=tried,
                error="no sequence length fitted")


# -- (d) Hugging Face ----------------------------------------------------------------------

def part_hf(args) -> dict:
    import torch
    try:
        import transformers
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        return dict(part="hf", status="skipped", reason=f"transformers not installed ({e})")
    from megaulysses.config import ModelConfig

    device, name = _devices(args.cpu_smoke)
    shape = SMOKE if args.cpu_smoke else BIG
    ours = _read(args.out, "throughput")
    seq = args.seq or (ours or {}).get("seq") or shape["seq"]
    seqs = [seq] if args.cpu_smoke else [s for s in STEP_DOWN if s <= seq]
    m = ModelConfig(num_layers=shape["layers"], hidden_size=shape["hidden"],
                    num_attention_heads=shape["heads"], vocab_size=shape["vocab"],
                    ffn_hidden_size=shape["ffn"], **LLAMA)
    tried = []
    for seq in seqs:
        model = opt = None
        try:
            cfg = LlamaConfig(vocab_size=m.padded_vocab_size, hidden_size=m.hidden_size,
                              intermediate_size=m.ffn_size, num_hidden_layers=m.num_layers,
                              num_attention_heads=m.num_attention_heads,
                              num_key_value_heads=m.num_kv_heads, max_position_embeddings=seq,
                              rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                              attention_bias=False, mlp_bias=False, hidden_act="silu",
                              use_cache=False, attn_implementation="sdpa")
            torch.manual_seed(args.seed)
            with torch.device(device):
                model = LlamaForCausalLM(cfg)
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
                model.activation_checkpointing_enable(
                    activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1,
                                    betas=(0.9, 0.95), eps=1e-8,
                                    fused=device.type == "cuda")
            gen = torch.Generator().manual_seed(args.seed)
            tokens = torch.randint(0, shape["vocab"], (1, seq + 1), generator=gen)
            x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)

            def step(model=model, opt=opt, x=x, y=y):
                _sync(device)
                t0 = time.perf_counter()
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = model(input_ids=x, labels=x, shift_labels=y).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                loss = float(loss.detach())
                return time.perf_counter() - t0, loss

            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            warm, loss0 = step()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            times = [step()[0] for _ in range(args.steps)]
            peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
        except torch.cuda.OutOfMemoryError as e:
            tried.append(dict(seq=seq, result=f"out of memory: {str(e).splitlines()[0]}"))
            oom = True
        else:
            oom = False
        if oom:
            model = opt = step = None
            gc.collect()
            torch.cuda.empty_cache()
            continue
        sec = statistics.median(times)
        tried.append(dict(seq=seq, result="ok"))
        rec = dict(part="hf", status="ok", device=name, transformers=transformers.__version__,
                   model="LlamaForCausalLM, same shape and padded vocabulary",
                   attn_implementation=getattr(model.config, "_attn_implementation", "sdpa"),
                   gradient_checkpointing=True, params=sum(p.numel() for p in
                                                            model.parameters()),
                   seq=seq, tried=tried, warmup_step_s=warm, first_loss=loss0, step_s=sec,
                   step_s_all=times, tokens_per_s=seq / sec,
                   measured_peak_gib=None if peak is None else peak / GIB)
        if ours and ours.get("status") == "ok" and ours.get("seq") == seq:
            rec["ratio_ours_over_hf"] = ours["tokens_per_s"] / rec["tokens_per_s"]
        return rec
    return dict(part="hf", status="fail", device=name, tried=tried,
                error="no sequence length fitted")


# -- (f) Llama-3-8B's shape, eager and compiled -----------------------------------------

def part_8b(args) -> dict:
    from device_check_8b import run_8b  # this script's folder: sys.path[0]
    return run_8b(args, model_flags, _peak_tflops)


# -- the report ------------------------------------------------------------------------------

def _read(out: str, name: str):
    path = os.path.join(out, f"part_{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _pytest_summary(out: str) -> str:
    path = os.path.join(out, "pytest.log")
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        lines = [line.strip() for line in f if line.strip()]
    summary = [line for line in lines if " in " in line and any(
        w in line for w in ("passed", "skipped", "failed", "error", "deselected"))]
    return summary[-1].strip("= ") if summary else (lines[-1] if lines else "")


def _shell_status(out: str) -> dict:
    """{part: (exit status, seconds, limit)} from the shell's parts.tsv."""
    path, status = os.path.join(out, "parts.tsv"), {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                cols = line.rstrip("\n").split("\t")
                if len(cols) == 4:
                    status[cols[0]] = (cols[1], cols[2], cols[3])
    return status


def _fmt(x, spec=".3g"):
    return "n/a" if x is None else format(x, spec)


def report(out: str) -> dict:
    shell = _shell_status(out)
    parts = {}
    for name in ("pytest",) + PARTS:
        rec = (_read(out, name) if name != "pytest" else None) or {}
        rc, secs, limit = shell.get(name, (None, None, None))
        if name == "pytest" and rc is not None:
            rec = dict(part="pytest", command="python -m pytest -q -m cuda",
                       summary=_pytest_summary(out),
                       status="ok" if rc == "0" else "fail")
        if rc == "skipped":
            rec = dict(part=name, status="skipped", reason="no CUDA device")
        elif rc in ("124", "137"):
            rec = dict(rec, status="timeout", limit_s=limit)
        elif rc not in (None, "0") and rec.get("status") in (None, "ok"):
            rec = dict(rec, status="fail", error=rec.get("error", f"exit status {rc}"))
        elif not rec:
            rec = dict(part=name, status="not run")
        rec["exit_status"], rec["seconds"] = rc, secs
        parts[name] = rec
    result = dict(parts=parts, ok=all(p["status"] in ("ok", "skipped")
                                      for p in parts.values()))
    with open(os.path.join(out, "device_check.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    md = _markdown(parts)
    with open(os.path.join(out, "device_check.md"), "w") as f:
        f.write(md)
    print(md)
    return result


def _markdown(parts: dict) -> str:
    def row(name, rec, what):
        return (f"| ({LETTER[name]}) {name} | {rec['status']} | {rec.get('seconds') or 'n/a'} "
                f"| {what} |")

    rows = ["| part | status | s | result |", "|---|---|---|---|"]
    a = parts["pytest"]
    rows.append(row("pytest", a, a.get("summary") or a.get("reason", "")))
    b = parts["parity"]
    rows.append(row("parity", b, (
        f"{b['checked']} vs {b['reference']}: loss {_fmt(b['loss_dev'], '.5f')} vs "
        f"{_fmt(b['loss_ref'], '.5f')} (rel {_fmt(b['loss_rel_diff'])} <= {b['loss_rtol']}); "
        f"grad norm {_fmt(b['grad_norm_dev'], '.4f')} vs {_fmt(b['grad_norm_ref'], '.4f')} "
        f"(rel {_fmt(b['grad_norm_rel_diff'])} <= {b['grad_norm_rtol']}); min grad cosine "
        f"{_fmt(b['min_grad_cosine'], '.4f')}") if "loss_dev" in b else _why(b)))
    c = parts["throughput"]
    rows.append(row("throughput", c, (
        f"{c['params'] / 1e9:.2f}B params, seq {c['seq']}"
        f"{' (stepped down from ' + str(c['requested_seq']) + ')' if c['stepped_down'] else ''}"
        f", {c['attention_backend']}, full recompute: {c['tokens_per_s']:.0f} tokens/s, "
        f"{c['tflops']:.1f} TFLOP/s, MFU {100 * c['mfu']:.1f}% of {c['peak_tflops']:.0f}; "
        f"peak {_fmt(c['measured_peak_gib'], '.2f')} GiB vs plan "
        f"{c['plan_peak_gib']:.2f} GiB") if "tokens_per_s" in c else _why(c)))
    d = parts["hf"]
    rows.append(row("hf", d, (
        f"LlamaForCausalLM seq {d['seq']}, {d['attn_implementation']}, grad checkpointing: "
        f"{d['tokens_per_s']:.0f} tokens/s; ratio ours/hf "
        f"{_fmt(d.get('ratio_ours_over_hf'), '.2f')}") if "tokens_per_s" in d else _why(d)))
    from device_check_8b import report_row, report_section
    f = parts["8b"]
    rows.append(row("8b", f, report_row(f) or _why(f)))
    return "\n".join(rows + report_section(f)) + "\n"


def _why(rec: dict) -> str:
    for key in ("reason", "error", "tried"):
        if rec.get(key):
            return str(rec[key]).replace("|", "/").replace("\n", " ")[:300]
    if rec.get("status") == "timeout":
        return f"killed after {rec.get('limit_s')} s"
    return ""


# -- main ------------------------------------------------------------------------------------

RUNNERS = {"parity": part_parity, "throughput": part_throughput, "hf": part_hf,
           "8b": part_8b}


def run_part(args, name: str) -> int:
    try:
        rec = RUNNERS[name](args)
    except SystemExit:
        raise
    except Exception as e:  # reported, and the exit status says it failed
        traceback.print_exc()
        rec = dict(part=name, status="fail", error=f"{type(e).__name__}: {e}")
    _write(args.out, name, rec)
    return 0 if rec["status"] in ("ok", "skipped") else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    os.makedirs(args.out, exist_ok=True)
    if args.part == "report":
        return 0 if report(args.out)["ok"] else 1
    if args.part is not None:
        return run_part(args, args.part)
    # --cpu-smoke: every part in this process, then the report
    import torch
    torch.manual_seed(args.seed)
    with open(os.path.join(args.out, "parts.tsv"), "w") as f:
        f.write("pytest\tskipped\t0\t0\n")
        for name in PARTS:
            t0 = time.perf_counter()
            rc = run_part(args, name)
            f.write(f"{name}\t{rc}\t{time.perf_counter() - t0:.1f}\t0\n")
    return 0 if report(args.out)["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
