"""The grid on the devices: build_mesh(dims) -> one DeviceMesh per mesh dim, passed
explicitly; joining and leaving the job's process groups. The grid's sizes and the mesh dim
names are config/grid.py's (no torch there), re-exported here for the parallel transforms.
"""

from __future__ import annotations

import gc
import logging
import weakref
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from megaulysses.config.grid import (CP, DP, DP_SP, MESH_DIMS, PP, SP, TP,  # noqa: F401
                                     ParallelDims)

log = logging.getLogger(__name__)

# The meshes build_mesh made, weakly: leave_distributed empties their registries of process
# groups (the groups themselves are torch's to destroy).
_MESHES: "weakref.WeakSet[DeviceMesh]" = weakref.WeakSet()


def build_mesh(dims: ParallelDims, device_type: str,
               timeout: Optional[timedelta] = None) -> dict[str, DeviceMesh]:
    """{"world": the 5-D mesh, PP/DP/CP/SP/TP: its 1-D slices, DP_SP: dp x cp x sp
    flattened}. `timeout`: of every group's collectives (the mesh's own groups do not
    inherit init_process_group's timeout: without it a hung peer blocks for 30 min;
    set on the groups the mesh made, not by making others: DTensor's caches compare
    meshes by their ranks and would go on using the first mesh's groups)."""
    mesh = init_device_mesh(device_type, (dims.pp, dims.dp, dims.cp, dims.sp, dims.tp),
                            mesh_dim_names=MESH_DIMS)
    meshes = {name: mesh[name] for name in MESH_DIMS}
    meshes[DP_SP] = mesh[DP, CP, SP]._flatten(DP_SP)  # kept: slicing it is deprecated
    if timeout is not None and dist.get_backend() in ("gloo", "nccl"):  # not a fake one
        for one in meshes.values():
            one.get_group().set_timeout(timeout)
    meshes["world"] = mesh
    _MESHES.update(meshes.values())
    return meshes


def init_distributed(device: torch.device, timeout: timedelta = timedelta(minutes=10),
                     alone: bool = False) -> tuple[int, int]:
    """Join the job torchrun (or SLURM via torchrun) started; (rank, world). No-op alone,
    unless `alone` (--zero-param-offload: FSDP2 needs a process group even on one rank):
    then a world-1 group over an in-process store. A collective that waits longer than
    `timeout` raises (a rank died or hangs)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    import os
    single = "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) == 1
    if single and not alone:
        return 0, 1
    backend = "nccl" if device.type == "cuda" else "gloo"
    # one rank: no rendezvous (torchrun's MASTER_ADDR may be absent); a store in memory
    bound: dict = {"store": dist.HashStore(), "rank": 0, "world_size": 1} if single else {}
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
