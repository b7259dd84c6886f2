"""The prepared GPU check (benchmarks/device_check.sh, .py; issue 14, item 3).

`cuda`-marked tests are part (a) of the check (`pytest -m cuda`): the attention kernels on
a CUDA device against the math reference, forward and backward. They skip without CUDA.
The others are CPU smoke tests of the check itself: the shell script on a machine without
CUDA (everything skipped, exit 0, the report written), `--help`, and `--cpu-smoke`
(parts (b)-(d) tiny on the CPU, so their code runs here).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from megaulysses.model.attention import AttentionMask, math_attention

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "benchmarks", "device_check.py")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

# -- part (a): kernels on CUDA against the math reference ------------------------------------

MASKS = {  # name -> (b, s) -> mask
    "causal": lambda b, s: AttentionMask(),
    "window": lambda b, s: AttentionMask(window=s // 3),
    "documents": lambda b, s: AttentionMask(documents=torch.tensor(
        [[0] * (s // 4) + [1] * (s // 2) + [2] * (s - s // 4 - s // 2),
         [0] * (s - 17) + [1] * 17][:b], device="cuda")),
}


def _qkv(dtype, b=2, s=256, hq=4, hkv=2, d=64):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, s, hq, d, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(b, s, hkv, d, device="cuda", dtype=dtype, generator=g)
            for _ in range(2))
    return [t.requires_grad_() for t in (q, k, v)]


def _against_math(core, mask, dtype, atol, rtol):
    """core's output and q/k/v gradients against math_attention's, same inputs."""
    q, k, v = _qkv(dtype)
    b, s = q.shape[:2]
    m = mask(b, s)
    dout = torch.randn_like(q)
    got = core(q, k, v, m)
    got_grads = torch.autograd.grad(got, (q, k, v), dout)
    want = math_attention(q, k, v, 0.0, m)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    for name, g, w in zip("qkv", got_grads, want_grads):
        torch.testing.assert_close(g, w, atol=atol, rtol=rtol, msg=lambda e: f"d{name}: {e}")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("mask", list(MASKS))
def test_block_kernel_matches_math_on_cuda_fp32(mask):
    from megaulysses.model.block_attention import masked_block_attention
    # fp32 matmuls everywhere (no TF32): the two differ only by summation order
    _against_math(masked_block_attention, MASKS[mask], torch.float32, atol=1e-4, rtol=1e-4)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("mask", list(MASKS))
def test_flex_attention_forward_backward_matches_math_on_cuda(mask):
    pytest.importorskip("triton", reason="flex_attention on CUDA compiles with triton")
    from megaulysses.model.attention import flex_attention
    # flex's triton kernels may use TF32 for fp32 dots (10-bit mantissa): ~1e-3 relative
    _against_math(lambda q, k, v, m: flex_attention(q, k, v, 0.0, m), MASKS[mask],
                  torch.float32, atol=1e-2, rtol=1e-2)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("mask", list(MASKS))
def test_flash_backend_matches_math_on_cuda_bf16(mask):
    from megaulysses.model.attention import flash_attention, flash_available
    if not flash_available(torch.device("cuda")):
        pytest.skip("flash_attn is not installed")
    # bf16 inputs; math computes in fp32 from the same bf16 values
    _against_math(lambda q, k, v, m: flash_attention(q, k, v, 0.0, m), MASKS[mask],
                  torch.bfloat16, atol=2e-2, rtol=2e-2)


# -- the check itself, on this machine -------------------------------------------------------

def _run(cmd, timeout=120, env=None):
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env=env)


def test_help():
    r = _run([sys.executable, SCRIPT, "--help"])
    assert r.returncode == 0, r.stderr
    assert "--cpu-smoke" in r.stdout and "throughput" in r.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_shell_script_without_cuda_skips_and_exits_0(tmp_path):
    out = tmp_path / "dc"
    r = _run(["bash", os.path.join(REPO, "benchmarks", "device_check.sh"), str(out)],
             timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no CUDA device: parts (a)-(d) skipped" in r.stdout
    result = json.loads((out / "device_check.json").read_text())
    parts = result["parts"]
    assert result["ok"]
    assert parts["pytest"]["status"] == "ok" and "skipped" in parts["pytest"]["summary"]
    assert "passed" not in parts["pytest"]["summary"]  # every cuda test skipped here
    for name in ("parity", "throughput", "hf"):
        assert parts[name]["status"] == "skipped"
    md = (out / "device_check.md").read_text()
    assert "| (c) throughput | skipped |" in md


def test_cpu_smoke_runs_parts_b_to_d(tmp_path):
    out = tmp_path / "smoke"
    r = _run([sys.executable, SCRIPT, "--cpu-smoke", "--out", str(out)], timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    parts = json.loads((out / "device_check.json").read_text())["parts"]
    b, c, d = parts["parity"], parts["throughput"], parts["hf"]
    assert b["status"] == "ok" and b["loss_rel_diff"] <= b["loss_rtol"]
    assert b["grad_norm_rel_diff"] <= b["grad_norm_rtol"]
    assert c["status"] == "ok" and c["tokens_per_s"] > 0 and 0 < c["mfu"]
    assert c["plan_peak_gib"] > 0 and c["params"] == d["params"]  # the same shape
    if d["status"] != "skipped":  # transformers installed
        assert d["status"] == "ok" and d["ratio_ours_over_hf"] > 0
    assert "(b) parity | ok" in (out / "device_check.md").read_text()
