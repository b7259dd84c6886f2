"""What the distributed optimizer keeps and does in a run, from its settings alone: the
gradient buffer's dtype, whether weight gradients are fused, the start-up log's line
(dist_opt.py builds the optimizer itself)."""

from __future__ import annotations

import torch

from megaulysses.config import Config, RunConfig
from megaulysses.parallel.wgrad import wgrad_backend


def grad_buffer_dtype(cfg) -> torch.dtype:
    """The distributed optimizer's gradient buffer, Megatron-LM's: bf16 with
    --grad-reduce-in-bf16; under --fp16 the weights' fp16 unless
    --accumulate-allreduce-grads-in-fp32; else fp32 (Megatron-LM sets that flag itself
    under --bf16)."""
    par = cfg.parallel
    if par.grad_reduce_dtype == "bf16":
        return torch.bfloat16
    if cfg.train.fp16 and not par.accumulate_allreduce_grads_in_fp32:
        return torch.float16
    return torch.float32


def fuses_weight_gradients(cfg: Config) -> bool:
    """Megatron-LM's gradient-accumulation fusion (its default) in this distributed-
    optimizer run: off by --no-gradient-accumulation-fusion, under zero-bubble (its weight
    pass needs autograd's weight gradients) and under tensor parallelism (DTensor weights:
    not done here)."""
    par = cfg.parallel
    return not (par.no_gradient_accumulation_fusion or par.pipeline_schedule == "zero-bubble"
                or par.tensor_model_parallel_size > 1)


def describe(cfg: RunConfig) -> str:
    """What --use-distributed-optimizer is in this run, for the start-up log."""
    par, t = cfg.parallel, cfg.train
    n = cfg.dims.dp * cfg.dims.seq_degree
    if par.zero_stage >= 2:
        return f"--zero-stage {par.zero_stage} stays (FSDP2: it shards more)"
    if not (t.bf16 or t.fp16):
        return (f"ZeRO-1 under fp32 (weights and gradients fp32 on every rank, Adam moments "
                f"sharded over dp x sp = {n}): Megatron-LM's 8 + 8/{n} bytes per parameter"
                + ("; its all-gather after the step is not overlapped (--overlap-param-gather "
                   "overlaps the 16-bit one of --bf16/--fp16)" if par.overlap_param_gather
                   else ""))
    half = "bf16" if t.bf16 else "fp16"
    buffer = grad_buffer_dtype(cfg)
    grad = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[buffer]
    e = 6 + 12 / n if buffer == torch.float32 else 4 + 16 / n
    host = (f"; --optimizer-cpu-offload: main weights and moments of "
            f"{par.optimizer_offload_fraction:g} of the parameters on the host"
            if par.optimizer_cpu_offload else "")
    gather = ("overlaps the next step's forward (--overlap-param-gather)"
              if par.overlap_param_gather else "runs after the step")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    off = ("--no-gradient-accumulation-fusion" if par.no_gradient_accumulation_fusion
           else "no gradient-accumulation fusion under "
           + ("--pipeline-schedule zero-bubble" if par.pipeline_schedule == "zero-bubble"
              else "tensor parallelism here"))
    fusion = (f"linear layers' weight gradients added into the buffer directly, in its "
              f"dtype, no per-micro-batch gradient (gradient-accumulation fusion: "
              f"{wgrad_backend(device)})"
              if fuses_weight_gradients(cfg) else
              f"each weight gradient made in 16 bits, then added into the buffer ({off})")
    return (f"Megatron-LM's distributed optimizer: {half} weights, {grad} gradient buffer, "
            f"fp32 main weights and Adam moments sharded over dp x sp = {n}: {e:.2f} bytes "
            f"per parameter{host}; {fusion}. Overlapping compute: the gradients' "
            f"reduce-scatter (the last backward); the 16-bit weights' all-gather {gather}")
