"""The kernel choice (model/ops/kernels.py) and the foreach grad norm (parallel/grad_norm.py)
against today's per-tensor formulas.

CPU: the choice names torch's kernels and ours, and never imports apex; an installed but
broken apex (a real package on sys.path whose import fails, or without its CUDA extension)
gives one warning naming what failed, and torch's kernels and ours. The grad norm, the
parameter norm and the zero count equal the per-tensor reference bit for bit (the fp64
per-tensor values are summed in the same order); unscaling and clipping are elementwise
products by the same scalar, so they too are exact. AdamW is torch's fused one wherever
torch has the kernel, else its foreach one (never the per-parameter for-loop).

CUDA (`-m cuda`, part (a) of benchmarks/device_check.sh): the same grad norm on the GPU
(one multi-tensor kernel per dtype, fp64 sums in another order: 1e-12 relative), the
chosen fused AdamW against torch's for-loop AdamW on the same tensors (fused and for-loop
round differently: 1e-5 relative after 3 steps, measured 2.4e-7 absolute on the CPU), and
RMSNorm as chosen against ours (apex where present: 1e-5 of the largest magnitude, the
tolerance of tests/model/test_fused_ops.py).
"""

import logging
import sys

import pytest
import torch

from megaulysses.config import TrainConfig
from megaulysses.model.ops import kernels, norms
from megaulysses.parallel.grad_norm import (GradPart, _global_norm, num_zeros, params_norm,
                                            unscale_and_clip)
from megaulysses.training.optim import adamw

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


# -- the choice -----------------------------------------------------------------------------

@pytest.fixture
def apex_on_path(tmp_path, monkeypatch):
    """A function writing a real package named apex (files: relative path -> source) into a
    directory put first on sys.path; every module it imported is forgotten afterwards."""
    before = set(sys.modules)

    def install(files: dict) -> None:
        for rel, source in files.items():
            path = tmp_path / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(source)
        monkeypatch.syspath_prepend(str(tmp_path))
    yield install
    for name in set(sys.modules) - before:
        if name == "apex" or name.startswith("apex.") or name == "fused_layer_norm_cuda":
            del sys.modules[name]


BROKEN = {
    "import fails": ({"apex/__init__.py": "raise ImportError('apex was built for torch 1.13')"},
                     "ImportError: apex was built for torch 1.13"),
    "no CUDA extension": ({"apex/__init__.py": "",
                           "apex/normalization/__init__.py": "",
                           "apex/normalization/fused_layer_norm.py":
                               "import torch\n\n\nclass FusedRMSNormAffineFunction("
                               "torch.autograd.Function):\n    pass\n"},
                          "fused_layer_norm_cuda"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_apex_warns_and_torch_is_used(case, apex_on_path, caplog):
    files, named = BROKEN[case]
    apex_on_path(files)
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        chosen = kernels.decide("cuda")
    assert chosen.rms_norm is None and named in chosen.apex_problem
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and named in warnings[0] and "apex is installed" in warnings[0]
    line = chosen.describe()
    assert "AdamW torch fused" in line and "RMSNorm ours" in line and "torch foreach" in line


def test_off_cuda_apex_is_not_imported(apex_on_path, caplog):
    """Without CUDA (the device is the CPU) the choice is torch's kernels and ours, whatever
    apex is installed, and nothing imports it (no warning even for a broken one)."""
    apex_on_path(BROKEN["import fails"][0])
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        chosen = kernels.decide("cpu")
    assert chosen == kernels.Kernels("cpu") and not caplog.records
    assert "apex" not in sys.modules
    assert chosen.describe().startswith("kernels (cpu): AdamW torch fused")
    assert kernels.select_kernels(torch.device("cpu")) is kernels.select_kernels("cpu")


def test_adamw_is_fused_where_torch_has_it_else_foreach(caplog):
    t = TrainConfig()
    fused = adamw([{"params": [torch.nn.Parameter(torch.randn(4, 3))]}], t)
    assert fused.defaults["fused"] and not fused.defaults["foreach"]
    # torch has no fused AdamW for complex parameters: foreach for the whole optimizer
    with caplog.at_level(logging.INFO, logger="megaulysses.training.optim"):
        mixed = adamw([{"params": [torch.nn.Parameter(torch.randn(4, 3)),
                                   torch.nn.Parameter(torch.randn(2, dtype=torch.cfloat))]}], t)
    assert mixed.defaults["foreach"] and not mixed.defaults["fused"]
    assert any("torch.complex64 on cpu" in r.getMessage() for r in caplog.records)
    for p in mixed.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    mixed.step()  # foreach steps it (fused would have refused here)


# -- the grad norm against today's per-tensor formula ----------------------------------------

def reference_sum(tensors, of) -> float:
    """grad_norm.py's `_sum_of` before issue 43: one kernel (or two) per tensor, stacked."""
    if not tensors:
        return 0.0
    return float(torch.stack([of(t) for t in tensors]).sum())


def ref_squares(t):
    return torch.linalg.vector_norm(t, dtype=torch.float64) ** 2


def ref_zeros(t):
    return (t.numel() - torch.count_nonzero(t)).to(torch.float64)


def mixed_tensors(seed: int = 0) -> list:
    """fp32 and bf16 interleaved (several groups, their order mixed), an empty one, a large
    one, a strided view, exact zeros, and large and tiny magnitudes."""
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(1 << 20, generator=g) * 3.0
    big[::7] = 0.0
    wide = torch.randn(64, 96, generator=g)
    return [torch.randn(128, 64, generator=g).bfloat16(), big, torch.empty(0),
            torch.randn(33, generator=g) * 1e-20, wide[:, ::3],
            torch.randn(7, 5, generator=g).bfloat16() * 1e4, torch.zeros(17),
            torch.empty(0, dtype=torch.bfloat16), *many_tensors(seed)]


def many_tensors(seed: int) -> list:
    """40 tensors of like magnitudes, every third bf16: summed group by group instead of in
    their order, their squares give another fp64 sum (measured: 4.7e-10 apart of ~1e5)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(40):
        t = torch.randn(int(torch.randint(1, 3000, (1,), generator=g)), generator=g)
        t = t * float(torch.rand(1, generator=g) * 10)
        out.append(t.bfloat16() if i % 3 == 0 else t)
    return out


def grouped_order_sum(tensors) -> float:
    """What summing each dtype's group apart would give (not what grad_norm.py does)."""
    by_dtype = [[t for t in tensors if t.dtype == d] for d in (torch.float32, torch.bfloat16)]
    return float(torch.cat([torch.stack([ref_squares(t) for t in ts]) for ts in by_dtype
                            if ts]).sum())


@pytest.mark.parametrize("pick", ["mixed", "many", "fp32 only", "one", "none"])
def test_foreach_norms_equal_the_per_tensor_formula(pick):
    tensors = mixed_tensors()
    tensors = {"mixed": tensors, "fp32 only": [t for t in tensors if t.dtype == torch.float32],
               "many": many_tensors(0), "one": tensors[1:2], "none": []}[pick]
    parts = [GradPart(t) for t in tensors]
    if pick == "many":  # these tensors tell the orders of summation apart
        assert grouped_order_sum(tensors) != reference_sum(tensors, ref_squares)
    assert _global_norm(parts, None) == reference_sum(tensors, ref_squares) ** 0.5
    assert params_norm(parts) == reference_sum(tensors, ref_squares) ** 0.5
    assert num_zeros(parts) == int(reference_sum(tensors, ref_zeros))
    # uncounted parts (the tied embedding's copy) are left out of every sum
    half = [GradPart(t, counted=i % 2 == 0) for i, t in enumerate(tensors)]
    assert _global_norm(half, None) == reference_sum(tensors[::2], ref_squares) ** 0.5


def test_zero_count_treats_nan_and_inf_as_nonzero():
    t = torch.tensor([0.0, float("nan"), -0.0, float("inf"), 1.0])
    assert num_zeros([GradPart(t), GradPart(t.bfloat16())]) == 4


def reference_unscale_and_clip(tensors, inv_scale, max_norm) -> float:
    """unscale_and_clip before issue 43: one _foreach_mul_ over the mixed list."""
    if inv_scale != 1.0:
        torch._foreach_mul_(tensors, inv_scale)
    norm = reference_sum(tensors, ref_squares) ** 0.5
    if max_norm > 0 and norm == norm and norm != float("inf") and norm > max_norm:
        torch._foreach_mul_(tensors, max_norm / (norm + 1e-6))
    return norm


@pytest.mark.parametrize("inv_scale, max_norm", [(1.0, 0.0), (1.0, 1.0), (2.0 ** -16, 1e-3),
                                                 (0.5, 1e30)])
def test_unscale_and_clip_unchanged(inv_scale, max_norm):
    mine, ref = mixed_tensors(), mixed_tensors()
    norm = unscale_and_clip([GradPart(t) for t in mine], inv_scale, max_norm)
    assert norm == reference_unscale_and_clip(ref, inv_scale, max_norm)
    for a, b in zip(mine, ref, strict=True):
        assert torch.equal(a, b)


def test_non_finite_norm_leaves_grads_unclipped():
    tensors = mixed_tensors()
    tensors[3][0] = float("inf")
    before = [t.clone() for t in tensors]
    assert unscale_and_clip([GradPart(t) for t in tensors], 1.0, 1.0) == float("inf")
    assert all(torch.equal(a, b) for a, b in zip(tensors, before, strict=True))


# -- CUDA: part (a) of benchmarks/device_check.sh -------------------------------------------

@pytest.mark.cuda
@needs_cuda
def test_cuda_grad_norm_clip_and_optimizer_against_unfused():
    tensors = [t.cuda() for t in mixed_tensors()]
    want = reference_sum(tensors, ref_squares) ** 0.5
    got = _global_norm([GradPart(t) for t in tensors], None)
    assert abs(got - want) <= 1e-12 * want, (got, want)
    assert num_zeros([GradPart(t) for t in tensors]) == int(reference_sum(tensors, ref_zeros))
    mine, ref = tensors, [t.clone() for t in tensors]
    norm = unscale_and_clip([GradPart(t) for t in mine], 2.0 ** -10, 1e-3)
    reference_unscale_and_clip(ref, 2.0 ** -10, 1e-3)
    assert abs(norm * 2.0 ** 10 - want) <= 1e-12 * want
    # clip factors from norms 1e-12 apart: a few ulps at most
    for a, b in zip(mine, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)

    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(256, 128), (128,), (1000, 33)]
    start = [torch.randn(s, device="cuda", generator=g) for s in shapes]
    grads = [[torch.randn(s, device="cuda", generator=g) for s in shapes] for _ in range(3)]
    t = TrainConfig(lr=1e-2, weight_decay=0.1)
    chosen = [torch.nn.Parameter(x.clone()) for x in start]
    loop = [torch.nn.Parameter(x.clone()) for x in start]
    opt = adamw([{"params": chosen, "weight_decay": 0.1}], t)
    assert opt.defaults["fused"]
    ref_opt = torch.optim.AdamW([{"params": loop, "weight_decay": 0.1}], lr=1e-2,
                                foreach=False)
    for step in grads:
        for o, ps in ((opt, chosen), (ref_opt, loop)):
            for p, gr in zip(ps, step, strict=True):
                p.grad = gr.clone()
            o.step()
    for a, b in zip(chosen, loop, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
@needs_cuda
def test_cuda_rms_norm_as_chosen_against_ours():
    chosen = kernels.select_kernels(torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4, 64, 256, device="cuda", generator=g)
    w = torch.rand(256, device="cuda", generator=g) + 0.5
    dy = torch.randn(4, 64, 256, device="cuda", generator=g)
    assert (norms._apex(x, w) is not None) == (chosen.rms_norm is not None)
    out = []
    for fn in (norms.rms_norm, lambda x, w, eps: norms._RMSNorm.apply(x, w, eps)):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xi, wi, 1e-5)
        out.append((y, *torch.autograd.grad(y, (xi, wi), dy)))
    for a, b in zip(*out, strict=True):
        assert a.dtype == b.dtype == torch.float32
        scale = b.abs().max().item()
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * scale)
