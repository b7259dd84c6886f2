"""The rules of the activation-memory flags that full recomputation or the grid decide:
--cpu-offloading-num-layers (needs full recomputation: it moves what that keeps),
--attention-head-groups (the heads a rank attends over must split into those groups) and
--ds-sequence-parallel-fpdt (chunked Ulysses attention, at sp = 1 too: parallel/fpdt.py's
limits)."""

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


def fpdt_chunks(m: ModelConfig, mem: MemoryConfig) -> int:
    """Chunks of the sequence under --ds-sequence-parallel-fpdt (0: off)."""
    if not mem.ds_sequence_parallel_fpdt:
        return 0
    return m.seq_length // min(mem.ds_sequence_parallel_fpdt_chunk_size, m.seq_length)


def check_fpdt(dims: ParallelDims, m: ModelConfig, mem: MemoryConfig) -> None:
    flag = "--ds-sequence-parallel-fpdt"
    if not mem.ds_sequence_parallel_fpdt:
        require(not mem.ds_sequence_parallel_fpdt_offloading,
                "--ds-sequence-parallel-fpdt-offloading", f"needs {flag}")
        require(mem.ds_sequence_parallel_fpdt_chunk_size == 65536,
                "--ds-sequence-parallel-fpdt-chunk-size", f"needs {flag}")
        return
    # sp = 1 too: one rank's attention in sequence chunks, no exchange (parallel/fpdt.py)
    require(dims.cp == 1, flag, "runs without ring attention (--context-parallel-size 1)")
    require(mem.attention_head_groups == 1, flag, "and --attention-head-groups are two "
            "ways of cutting attention: use one")
    chunk = min(mem.ds_sequence_parallel_fpdt_chunk_size, m.seq_length)
    name = "--ds-sequence-parallel-fpdt-chunk-size"
    if dims.sp == 1:
        require(m.seq_length % chunk == 0, name,
                f"{chunk} must divide --seq-length {m.seq_length}")
        return
    require(m.seq_length % chunk == 0 and chunk % dims.sp == 0, name,
            f"{chunk} must divide --seq-length {m.seq_length} and be divisible by "
            f"--ds-sequence-parallel-size {dims.sp}")


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
