"""The TF32 policy (training/precision.py): on CUDA fp32 matmuls run in TF32 unless
NVIDIA_TF32_OVERRIDE=0, and MFU's peak follows what runs. The torch flags are set on a
CPU build too, so the policy's effect is checked here."""

import pytest
import torch

from megaulysses.training.metrics import peak_tflops
from megaulysses.training.precision import configure_tf32, tf32_active

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.fixture(autouse=True)
def torch_tf32_flags(monkeypatch):
    """Each test starts from torch's defaults and leaves them so (legacy API both ways:
    it keeps the newer fp32_precision settings in step)."""
    for var in ("NVIDIA_TF32_OVERRIDE", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"):
        monkeypatch.delenv(var, raising=False)
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_cuda_turns_tf32_on_and_says_so():
    line = configure_tf32(CUDA)
    assert line.startswith("TF32: on for fp32 matmuls and cuDNN")
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"  # the newer API agrees
    assert tf32_active()


def test_nvidia_override_keeps_ieee_fp32(monkeypatch):
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    line = configure_tf32(CUDA)
    assert line.startswith("TF32: off (NVIDIA_TF32_OVERRIDE=0)")
    assert not torch.backends.cuda.matmul.allow_tf32 and not tf32_active()


def test_cpu_changes_nothing():
    assert configure_tf32(CPU).startswith("TF32: n/a")
    assert not torch.backends.cuda.matmul.allow_tf32 and not tf32_active()


def test_torch_default_is_ieee_and_ngc_override_is_tf32(monkeypatch):
    assert not tf32_active()
    monkeypatch.setenv("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "1")
    assert tf32_active()


def test_mfu_peak_follows_the_policy(monkeypatch):
    """fp32 on an A100: the TF32 peak once configured, the fp32 one under the veto."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert peak_tflops(CUDA, torch.float32, None) == 19.5  # torch's default: IEEE
    configure_tf32(CUDA)
    assert peak_tflops(CUDA, torch.float32, None) == 156.0
    assert peak_tflops(CUDA, torch.bfloat16, None) == 312.0
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    assert peak_tflops(CUDA, torch.float32, None) == 19.5
