"""TF32: how fp32 matmuls run on CUDA, and the peak MFU divides by to match.

Policy: on CUDA, fp32 matmuls (cuBLAS) and convolutions (cuDNN) run on TF32 tensor cores
(fp32 range, 10-bit mantissa, ~7x the IEEE fp32 rate on A100/H100), and MFU divides by
the TF32 peak. This is what Megatron-LM trains with in practice: it has no flag of its
own, and NVIDIA's PyTorch containers set TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1, which turns
TF32 on for cuBLAS whatever torch's default (off for matmuls since torch 1.12).

16-bit training is unaffected (its matmuls run in bf16/fp16; this model has no fp32
matmul then). --deterministic keeps TF32: its kernels are as reproducible as IEEE fp32's
(the same kernels, summing in the same order), only less precise.

Off switch, no flag of ours: NVIDIA_TF32_OVERRIDE=0 in the environment (NVIDIA's own
variable, which cuBLAS and cuDNN obey whatever torch asks): fp32 matmuls stay IEEE and MFU
divides by the plain fp32 peak.
"""

from __future__ import annotations

import os

import torch


def configure_tf32(device: torch.device) -> str:
    """Apply the policy for `device`; returns the line for the start-up log."""
    if device.type != "cuda":
        return "TF32: n/a (CPU: fp32 matmuls are IEEE fp32)"
    if _tf32_vetoed():
        return ("TF32: off (NVIDIA_TF32_OVERRIDE=0): fp32 matmuls are IEEE fp32; MFU uses "
                "the fp32 peak")
    # The legacy flags, on purpose: setting them sets torch's newer fp32_precision
    # settings too, so code that reads either sees the same state (mixing raises).
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return ("TF32: on for fp32 matmuls and cuDNN (NVIDIA_TF32_OVERRIDE=0 turns it off); "
            "MFU of fp32 runs uses the TF32 peak")


def tf32_active() -> bool:
    """Whether fp32 matmuls on CUDA run in TF32 now (torch's setting, NGC's override
    and NVIDIA's veto)."""
    if _tf32_vetoed():
        return False
    if os.environ.get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE") == "1":
        return True
    return _matmul_precision() == "tf32"


def _tf32_vetoed() -> bool:
    return os.environ.get("NVIDIA_TF32_OVERRIDE") == "0"


def _matmul_precision() -> str:
    """"tf32" or "ieee" ("none": torch's default, IEEE), read through the newer API:
    it never raises, whichever API set it."""
    precision = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    if precision is None:  # a torch without it
        return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    return precision
