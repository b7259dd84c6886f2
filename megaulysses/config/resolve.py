"""resolve(cfg, world_size, vocab_size) -> RunConfig: the one place where the values that
follow from other flags, the world size and the tokenizer are filled in, once.

What it fills: the grid (dp from the world size), the global batch (one micro-batch per
data-parallel rank, times pp under a pipeline), the iterations and the warm-up and decay
(schedule.py: in samples under --train-samples, the batch ramp-up checked), the pipeline
schedule and stage layout, whether Megatron-SP is in effect (asked for, and tp > 1), the
recomputed layers, the signal handler (on under SLURM), the vocabulary (padded by
ModelConfig), wandb's directory (<--save>/wandb by default). Then the rules that need
them (rules.check_grid, rules.check_ring, rules.check_profile_ranks).
The result is frozen: nothing changes it afterwards. Which attention kernel runs depends
on the device and the installed kernels, not on the flags alone: training/run.py picks it
from the resolved config.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Optional

from megaulysses.config.grid import ParallelDims
from megaulysses.config.rules import (check_grid, check_profile_ranks, check_ring,
                                      pipeline_layout, pipeline_schedule, warmup_iters)
from megaulysses.config.compat import MEGATRON_ATTENTION
from megaulysses.config.fields import filled
from megaulysses.config.rules_memory import check_fpdt
from megaulysses.config.rules_offload import check_offload_grid
from megaulysses.config.schedule import resolve_schedule, with_default_iters
from megaulysses.config.schema import Config, LogConfig


@dataclass(frozen=True)
class RunConfig(Config):
    """A Config with every derived value filled, plus the grid and the stages' layers."""
    dims: ParallelDims = field(default_factory=lambda: ParallelDims(1, 1, 1, 1))
    layout: tuple[tuple[int, ...], ...] = ()  # the layers of each pipeline stage, stage 0 first

    @property
    def micro_batches(self) -> int:
        """Micro-batches per step on each data-parallel rank (gradient accumulation)."""
        t = self.train
        gbs = filled(t.global_batch_size, "--global-batch-size")
        return gbs // (t.micro_batch_size * self.dims.dp)


def resolve(cfg: Config, world_size: int, vocab_size: int) -> RunConfig:
    """`cfg` completed for `world_size` ranks and a tokenizer of `vocab_size` ids (ConfigError
    where the grid does not fit the model or the batch). Idempotent."""
    par = cfg.parallel
    dims = ParallelDims.from_world(world_size, tp=par.tensor_model_parallel_size,
                                   pp=par.pipeline_model_parallel_size,
                                   sp=par.ds_sequence_parallel_size,
                                   cp=par.context_parallel_size)
    t = cfg.train
    # one micro-batch per dp rank (Megatron-LM), and pp of them under a pipeline: every stage
    # then has one in flight
    gbs = t.global_batch_size or t.micro_batch_size * dims.dp * dims.pp
    train = replace(
        t, lr_warmup_iters=warmup_iters(with_default_iters(t)), global_batch_size=gbs,
        # SLURM sends SIGTERM before it kills a job
        exit_signal_handler=("SLURM_JOB_ID" in os.environ if t.exit_signal_handler is None
                             else t.exit_signal_handler))
    schedule = pipeline_schedule(par)
    parallel = replace(par, pipeline_schedule=schedule,
                       tp_sequence_parallel=par.tp_sequence_parallel and dims.tp > 1,
                       # Megatron-LM's distributed optimizer shards optimizer states: ZeRO-1
                       zero_stage=max(par.zero_stage, int(par.use_distributed_optimizer)))
    mem = cfg.memory
    full = mem.recompute_granularity == "full"
    memory = replace(mem, recompute_method=mem.recompute_method or ("uniform" if full else None),
                     recompute_num_layers=mem.recompute_num_layers or (1 if full else None))
    backend = cfg.model.attention_backend
    model = replace(cfg.model, vocab_size=vocab_size,
                    attention_backend=MEGATRON_ATTENTION.get(backend, backend),
                    # Megatron-LM's rule: no fused bias-GeLU without biases
                    bias_gelu_fusion=cfg.model.bias_gelu_fusion and cfg.model.add_bias_linear)
    check_grid(dims, model, gbs, train.micro_batch_size, parallel.tp_sequence_parallel, schedule,
               memory.tiled_mlp_chunks, memory.attention_head_groups)
    check_ring(dims, model)
    check_fpdt(dims, model, memory)  # rules_memory.py
    check_offload_grid(dims, par)  # rules_offload.py
    check_profile_ranks(cfg.log, world_size)
    log = replace(cfg.log, wandb_save_dir=wandb_save_dir(cfg.log, t.save))
    # the iterations (from --train-samples: whole global batches, the ramp-up's included)
    train = resolve_schedule(train, dims, schedule)
    layout = tuple(tuple(stage) for stage in pipeline_layout(model.num_layers, parallel))
    return RunConfig(model=model, data=cfg.data, train=train, log=log, parallel=parallel,
                     memory=memory, compat=cfg.compat, preset=cfg.preset, dims=dims,
                     layout=layout)


def wandb_save_dir(log: LogConfig, save: Optional[str]) -> Optional[str]:
    """--wandb-save-dir, or <--save>/wandb (Megatron-LM's default); None without wandb."""
    if not log.wandb_project:
        return None
    if log.wandb_save_dir:
        return log.wandb_save_dir
    # rules._validate_observability requires --wandb-save-dir or --save with --wandb-project
    return os.path.join(filled(save, "--save"), "wandb")
