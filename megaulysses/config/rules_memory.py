"""The rules of the activation-memory flags that full recomputation or the grid decide:
--cpu-offloading-num-layers (needs full recomputation: it moves what that keeps) and
--attention-head-groups (the heads a rank attends over must split into those groups)."""

from __future__ import annotations

from megaulysses.config.errors import ConfigError, require
from megaulysses.config.grid import ParallelDims
from megaulysses.config.schema import MemoryConfig, ModelConfig


def check_offload(mem: MemoryConfig, fewest_stage_layers: int) -> None:
    n = mem.cpu_offloading_num_layers
    require(n >= 0, "--cpu-offloading-num-layers", f"must be >= 0, got {n}")
    if n == 0:
        return
    require(mem.recompute_granularity == "full", "--cpu-offloading-num-layers",
            "needs --recompute-granularity full (it offloads the inputs that full "
            f"recomputation keeps; got {mem.recompute_granularity or 'no recomputation'})")
    require(n <= fewest_stage_layers, "--cpu-offloading-num-layers",
            f"{n} is more than the {fewest_stage_layers} layers of a pipeline stage (it "
            "counts layers per stage)")


def check_head_groups(dims: ParallelDims, m: ModelConfig, groups: int) -> None:
    """Each rank attends over hq/(tp*sp) query heads and max(hkv/tp, sp)/sp kv heads (GQA
    under Ulysses repeats kv heads up to sp); a group takes an equal share of the query
    heads and of the kv heads they read, so no group straddles a kv head."""
    if groups == 1:
        return
    q_heads = m.num_attention_heads // (dims.tp * dims.sp)
    kv_heads = max(m.num_kv_heads // dims.tp, dims.sp) // dims.sp
    if q_heads % groups:
        raise ConfigError("--attention-head-groups", f"{groups} must divide the {q_heads} "
                          "query heads each rank attends over (heads / tp / sp)")
    if kv_heads % groups and groups % kv_heads:
        raise ConfigError("--attention-head-groups", f"{groups} and the {kv_heads} kv heads "
                          "each rank attends over must divide one another")
