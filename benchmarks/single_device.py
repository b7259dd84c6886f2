"""One training step of our GPT vs Hugging Face `LlamaForCausalLM`, same configuration.

Both models get the same random tokens and train on the same next-token loss over exactly
`seq` positions, so a step does the same work for both and tokens/s is `micro_batch * seq`
over the step time, counted identically:

    tokens [b, seq + 1] (random ids)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]                # [b, seq] each
    ours: model(inputs, labels=targets).mean()          # our model returns per-token losses
    HF:   model(input_ids=inputs, labels=inputs, shift_labels=targets).loss

HF's `labels=` alone would shift internally and drop the last position (seq - 1 losses from
seq positions); `shift_labels` is HF's documented way to pass already shifted targets, so
HF also computes mean cross entropy over all `seq` positions, no wasted position.

A step is forward, backward, `optimizer.step()` and `zero_grad()` (no gradient clipping
for either). Optimizers start equal: AdamW(lr 1e-4, weight decay 0.1, betas 0.9/0.95,
eps 1e-8); ours is built by our trainer's `build_optimizer` (`fused=True`, Megatron's groups:
no decay on norm weights), HF's is plain `torch.optim.AdamW` over all parameters, as an HF
user would write it. Both models are in memory together and
are timed alternately (warm-up steps for each, then `--rounds` rounds of `--steps` steps of
ours then HF) so that load from other processes hits both alike; the reported time per
step is the median over all timed steps of each.

With --compile (the default) each model is timed compiled too, in the same rounds: ours
as the trainer's --torch-compile compiles it (each block and the loss,
parallel/compile.py), HF's as an HF user would (`torch.compile(model)`); each compiled
model is a second copy from the same initial weights, compiled during its warm-up steps
(each compile logged, not timed). Every row reports the minimum and the median.

The last lines are exactly `ratio ours/hf: X` (ours tokens/s over HF tokens/s, medians),
then with --compile `ratio ours-compiled/hf: X` and `ratio ours-compiled/hf-compiled: X`.

    python benchmarks/single_device.py                         # the full default run
    python benchmarks/single_device.py --layers 2 --seq 128    # a quick one
    python benchmarks/single_device.py --layers 4 --hidden 384 --seq 256   # the Llama shape
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import nullcontext

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megaulysses.config import ModelConfig, TrainConfig  # noqa: E402
from megaulysses.model.attention import select_backend  # noqa: E402
from megaulysses.model.gpt import build_model, count_parameters  # noqa: E402
from megaulysses.parallel.compile import apply_compile  # noqa: E402
from megaulysses.training.optim import build_optimizer  # noqa: E402

# The Llama-style architecture (the ModelConfig defaults are Megatron-LM's GPT-2 style).
LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
             add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (MHA)")
    p.add_argument("--ffn", type=int, default=1376)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--device", default="auto", help="auto: cuda when present, else cpu")
    p.add_argument("--dtype", choices=("auto",) + tuple(DTYPES), default="auto",
                   help="auto: fp32 on CPU, bf16 autocast on CUDA; 16-bit means autocast")
    p.add_argument("--attention-backend", default="auto", help="ours: auto|sdpa|flash|math")
    p.add_argument("--hf-attn", default="sdpa", help="HF attn_implementation")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per model first")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=2, help="timed steps per model per round")
    p.add_argument("--threads", type=int, default=None, help="torch threads; default: torch's")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="time both models compiled too (torch.compile; ours: --torch-compile)")
    p.add_argument("--same-init", action=argparse.BooleanOptionalAction, default=True,
                   help="start HF from our initial weights (else HF's own init): the first "
                        "losses must then agree, which checks that both compute the same")
    args = p.parse_args(argv)
    for flag in ("layers", "hidden", "heads", "ffn", "vocab", "seq", "micro_batch", "rounds",
                 "steps"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    return args


def resolve(args):
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    if args.dtype == "auto":
        args.dtype = "bf16" if device.type == "cuda" else "fp32"
    return device, DTYPES[args.dtype]


def build_ours(args, device, dtype, compiled: bool = False):
    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden,
                      ffn_hidden_size=args.ffn, num_attention_heads=args.heads,
                      num_query_groups=args.kv_heads, seq_length=args.seq,
                      vocab_size=args.vocab, make_vocab_size_divisible_by=1,
                      untie_embeddings_and_output_weights=True,
                      attention_backend=args.attention_backend, **LLAMA)
    backend, core = select_backend(cfg.attention_backend, device, dtype)
    model = build_model(cfg, core, args.seed, device)
    model.train()
    if compiled:  # as the trainer's --torch-compile: each block and the loss
        print(apply_compile(model))
    opt = build_optimizer(model, TrainConfig(lr=1e-4, weight_decay=0.1, adam_beta1=0.9,
                                             adam_beta2=0.95, adam_eps=1e-8))

    def loss_fn(inputs, targets):
        return model(inputs, labels=targets).mean()

    fused = opt.defaults.get("fused")
    return model, opt, loss_fn, (f"attention {backend} ({core.__name__}), our trainer's "
                                 f"AdamW (fused={fused}, no decay on 1-D params)")


def build_hf(args, device, dtype, compiled: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.ffn, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads or args.heads,
                      max_position_embeddings=args.seq, rms_norm_eps=1e-5,
                      rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False,
                      mlp_bias=False, hidden_act="silu", use_cache=False,
                      attn_implementation=args.hf_attn)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(cfg).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95),
                            eps=1e-8)
    run = torch.compile(model) if compiled else model  # HF's documented way

    def loss_fn(inputs, targets):
        # `labels` only switches the loss on; `shift_labels` are the targets used.
        return run(input_ids=inputs, labels=inputs, shift_labels=targets).loss

    impl = getattr(model.config, "_attn_implementation", args.hf_attn)
    return model, opt, loss_fn, f"attn_implementation {impl}, torch.optim.AdamW"


@torch.no_grad()
def copy_weights_to_hf(ours, hf):
    """Give the HF model our initial weights (same architecture; only the names differ)."""
    pairs = [(ours.embed.word, hf.model.embed_tokens), (ours.head.norm, hf.model.norm),
             (ours.head.output, hf.lm_head)]
    for i, hl in enumerate(hf.model.layers):
        ol = ours.layers[str(i)]
        pairs += [(ol.attn_norm, hl.input_layernorm), (ol.mlp_norm, hl.post_attention_layernorm),
                  (ol.attn.q, hl.self_attn.q_proj), (ol.attn.k, hl.self_attn.k_proj),
                  (ol.attn.v, hl.self_attn.v_proj), (ol.attn.out, hl.self_attn.o_proj),
                  (ol.mlp.gate, hl.mlp.gate_proj), (ol.mlp.fc1, hl.mlp.up_proj),
                  (ol.mlp.fc2, hl.mlp.down_proj)]
    for src, dst in pairs:
        dst.weight.copy_(src.weight)
    assert len(pairs) == len(list(hf.parameters())) == len(list(ours.parameters()))


def make_step(opt, loss_fn, inputs, targets, autocast):
    def step():
        with autocast():
            loss = loss_fn(inputs, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def timed(step, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    loss = step()
    loss = float(loss)  # waits for the device
    return time.perf_counter() - t0, loss


def build_runs(args, device, dtype, inputs, targets, autocast) -> dict:
    """{name: step function}: ours, hf, and with --compile their compiled copies."""
    variants = [("ours", False), ("hf", False)]
    if args.compile:
        variants += [("ours-compiled", True), ("hf-compiled", True)]
    runs, ours = {}, {}
    for name, compiled in variants:
        if name.startswith("ours"):
            model, opt, loss_fn, desc = build_ours(args, device, dtype, compiled)
            ours[compiled] = model
        else:
            model, opt, loss_fn, desc = build_hf(args, device, dtype, compiled)
            if args.same_init:
                copy_weights_to_hf(ours[compiled], model)
                desc += ", started from our initial weights"
        print(f"{name}: {count_parameters(model) / 1e6:.2f}M params, {desc}"
              + (", compiled" if compiled else ""))
        runs[name] = make_step(opt, loss_fn, inputs, targets, autocast)
    return runs


def run_rounds(args, runs: dict, device) -> tuple[dict, dict]:
    """Warm-up steps of each (the compiled ones compile then), then `--rounds` rounds of
    `--steps` steps of each in turn. Returns ({name: [s per timed step]}, {name: the first
    step's loss})."""
    times, first = {name: [] for name in runs}, {}
    for name, step in runs.items():
        for i in range(args.warmup):
            dt, loss = timed(step, device)
            first.setdefault(name, loss)
            print(f"warm-up {name} step {i + 1}: {dt:.3f} s, loss {loss:.4f}")
    for r in range(args.rounds):
        line = []
        for name, step in runs.items():
            for _ in range(args.steps):
                dt, loss = timed(step, device)
                first.setdefault(name, loss)
                times[name].append(dt)
            line.append(f"{name} {statistics.median(times[name][-args.steps:]):.3f} s/step")
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(line))
    return times, first


def report(times: dict, first: dict, tokens_per_step: int) -> None:
    print("initial loss: " + ", ".join(f"{name} {loss:.6f}" for name, loss in first.items()))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    tps = {name: tokens_per_step / med[name] for name in times}
    for name in times:
        print(f"{name} tokens/s: {tps[name]:.1f}")
    print()
    w = max(len(name) for name in times)
    print(f"| {'':{w}} | {'s/step (median)':>15} | {'min':>7} | {'max':>7} | {'tokens/s':>9} |")
    print(f"|{'-' * (w + 2)}|{'-' * 17}|{'-' * 9}|{'-' * 9}|{'-' * 11}|")
    for name, ts in times.items():
        print(f"| {name:{w}} | {med[name]:15.3f} | {min(ts):7.3f} | {max(ts):7.3f} "
              f"| {tps[name]:9.1f} |")
    print()
    print(f"ratio ours/hf: {tps['ours'] / tps['hf']:.2f}")
    if "ours-compiled" in tps:
        print(f"ratio ours-compiled/hf: {tps['ours-compiled'] / tps['hf']:.2f}")
        print(f"ratio ours-compiled/hf-compiled: "
              f"{tps['ours-compiled'] / tps['hf-compiled']:.2f}")


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = resolve(args)
    half = dtype != torch.float32
    if half:
        def autocast():
            return torch.autocast(device.type, dtype=dtype)
    else:
        autocast = nullcontext

    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=gen)
    inputs = tokens[:, :-1].contiguous().to(device)  # [b, seq]
    targets = tokens[:, 1:].contiguous().to(device)  # [b, seq]: the next token of each
    tokens_per_step = args.micro_batch * args.seq

    import transformers
    print(f"device {device}, dtype {args.dtype}{' (autocast)' if half else ''}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"transformers {transformers.__version__}")
    print(f"config: layers {args.layers}, hidden {args.hidden}, heads {args.heads}"
          f"/{args.kv_heads or args.heads} kv, ffn {args.ffn}, vocab {args.vocab}, "
          f"seq {args.seq}, micro batch {args.micro_batch} "
          f"({tokens_per_step} tokens/step)")
    runs = build_runs(args, device, dtype, inputs, targets, autocast)
    times, first = run_rounds(args, runs, device)
    report(times, first, tokens_per_step)


if __name__ == "__main__":
    main()
