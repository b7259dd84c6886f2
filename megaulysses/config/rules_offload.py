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
    """One data x sequence-parallel rank (dp * cp * sp = 1) only where it is the whole job:
    one process runs FSDP2 over a world-1 group (dims.init_distributed's `alone`), the
    units streaming from the host. Beside tp or pp ranks that path (FSDP2 over one rank of
    a larger mesh, next to DTensor's tp shards or the pipeline stages) is not tested."""
    require(not par.zero_param_offload or dims.dp * dims.seq_degree > 1 or dims.world == 1,
            FLAG, "needs more than one data x sequence-parallel rank beside tensor or "
            "pipeline parallelism (dp * cp * sp = 1 with tp * pp > 1; one GPU alone is fine)")
