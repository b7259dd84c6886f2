"""The rules of --zero-param-offload (parallel/zero_units.py: FSDP2's CPUOffloadPolicy on
every ZeRO-3 unit): what it needs of the ZeRO stage and what it cannot be combined with.
`check_param_offload` needs the flags alone (rules.validate runs it); `check_offload_grid`
the grid (resolve runs it). Each raises ConfigError(flag, rule), one line naming the flag."""

from __future__ import annotations

from megaulysses.config.errors import require
from megaulysses.config.grid import ParallelDims
from megaulysses.config.schema import Config

FLAG = "--zero-param-offload"


def check_param_offload(cfg: Config) -> None:
    par = cfg.parallel
    if not par.zero_param_offload:
        return
    require(par.zero_stage == 3, FLAG, "needs --zero-stage 3 (FSDP2's units are what move "
            f"their shards to the host; got --zero-stage {par.zero_stage})")
    # At stage 3 the distributed optimizer's flag changes nothing (FSDP shards more); its
    # own host offload is --optimizer-cpu-offload at stage 0/1: say which one, not both.
    require(not par.use_distributed_optimizer, FLAG, "not with --use-distributed-optimizer "
            "(its own host offload is --optimizer-cpu-offload, at --zero-stage 0 or 1)")


def check_offload_grid(dims: ParallelDims, par) -> None:
    """FSDP runs only where ZeRO shards over more than one rank (dp x cp x sp > 1; on one
    such rank every stage is stage 0, with nothing to offload per unit)."""
    require(not par.zero_param_offload or dims.dp * dims.seq_degree > 1, FLAG,
            "needs more than one data x sequence-parallel rank (dp * cp * sp = 1: ZeRO, "
            "and FSDP with it, is off on one such rank)")
