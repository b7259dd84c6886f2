"""--deterministic: the same seed and grid train to bit-identical losses on CUDA too.

CPU training needs nothing: its kernels and gloo's reductions run in a fixed order for a
fixed grid, seed and thread count (tests/training/test_determinism.py). On CUDA some
kernels sum in an order that can change from run to run (atomic adds, cuBLAS without a
fixed workspace, NVLS reductions in the switch); this switches them to deterministic ones.
docs/determinism.md says what each setting costs.

`configure` must run before the first CUDA op and before the process group is made: cuBLAS
and NCCL read their environment variables once, when they start.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)

# cuBLAS is bit-reproducible only with a fixed workspace configuration (NVIDIA's "results
# reproducibility"); without one torch's deterministic mode raises at the first matmul.
# :4096:8 is 8 buffers of 4 MiB, 32 MiB per stream; :16:8 (128 KiB) saves the memory and
# may be slower.
CUBLAS_WORKSPACE = ":4096:8"
# NVLS (NVLink SHARP, NVSwitch systems such as H100/H200 HGX) reduces inside the switch in
# an order that differs from call to call; ring and tree reduce in an order fixed by the
# topology. torch's NCCL process group does the same in deterministic mode (where NCCL_ALGO
# is unset); setting it here does not depend on that.
NCCL_ALGO = "^NVLS"


def configure(enabled: bool, device: torch.device) -> str:
    """Switch on what deterministic training needs (when `enabled`); returns the line for
    the start-up log. Disabled, it changes nothing."""
    if not enabled:
        if device.type == "cpu":
            return "deterministic: off (CPU training is deterministic anyway for a fixed " \
                   "grid and seed)"
        return "deterministic: off (CUDA results may differ in their last bits from run " \
               "to run; --deterministic makes them bit-identical)"
    # Ops with a deterministic kernel take it (index_add_, scatter_add_, SDPA's flash and
    # memory-efficient backward; flash-attn's where model/attention/ asks torch); ops without
    # one raise instead of drifting silently. torch.compile (flex attention) stops
    # autotuning.
    torch.use_deterministic_algorithms(True, warn_only=False)
    if device.type != "cuda":
        return "deterministic: torch deterministic algorithms (CPU training is " \
               "deterministic anyway: this adds torch's checks only)"
    torch.backends.cudnn.deterministic = True  # cuDNN: deterministic algorithms only
    torch.backends.cudnn.benchmark = False  # benchmarking may pick another one each run
    parts = ["torch deterministic algorithms (ops without one raise)",
             f"cuBLAS workspace {_set_env('CUBLAS_WORKSPACE_CONFIG', CUBLAS_WORKSPACE)}",
             "cuDNN deterministic, no benchmarking",
             f"NCCL_ALGO {_set_env('NCCL_ALGO', NCCL_ALGO)}"]
    if torch.cuda.is_initialized() or (torch.distributed.is_available()
                                       and torch.distributed.is_initialized()):
        log.warning("--deterministic was configured after CUDA or the process group had "
                    "started: cuBLAS and NCCL may have read their settings already")
    return "deterministic: " + ", ".join(parts)


def _set_env(name: str, value: str) -> str:
    """`value`, unless the environment sets its own (a person's choice wins)."""
    if name in os.environ:
        return f"{os.environ[name]} (from the environment)"
    os.environ[name] = value
    return value
