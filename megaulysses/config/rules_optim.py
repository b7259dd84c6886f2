"""The rules of the optimizer's flags: the distributed optimizer, its overlaps and its
offload to the host (schema_run.py's ParallelConfig); rules.validate runs them. Each raises
ConfigError(flag, rule), one line naming the flag."""

from __future__ import annotations

from megaulysses.config.errors import require
from megaulysses.config.schema import Config


def validate_optimizer(cfg: Config) -> None:
    """Megatron-LM's own rules for its distributed optimizer's flags, and the offload's."""
    par = cfg.parallel
    require(not par.overlap_param_gather or par.use_distributed_optimizer
            or par.zero_stage > 0, "--overlap-param-gather",
            "needs the distributed optimizer (--use-distributed-optimizer, or --zero-stage 1 "
            "or more), as in Megatron-LM")
    _validate_offload(cfg)
    require(not (cfg.train.fp16 and par.grad_reduce_dtype == "bf16"), "--grad-reduce-in-bf16",
            "not with --fp16 (--grad-reduce-dtype bf16 would reduce loss-scaled fp16 "
            "gradients in another 16-bit format): use it with --bf16")
    require(not (par.accumulate_allreduce_grads_in_fp32 and par.grad_reduce_dtype == "bf16"),
            "--accumulate-allreduce-grads-in-fp32", "not with --grad-reduce-in-bf16 (a bf16 "
            "gradient buffer; Megatron-LM drops the flag then): give one of them")


def _validate_offload(cfg: Config):
    """--optimizer-cpu-offload moves the distributed optimizer's fp32 state to the host."""
    par = cfg.parallel
    fraction = par.optimizer_offload_fraction
    require(0.0 <= fraction <= 1.0, "--optimizer-offload-fraction",
            f"must be in [0, 1], got {fraction}")
    require(not par.overlap_cpu_optimizer_d2h_h2d or par.optimizer_cpu_offload,
            "--overlap-cpu-optimizer-d2h-h2d", "needs --optimizer-cpu-offload")
    if par.optimizer_cpu_offload:
        require(par.use_distributed_optimizer and (cfg.train.bf16 or cfg.train.fp16)
                and par.zero_stage <= 1, "--optimizer-cpu-offload",
                "needs --use-distributed-optimizer with --bf16 or --fp16 (its fp32 main "
                "weights and moments are what goes to the host) and --zero-stage 0 or 1")
