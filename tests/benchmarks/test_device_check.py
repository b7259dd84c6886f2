"""The prepared GPU check (benchmarks/device_check.sh, .py; issues 14 and 22).

`cuda`-marked tests are part (a) of the check (`pytest -m cuda`): the attention kernels on
a CUDA device against the math reference, forward and backward. They skip without CUDA.
The others are CPU tests of the check itself: the shell script on a machine without CUDA
(everything skipped, exit 0, the report written); its refusals (nvidia-smi lists a GPU
torch cannot see: exit 3; a needed package missing: exit 2); python3 where there is no
python; its time budget; its kernel snippets (part (e)) parse, the ring one runs on the
CPU; `--help`, and `--cpu-smoke` (parts (b)-(d) and (f) tiny on the CPU, (f) eagerly, so
their code runs here); the report of a finished GPU run of (f) (its JSON as written there).
"""

import ast
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from megaulysses.model.attention import AttentionMask, math_attention

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "benchmarks", "device_check.py")
SHELL = os.path.join(REPO, "benchmarks", "device_check.sh")
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
    for name, g, w in zip("qkv", got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, atol=atol, rtol=rtol,
                                   msg=lambda e, name=name: f"d{name}: {e}")


@pytest.fixture
def ieee_fp32():
    """fp32 matmuls in IEEE fp32 (no TF32), whatever an earlier test in this process set."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("mask", list(MASKS))
def test_block_kernel_matches_math_on_cuda_fp32(mask, ieee_fp32):
    from megaulysses.model.attention import masked_block_attention
    # fp32 matmuls everywhere (no TF32): the two differ only by summation order
    _against_math(masked_block_attention, MASKS[mask], torch.float32, atol=1e-4, rtol=1e-4)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_gqa_runs_without_the_math_kernel_on_cuda(dtype, ieee_fp32):
    """GQA through SDPA with its math kernel (s x s scores) forbidden: fp32 takes the
    memory-efficient kernel on repeated k/v, bf16 the flash kernel's own GQA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from megaulysses.model.attention import sdpa_attention
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        _against_math(lambda q, k, v, m: sdpa_attention(q, k, v, 0.0, m), MASKS["causal"],
                      dtype, atol=tol, rtol=tol)


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
    assert "no CUDA device: parts (b)-(f) skipped" in r.stdout
    assert "needs: torch, pytest, numpy: found" in r.stdout
    assert "optional: flash_attn: " in r.stdout  # found or not, it is reported
    tsv = (out / "parts.tsv").read_text()
    for name in ("kernel_ring", "kernel_flex", "kernel_flash"):
        assert f"{name}\tskipped\t" in tsv
    result = json.loads((out / "device_check.json").read_text())
    parts = result["parts"]
    assert result["ok"]
    assert parts["pytest"]["status"] == "ok" and "skipped" in parts["pytest"]["summary"]
    assert "passed" not in parts["pytest"]["summary"]  # every cuda test skipped here
    for name in ("parity", "throughput", "hf", "8b"):
        assert parts[name]["status"] == "skipped"
    md = (out / "device_check.md").read_text()
    assert "| (c) throughput | skipped |" in md and "| (f) 8b | skipped |" in md


def test_cpu_smoke_runs_parts_b_to_d_and_f(tmp_path):
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
    f = parts["8b"]  # the 8B part's code path, eagerly: 2 of the tiny shape's 4 layers
    assert f["status"] == "ok" and f["layers"] == 2 and f["layers_of"] == 4
    eager = [r for r in f["runs"] if not r["compiled"]]
    assert [r["seq"] for r in eager] == [64, 128]
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 and r["mfu"] > 0 for r in eager)
    assert all(r["status"] == "skipped" for r in f["runs"] if r["compiled"])
    assert f["kernels_line"].startswith("kernels (cpu):")
    md = (out / "device_check.md").read_text()
    assert "(b) parity | ok" in md and "| (f) 8b | ok |" in md
    assert "| torchtitan, FSDP 8, local batch 2, selective op AC, bf16 | 8192 | 5,762" in md


def test_report_of_a_stopped_8b_part_keeps_its_finished_runs(tmp_path):
    """(f) on a GPU, stopped by its time limit after three of its four runs: the report
    keeps their figures (compiled/eager at 8K, the compile time the trainer logged) with
    torchtitan's beside. The runs are (f)'s own records, step times made up."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import device_check
    import device_check_8b as f8
    four = dict(f8.LLAMA3_8B, layers=4)
    rec = f8.new_record("NVIDIA H100 80GB HBM3", f8.LLAMA3_8B, f8.SEQS, 4,
                        [dict(layers=4, seq=32768, plan_gib=32.3)],
                        (989.4, "GPU_PEAKS['H100'] (bf16 dense)"), 80 * 2 ** 30)
    for seq, compiled, step_s in ((8192, False, 0.25), (8192, True, 0.2), (32768, True, 1.1)):
        run = dict(seq=seq, compiled=compiled, status="ok", step_s=step_s, plan_peak_gib=30.0,
                   measured_peak_gib=31.5,
                   model_flop_per_step=f8.whole_model_flop_per_token(four, seq) * seq)
        if compiled:
            run.update(f8._logged(["--torch-compile: 4 transformer blocks compiled whole",
                                   "--torch-compile: 4 compilations in 52.5 s (the first "
                                   "forward and backward)", "kernels (cuda): AdamW fused"]))
        run.update(f8._rates(run, f8.LLAMA3_8B, seq, 989.4))
        rec["runs"].append(run)
        rec.update(f8.summarize(rec))
    f8._save(str(tmp_path), rec)
    (tmp_path / "parts.tsv").write_text("8b\t124\t135\t135\n")
    f = device_check.report(str(tmp_path))["parts"]["8b"]
    assert f["status"] == "timeout" and len(f["runs"]) == 3
    at_8k, at_32k = f["summary"]
    assert at_8k["ratio_compiled_over_eager"] == pytest.approx(1.25)
    assert at_8k["compile_s"] == 52.5 and "ratio_compiled_over_eager" not in at_32k
    assert f["runs"][1]["mfu"] == pytest.approx(8192 * f8.whole_model_flop_per_token(four, 8192)
                                                / 0.2 / 989.4e12)
    # torchtitan's 8K bf16 rows by our count: the 33% and 39% MFU torchtitan states
    assert [round(100 * t["mfu"], 1) for t in f["torchtitan"][:2]] == [33.7, 39.0]
    md = (tmp_path / "device_check.md").read_text()
    assert "| (f) 8b | timeout | 135 | 4 of Llama-3-8B's 32 layers" in md
    assert "8192: eager 32,768 / compiled 40,960 tokens/s (x1.25)" in md
    assert "| ours, --torch-compile | 32768 | 29,789 |" in md and "| 52 |" in md
    assert "kernels (cuda): AdamW fused" in md and "llama3_h100_202412_torchtitan.md" in md


def _bin(tmp_path, **scripts) -> str:
    """A folder of executables: name -> shell script text, or a path to link to."""
    folder = tmp_path / "bin"
    folder.mkdir(exist_ok=True)
    for name, body in scripts.items():
        if os.path.isabs(body):
            os.symlink(body, folder / name)
        else:
            (folder / name).write_text("#!/bin/sh\n" + body)
            (folder / name).chmod(0o755)
    return str(folder)


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    env.update(extra)
    return env


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that sees no GPU")
def test_gpu_listed_but_not_seen_by_torch_fails_with_python3_only(tmp_path):
    """nvidia-smi lists a GPU, this CPU build of torch sees none: exit 3 at once, nothing
    run. PATH has python3 but no python: the script takes python3."""
    # a wrapper, not a link: a link to a virtualenv's python leaves the virtualenv (python
    # finds its pyvenv.cfg beside the path it was started by) and loses its packages
    fake = _bin(tmp_path, python3=f'exec "{sys.executable}" "$@"\n',
                **{"nvidia-smi": 'echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"\n'})
    r = _run(["bash", SHELL, str(tmp_path / "dc")], timeout=120,
             env=_env(PATH=f"{fake}:/usr/bin:/bin"))
    assert r.returncode == 3, r.stdout + r.stderr
    assert f"python: {fake}/python3" in r.stdout
    assert "nvidia-smi lists 1 GPU(s) but torch sees no CUDA device" in r.stderr
    assert not (tmp_path / "dc" / "parts.tsv").exists()  # no part ran


def test_missing_package_is_named_and_exits_2(tmp_path):
    """pytest unimportable (shadowed by a package that fails to import): exit 2 naming it."""
    shadow = tmp_path / "shadow" / "pytest"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('shadowed by the test')\n")
    r = _run(["bash", SHELL, str(tmp_path / "dc")], timeout=120,
             env=_env(PYTHON=sys.executable, PYTHONPATH=str(tmp_path / "shadow")))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "missing python packages: pytest (ImportError: shadowed by the test)" in r.stderr


def _default(name: str, text: str) -> int:
    return int(re.search(r"\$\{" + name + r":-(\d+)\}", text).group(1))


def test_the_budget_fits_8_minutes():
    """The parts' default limits, 20 s for the checks before them and 20 s for the report
    fit DC_TOTAL, and DC_TOTAL fits 8 minutes."""
    text = open(SHELL).read()
    limits = [int(n) for n in re.findall(r"\$\{DC_LIMIT_\w+:-(\d+)\}", text)]
    assert len(limits) == 8  # pytest, ring, flex, flash, parity, throughput, hf, 8b
    total = _default("DC_TOTAL", text)
    assert sum(limits) + 20 + 20 <= total <= 480


def _snippet(name: str) -> str:
    r = _run(["bash", SHELL, "--print-snippet", name], timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.parametrize("name", ["ring", "flex", "flash"])
def test_kernel_snippets_parse(name):
    ast.parse(_snippet(name))


def test_ring_snippet_runs_on_the_cpu():
    """Part (e)'s ring check itself, small, on the CPU: forward and backward against math."""
    r = subprocess.run([sys.executable, "-"], input=_snippet("ring"), cwd=REPO, text=True,
                       capture_output=True, timeout=120,
                       env=_env(DC_DEVICE="cpu", DC_SEQ="128"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("ring: ok")


def test_flash_snippet_skips_without_flash_attn():
    from megaulysses.model.attention import flash_available
    if flash_available(torch.device("cuda")):
        pytest.skip("flash_attn runs here")
    r = subprocess.run([sys.executable, "-"], input=_snippet("flash"), cwd=REPO, text=True,
                       capture_output=True, timeout=60, env=_env(DC_DEVICE="cpu"))
    assert r.returncode == 0 and r.stdout.startswith("flash: skipped"), r.stdout + r.stderr


def _fpdt_on(device: str, dtype: torch.dtype, offload: bool) -> tuple[list, list]:
    """Chunked Ulysses attention (parallel/fpdt.py) on one device, no process group (sp 1:
    its exchanges are the identity; its chunk pairs, fused kernel and host copies run as
    on any rank): ([out, dq, dk, dv], what forward kept for backward)."""
    from megaulysses.parallel.comm import Comm
    from megaulysses.parallel.fpdt import ChunkedUlyssesAttention
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(2, 256, h, 64, device=device, generator=g).to(dtype)
                     for h in (8, 2, 2, 8))
    x = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ChunkedUlyssesAttention(Comm(), 4, offload)(*x, 0.0, AttentionMask())
    kept = list(out.grad_fn.saved_tensors)
    return [out.detach()] + list(torch.autograd.grad(out, x, dout)), kept


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fpdt_offload_on_cuda_keeps_pinned_host_chunks_and_changes_nothing(dtype, ieee_fp32):
    """The CUDA path of --ds-sequence-parallel-fpdt-offloading (pinned host copies, fetched
    back to the GPU), which CPU tests cannot reach: the same numbers as without offload,
    bit for bit, everything kept in pinned host memory, and math attention's results."""
    plain, _ = _fpdt_on("cuda", dtype, False)
    off, kept = _fpdt_on("cuda", dtype, True)
    assert all(torch.equal(a, b) for a, b in zip(plain, off, strict=True))
    assert all(t.device.type == "cpu" and t.is_pinned() for t in kept)
    g = torch.Generator(device="cuda").manual_seed(0)
    ref_in = [torch.randn(2, 256, h, 64, device="cuda", generator=g).to(dtype).float()
              for h in (8, 2, 2, 8)]
    x = [t.clone().requires_grad_() for t in ref_in[:3]]
    want_out = math_attention(*x, 0.0, AttentionMask())
    want = [want_out] + list(torch.autograd.grad(want_out, x, ref_in[3]))
    # the other CUDA kernel checks' tolerances (not measured on a GPU: none was lent yet)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for got, w in zip(off, want, strict=True):
        err = float((got.float() - w).abs().max() / w.abs().max())
        assert err <= tol, err
