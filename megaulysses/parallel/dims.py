"""The grid: ParallelDims(dp, tp, pp, sp, cp) -> one DeviceMesh, passed explicitly.

Mesh dims are ("pp", "dp", "cp", "sp", "tp"), tp fastest-varying: consecutive ranks share a
tp group, then an sp (Ulysses) group, so both stay inside a node where the bandwidth is;
the ring of cp (context-parallel) ranks, whose traffic is point-to-point and overlaps
compute, spans further. The sequence degree is sp * cp. The flattened "dp_sp" dim
(dp x cp x sp) is the group over which the loss, gradients and ZeRO are reduced:
sequence-parallel ranks hold the same parameters and see different tokens, exactly like
data-parallel ranks.
"""

from __future__ import annotations

import gc
import logging
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from megaulysses.config import Config, ConfigError, ModelConfig

# The mesh dimension names: every group is named by one of these, and only here are they
# spelled out.
PP, DP, CP, SP, TP = "pp", "dp", "cp", "sp", "tp"
DP_SP = "dp_sp"  # dp x cp x sp flattened: the ranks that see different tokens of one model
MESH_DIMS = (PP, DP, CP, SP, TP)  # slowest- to fastest-varying

log = logging.getLogger(__name__)

# The meshes build_mesh made, weakly: leave_distributed empties their registries of process
# groups (the groups themselves are torch's to destroy).
_MESHES: "weakref.WeakSet[DeviceMesh]" = weakref.WeakSet()


@dataclass(frozen=True)
class ParallelDims:
    dp: int
    tp: int
    pp: int
    sp: int
    cp: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.sp * self.cp

    @property
    def seq_degree(self) -> int:
        """Ranks one sample's sequence is split over: Ulysses x ring."""
        return self.sp * self.cp

    @classmethod
    def from_world(cls, world: int, tp: int = 1, pp: int = 1, sp: int = 1,
                   cp: int = 1) -> "ParallelDims":
        """dp is derived: world / (tp * pp * sp * cp), as in Megatron."""
        model_parallel = tp * pp * sp * cp
        if world % model_parallel:
            sizes = {"--tensor-model-parallel-size": tp, "--pipeline-model-parallel-size": pp,
                     "--ds-sequence-parallel-size": sp, "--context-parallel-size": cp}
            flag = "/".join(f for f, n in sizes.items() if n > 1)  # the ones that were set
            raise ConfigError(flag, f"the product tp*pp*sp*cp = {tp}*{pp}*{sp}*{cp} = "
                              f"{model_parallel} must divide the world size {world}")
        return cls(dp=world // model_parallel, tp=tp, pp=pp, sp=sp, cp=cp)

    @classmethod
    def from_config(cls, cfg: Config, world: int) -> "ParallelDims":
        par = cfg.parallel
        return cls.from_world(world, tp=par.tensor_model_parallel_size,
                              pp=par.pipeline_model_parallel_size,
                              sp=par.ds_sequence_parallel_size, cp=par.context_parallel_size)

    def validate_config(self, cfg: Config):
        """`validate` with the run's flags (the vocabulary size must be known by now)."""
        par, t = cfg.parallel, cfg.train
        if t.global_batch_size is None:  # one micro-batch per dp rank (Megatron-LM), and
            # pp of them under a pipeline: every stage then has one in flight
            t.global_batch_size = t.micro_batch_size * self.dp * self.pp
        self.validate(cfg.model, t.global_batch_size, t.micro_batch_size,
                      par.sequence_parallel and self.tp > 1, par.pipeline_schedule,
                      cfg.memory.tiled_mlp_chunks)
        self._validate_ring(cfg.model)

    def validate(self, m: ModelConfig, global_batch_size: int, micro_batch_size: int,
                 sequence_parallel: bool = False, pipeline_schedule: str = "1f1b",
                 tiled_mlp_chunks: int = 1):
        """Rules that depend on the grid and the model together (one message each)."""
        sp_flag, tp_flag = "--ds-sequence-parallel-size", "--tensor-model-parallel-size"
        for size, flag in ((m.ffn_size, "--ffn-hidden-size"),
                           (m.padded_vocab_size, "--make-vocab-size-divisible-by")):
            if size % self.tp:
                raise ConfigError(flag, f"{flag[2:].replace('-', ' ')} result {size} must be "
                                  f"divisible by {tp_flag} {self.tp}")
        if sequence_parallel and m.seq_length % (self.tp * self.seq_degree):
            raise ConfigError("--sequence-parallel", f"--seq-length {m.seq_length} must be "
                              f"divisible by tp*sp*cp = {self.tp * self.seq_degree}")
        if m.num_attention_heads % (self.tp * self.sp):
            raise ConfigError(sp_flag if self.sp > 1 else tp_flag,
                              f"--num-attention-heads {m.num_attention_heads} must be "
                              f"divisible by tp*sp = {self.tp}*{self.sp}")
        kv_per_tp = m.num_kv_heads // self.tp if m.num_kv_heads % self.tp == 0 else None
        if kv_per_tp is None:
            raise ConfigError("--num-query-groups", f"{m.num_kv_heads} kv heads must be "
                              f"divisible by --tensor-model-parallel-size {self.tp}")
        if kv_per_tp % self.sp and self.sp % kv_per_tp:
            raise ConfigError(sp_flag, f"kv heads per tensor rank ({kv_per_tp}) and sp = "
                              f"{self.sp} must divide one another (GQA under Ulysses)")
        if m.seq_length % self.sp:
            raise ConfigError(sp_flag, f"--seq-length {m.seq_length} must be divisible by "
                              f"sp = {self.sp}")
        if self.cp > 1 and m.seq_length % (2 * self.cp * self.sp):
            raise ConfigError("--context-parallel-size", f"--seq-length {m.seq_length} must "
                              f"be divisible by 2*cp*sp = 2*{self.cp}*{self.sp} (each rank "
                              "holds two zigzag chunks)")
        local = m.seq_length // self.seq_degree // (self.tp if sequence_parallel else 1)
        if tiled_mlp_chunks > local or local % tiled_mlp_chunks:
            raise ConfigError("--tiled-mlp-chunks", f"{tiled_mlp_chunks} must divide the "
                              f"local sequence of {local} tokens (--seq-length / sp / cp"
                              f"{' / tp under --sequence-parallel' if sequence_parallel else ''})")
        if global_batch_size % (micro_batch_size * self.dp):
            raise ConfigError("--global-batch-size", f"{global_batch_size} must be divisible "
                              f"by --micro-batch-size * dp = {micro_batch_size}*{self.dp}")
        if self.pp > 1:
            self._validate_micro_batches(global_batch_size // (micro_batch_size * self.dp),
                                         pipeline_schedule)

    def _validate_ring(self, m: ModelConfig):
        """What ring attention (cp > 1) needs of the mask and the model."""
        if self.cp == 1:
            return
        chunk = m.seq_length // (2 * self.cp)  # one zigzag chunk: a ring step's block rows
        if m.attention_sparsity != "dense" and chunk % m.sparse_block_size:
            raise ConfigError("--sparse-block-size", f"{m.sparse_block_size} must divide the "
                              f"sequence chunk of each ring step, --seq-length / (2*cp) = "
                              f"{chunk}")
        if m.attention_dropout:
            raise ConfigError("--attention-dropout", "ring attention "
                              "(--context-parallel-size > 1) has no attention dropout")

    def _validate_micro_batches(self, n: int, schedule: str):
        """Micro-batches per step = global batch / (micro batch * dp), per schedule."""
        why = f"gives {n} micro-batches per pipeline (--global-batch-size / " \
              f"(--micro-batch-size * dp))"
        if schedule == "1f1b" and n < self.pp:
            raise ConfigError("--global-batch-size", f"{why}; 1f1b needs at least pp = "
                              f"{self.pp}")
        if schedule in ("interleaved-1f1b", "zero-bubble") and n % self.pp:
            raise ConfigError("--global-batch-size", f"{why}; {schedule} needs a multiple "
                              f"of pp = {self.pp}")

    def build_mesh(self, device_type: str,
                   timeout: Optional[timedelta] = None) -> dict[str, DeviceMesh]:
        """{"world": the 5-D mesh, PP/DP/CP/SP/TP: its 1-D slices, DP_SP: dp x cp x sp
        flattened}. `timeout`: of every group's collectives (the mesh's own groups do not
        inherit init_process_group's timeout: without it a hung peer blocks for 30 min;
        set on the groups the mesh made, not by making others: DTensor's caches compare
        meshes by their ranks and would go on using the first mesh's groups)."""
        mesh = init_device_mesh(device_type, (self.pp, self.dp, self.cp, self.sp, self.tp),
                                mesh_dim_names=MESH_DIMS)
        meshes = {name: mesh[name] for name in MESH_DIMS}
        meshes[DP_SP] = mesh[DP, CP, SP]._flatten(DP_SP)  # kept: slicing it is deprecated
        if timeout is not None and dist.get_backend() in ("gloo", "nccl"):  # not a fake one
            for one in meshes.values():
                one.get_group().set_timeout(timeout)
        meshes["world"] = mesh
        _MESHES.update(meshes.values())
        return meshes


def init_distributed(device: torch.device,
                     timeout: timedelta = timedelta(minutes=10)) -> tuple[int, int]:
    """Join the job torchrun (or SLURM via torchrun) started; (rank, world). No-op alone.
    A collective that waits longer than `timeout` raises (a rank died or hangs)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    import os
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) == 1:
        return 0, 1
    backend = "nccl" if device.type == "cuda" else "gloo"
    bound = {}
    if device.type == "cuda":
        local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(local)
        # NCCL bound to this GPU: its communicator starts now (not at the first
        # collective), and the mesh's subgroups split from it instead of starting anew.
        bound["device_id"] = local
    dist.init_process_group(backend, timeout=timeout, **bound)
    return dist.get_rank(), dist.get_world_size()


def leave_distributed() -> None:
    """Destroy every process group of the job now (the default one, the mesh's, any other):
    each gloo group's worker threads are joined here, while the interpreter is whole, so
    none is left running when it shuts down. No-op alone. Call it once nothing holds the
    model any more (FSDP's states hold their groups).

    `dist.destroy_process_group()` alone drops only torch's own references. The
    DeviceMesh keeps its groups in a registry (the default group too, where a mesh dim
    spans every rank), and DTensor's caches keep the mesh, so the groups would die in the
    interpreter's last garbage collection instead. A gloo worker thread that has finished
    a collective lets go of it afterwards; when it drops the last reference to a tensor
    whose Python object the caller has dropped already, it takes the GIL, and if the
    interpreter is finalizing by then the thread is made to exit inside a noexcept
    destructor: std::terminate ("terminate called without an active exception"), SIGABRT,
    after a run that finished (more often on a loaded machine, where that thread waits
    longer for a core). Destroyed here, the group's destructor waits for that thread
    (with the GIL released) before the interpreter finalizes."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    world = getattr(dist.distributed_c10d, "_world", None)
    groups = [weakref.ref(g) for g in getattr(world, "pg_map", {})]
    for mesh in list(_MESHES):
        registry = getattr(mesh, "_pg_registry", None)
        if registry is not None:
            registry.clear()
    _MESHES.clear()
    gc.collect()  # the model's and FSDP's reference cycles hold groups too
    dist.destroy_process_group()  # the last references: each group is destroyed here
    alive = sum(g() is not None for g in groups)
    if alive:
        log.warning("%d process group(s) still referenced after leaving: their threads "
                    "outlive the run and may abort the exit", alive)
