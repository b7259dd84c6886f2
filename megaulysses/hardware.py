"""The GPUs the planner knows: peak, memory and link bandwidths, one row each.

Peaks are NVIDIA's dense bf16 tensor-core figures (SXM parts). Bandwidths are what a
collective achieves per GPU ("bus bandwidth" as nccl-tests reports it), not the link's
marketing figure: NVLink 3 (A100) is 300 GB/s a direction and reaches ~230; NVLink 4
(H100/H200) is 450 and reaches ~370; between nodes one InfiniBand NIC per GPU, HDR
200 Gb/s (25 GB/s, ~23 reached) on A100 nodes, NDR 400 Gb/s (50 GB/s, ~46) on H100/H200
nodes. Memory is what `torch.cuda.get_device_properties().total_memory` reports.

`efficiency` is the fraction of the peak that the model's kernels reach on hardware FLOPs
(matmuls and flash attention, recomputation included). It is an assumption until a
device check calibrates it (tools/plan.py --calibration device_check.json): 0.6 on A100
(large bf16 GEMMs reach 70-80% of 312, FlashAttention-2 50-70%; Megatron-LM's published
GPT runs reach ~52% of peak end to end, communication and bubble included), 0.5 on
H100/H200 (GEMMs 65-75% of 989, FlashAttention-2 35-50% without Hopper-specific kernels).

`host_gbps`: what a GPU's copies to and from pinned host memory reach, each way: PCIe
Gen4 x16 (A100 nodes) ~25 GB/s, Gen5 (H100/H200) ~50. `host_adam_gparams`: how fast
--optimizer-cpu-offload's host AdamW steps, 1e9 parameters per second per GPU (torch's
fused CPU AdamW on ~12 cores of a 96-core, 8-GPU node): a guess until measured.
`host_memory_gib`: a GPU's share of its node's host memory, which offloaded activations
and optimizer states must fit in (less `HOST_RESERVE`): DGX/HGX A100-80GB, H100 and H200
nodes and the clouds' 8-GPU instances have ~2 TB, DGX A100-40GB 1 TB. A job on fewer GPUs
than a node has the node to itself (`host_share_gib`: its ranks share the whole node's, as
an exclusive allocation gives them); a one-GPU machine is a node of one GPU
(`gpus_per_node` 1), and a shared node is told by overriding `host_memory_gib`.

`ring_kernel_speed`: under ring attention (cp > 1) a ring step under the plain causal
mask runs the fused kernel (model/attention/fused.py), any other mask our torch block
kernel (model/attention/block.py), 1.7x slower than torch's SDPA on CPU
(docs/attention_grid.md). On a GPU it is unmeasured: 0.5 is a guess, to be replaced by a
measurement.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class GPU:
    name: str
    peak_tflops: float  # dense bf16, TFLOP/s
    memory_gib: float  # total device memory, GiB
    hbm_gbps: float  # memory bandwidth, GB/s (the optimizer step is bound by it)
    nvlink_gbps: float  # collective bandwidth inside a node, GB/s per GPU
    ib_gbps: float  # collective bandwidth between nodes, GB/s per GPU
    gpus_per_node: int = 8
    efficiency: float = 0.6  # fraction of peak reached on hardware FLOPs
    ring_kernel_speed: float = 0.5  # the ring's attention kernel's speed over flash's
    host_gbps: float = 25.0  # host link, GB/s per GPU each way (PCIe Gen4 x16 reaches ~25)
    host_adam_gparams: float = 1.0  # host AdamW (fused, on the GPU's share of the CPU
    # cores), 1e9 parameters/s: an assumption until measured
    host_memory_gib: float = 232.8  # the GPU's share of its node's host memory (2 TB / 8)


GPUS = {g.name: g for g in (
    GPU("A100-40GB", 312.0, 40.0, 1555.0, 230.0, 23.0, efficiency=0.6, host_memory_gib=116.4),
    GPU("A100-80GB", 312.0, 80.0, 2039.0, 230.0, 23.0, efficiency=0.6),
    GPU("H100", 989.0, 79.6, 3350.0, 370.0, 46.0, efficiency=0.5, host_gbps=50.0),
    GPU("H200", 989.0, 140.4, 4800.0, 370.0, 46.0, efficiency=0.5, host_gbps=50.0),
)}

RESERVE_GIB = 4.0  # default: what the plan's tensors cannot use (CUDA context, NCCL buffers,
# cuBLAS workspace, the caching allocator's fragmentation)
HOST_RESERVE = 0.15  # of the host memory: the OS, the data loader, the framework, the page cache
OVERRIDABLE = tuple(f.name for f in dataclasses.fields(GPU) if f.name != "name")


def host_share_gib(gpu: GPU, world: int) -> float:
    """Host memory a rank has: its node's shared by the job's ranks on that node."""
    return gpu.host_memory_gib * gpu.gpus_per_node / min(world, gpu.gpus_per_node)


class UnknownGPU(ValueError):
    pass


def gpu_spec(name: str, **overrides: Optional[float]) -> GPU:
    """The table's row for `name` (case-insensitive), with any field replaced (None: keep)."""
    by_lower = {k.lower(): g for k, g in GPUS.items()}
    if name.lower() not in by_lower:
        raise UnknownGPU(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")
    # Any: the fields are floats and one int (gpus_per_node, an int flag); checked below
    changes: dict[str, Any] = {k: v for k, v in overrides.items() if v is not None}
    bad = [k for k in changes if k not in OVERRIDABLE]
    if bad:
        raise ValueError(f"not a GPU field: {', '.join(bad)}")
    for k, v in changes.items():
        fraction = k in ("efficiency", "ring_kernel_speed")
        if v <= 0 or (fraction and v > 1):
            raise ValueError(f"{k} must be > 0{' and <= 1' if fraction else ''}, got {v}")
    return dataclasses.replace(by_lower[name.lower()], **changes)
