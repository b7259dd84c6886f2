"""`pretrain_gpt.py --dry-run`: validate a grid and print its memory plan, without training.

The grid's world is `--dry-run-world-size`, else the WORLD_SIZE environment variable (as
torchrun sets it), else 1. Everything the trainer checks at start-up that needs no data
and no process group is checked the same way (`run.resolve_run`: the tokenizer for the
vocabulary size, then `config.resolve`); then `plan_memory` prints each pipeline stage's bytes
per rank and the communication per iteration. Nothing is allocated: the model exists only
on the meta device, inside the plan. The plan is made for `--dry-run-device` (cuda or cpu;
default, the device the trainer would pick here), so a GPU run can be planned on a CPU
machine: the device decides the attention kernel and the loss's chunks. With
`--dry-run-gpu NAME` the plan is for cuda and every printed stage must fit that GPU of the
planner's table less RESERVE_GIB; one that does not is a ConfigError (exit 2), after the
plans are printed.
"""

from __future__ import annotations

import os

import torch

from megaulysses.config import Config, ConfigError, ParallelDims, RunConfig
from megaulysses.config.summary import format_settings
from megaulysses.planner.memory import format_plan, plan_memory
from megaulysses.training.run import (attention_backend, compute_dtype, log_megatron_meanings,
                                      resolve_run)
from megaulysses.training.storage import checkpoint_bytes, mib, tokenizer_files

ALL_STAGES_UP_TO = 4  # more pipeline stages than this: the first and the last are printed


def dry_run(cfg: Config) -> int:
    """Validate `cfg` on its grid and print the plan (from global rank 0 only). Returns the
    exit code, 0; a rule that fails raises ConfigError, as in training."""
    given, cfg = cfg, _resolved(cfg)
    dims = cfg.dims
    speak = int(os.environ.get("RANK", "0")) == 0
    if speak:
        log_megatron_meanings(given, cfg)  # what the trainer would say at start
    if not speak and not cfg.memory.dry_run_gpu:
        return 0
    device = _device(cfg)
    # Every rank plans under --dry-run-gpu (arithmetic only), so every rank exits 2 when
    # the plan does not fit, as with any other rule.
    plans = [plan_memory(cfg, dims, r, device_type=device) for r in _stages_to_print(dims.pp)]
    if speak:
        print(format_settings(cfg))
        print(_header(cfg, dims, device))
        for plan in plans:
            print(format_plan(plan))
        print(_checkpoint_line(cfg))
    if cfg.memory.dry_run_gpu:
        _check_fits(plans, cfg.memory.dry_run_gpu, speak)
    return 0


def _check_fits(plans: list, gpu_name: str, speak: bool = True):
    """Every stage's peak within the GPU's memory less the planner's reserve."""
    from megaulysses.hardware import RESERVE_GIB, gpu_spec
    from megaulysses.planner.time_model import UNMEASURED_MARGIN
    gpu = gpu_spec(gpu_name)
    usable = (gpu.memory_gib - RESERVE_GIB) * 2 ** 30
    worst = max(plans, key=lambda p: p.peak_bytes)
    # as the planner: a share of the kernels' unmeasured buffers kept free beyond the plan
    margin = UNMEASURED_MARGIN * max(p.unmeasured_bytes for p in plans)
    if worst.peak_bytes + margin > usable:
        kept = f" (+{margin / 2 ** 30:.1f} margin)" if margin else ""
        raise ConfigError("--dry-run-gpu", f"pipeline rank {worst.pp_rank} needs "
                          f"{worst.peak_bytes / 2 ** 30:.1f} GiB{kept} a GPU, more than the "
                          f"{usable / 2 ** 30:.1f} GiB usable on {gpu.name} ({gpu.memory_gib:g} "
                          f"GiB less {RESERVE_GIB:g} reserved); python tools/plan.py finds "
                          "grids that fit")
    if speak:
        print(f"fits {gpu.name}: peak {worst.peak_bytes / 2 ** 30:.1f} GiB of "
              f"{usable / 2 ** 30:.1f} GiB usable (pipeline rank {worst.pp_rank})")


def _resolved(cfg: Config) -> RunConfig:
    """The run config on its grid, resolved and checked exactly as build_run does."""
    world = cfg.memory.dry_run_world_size or int(os.environ.get("WORLD_SIZE", "1"))
    run_cfg = resolve_run(cfg, world)[0]
    if not (cfg.memory.dry_run_device or cfg.memory.dry_run_gpu):
        # Planning for this machine: the attention backend must run the mask here, as the
        # trainer checks (another device's backends cannot be checked from this one).
        attention_backend(run_cfg, torch.device(_device(cfg)), compute_dtype(cfg))
    return run_cfg


def _device(cfg: Config) -> str:
    """--dry-run-device (cuda under --dry-run-gpu), else the device the trainer would
    pick."""
    if cfg.memory.dry_run_gpu:
        return "cuda"
    return cfg.memory.dry_run_device or ("cuda" if torch.cuda.is_available() else "cpu")


def _checkpoint_line(cfg: RunConfig) -> str:
    """One checkpoint's size (model and optimizer states in fp32, whole-model shapes):
    what --save needs free at every save."""
    size = checkpoint_bytes(cfg.model, tokenizer_files(cfg).values(), cfg.dims.world)
    return (f"checkpoint: {mib(size)} each (parameters "
            "and AdamW states in fp32, whatever the grid); --save needs that free at every "
            "save")


def _stages_to_print(pp: int) -> list[int]:
    return list(range(pp)) if pp <= ALL_STAGES_UP_TO else [0, pp - 1]


def _header(cfg: Config, dims: ParallelDims, device: str) -> str:
    m, mem, par = cfg.model, cfg.memory, cfg.parallel
    dtype = "bf16" if cfg.train.bf16 else "fp16" if cfg.train.fp16 else "fp32"
    recompute = mem.recompute_granularity or "none"
    if recompute == "full":
        recompute += f" ({mem.recompute_method}, --recompute-num-layers " \
                     f"{mem.recompute_num_layers})"
    return (f"dry run: world {dims.world} = dp {dims.dp} x tp {dims.tp} x pp {dims.pp} x sp "
            f"{dims.sp} x cp {dims.cp}"
            f"{' (Megatron-SP in tp)' if par.tp_sequence_parallel else ''}"
            f"; ZeRO stage {par.zero_stage} over dp*cp*sp = {dims.dp * dims.cp * dims.sp}; "
            f"{m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads, "
            f"seq {m.seq_length} ({m.seq_length // dims.seq_degree} tokens a rank), vocab "
            f"{m.padded_vocab_size} (padded); mask {_mask(cfg)}; {dtype}; recompute "
            f"{recompute}; MLP tiles {mem.tiled_mlp_chunks}; planned for {device}; flags and "
            "grid valid, nothing allocated")


def _mask(cfg: Config) -> str:
    """The attention mask in words: causal, and the window, sparse layout, documents."""
    m, data = cfg.model, cfg.data
    parts = ["causal"]
    if m.window_size is not None:
        parts.append(f"window {m.window_size}")
    if m.attention_sparsity != "dense":
        extra = f", random {m.sparse_random_blocks}" if m.attention_sparsity == "bigbird" else ""
        parts.append(f"{m.attention_sparsity} sparsity (blocks of {m.sparse_block_size}: local "
                     f"{m.sparse_local_blocks}, global {m.sparse_global_blocks}{extra})")
    if data.reset_attention_mask:
        parts.append("packed documents")
    if data.reset_position_ids:
        parts.append("positions restart per document")
    return " + ".join(parts)
