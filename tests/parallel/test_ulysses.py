"""Ulysses attention on P gloo ranks == one-process attention, forward and backward."""

import pytest
import torch

from dist import run_ranks

# (hq, hkv): MHA, GQA with kv heads divisible by P, GQA/MQA with P divisible by kv heads.
CASES = [(8, 8), (8, 4), (8, 2), (8, 1)]
B, S, D = 2, 32, 16  # micro-batch 2
FP32_TOL = 1e-5  # relative to the largest entry; fp32 reorderings only
BF16_TOL = 2e-2  # bf16 has 8 mantissa bits: ~4e-3 per rounding, a few roundings deep


def ulysses_vs_reference(rank, world, dtype_name):
    from megaulysses.model.attention import math_attention, sdpa_attention
    from megaulysses.parallel.comm import Comm
    from megaulysses.parallel.dims import ParallelDims, build_mesh
    from megaulysses.parallel.ulysses import UlyssesAttention, slice_sequence, ulysses_bytes_per_layer
    dtype = getattr(torch, dtype_name)
    comm = Comm(build_mesh(ParallelDims(dp=1, tp=1, pp=1, sp=world), "cpu"))
    out = []
    for hq, hkv in CASES:
        if hkv % world and world % hkv:
            continue
        g = torch.Generator().manual_seed(hq * 10 + hkv)
        q, k, v, grad = (torch.randn(B, S, h, D, generator=g).to(dtype)
                         for h in (hq, hkv, hkv, hq))
        for name, core in (("math", math_attention), ("sdpa", sdpa_attention)):
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = math_attention(*(t.float() for t in full), 0.0)
            ref_grads = torch.autograd.grad(ref, full, grad.float())
            local = [slice_sequence(t, comm).detach().clone().requires_grad_() for t in (q, k, v)]
            comm.stats.pop()
            y = UlyssesAttention(core, comm)(*local, 0.0)
            fwd_bytes = comm.stats.pop().get("all_to_all", 0)
            grads = torch.autograd.grad(y, local, slice_sequence(grad, comm))
            bwd_bytes = comm.stats.pop().get("all_to_all", 0)
            errs = [_rel(y, slice_sequence(ref, comm))]
            errs += [_rel(a, slice_sequence(b, comm))
                     for a, b in zip(grads, ref_grads, strict=True)]
            expected = ulysses_bytes_per_layer(B, S, hq, hkv, D, world, q.element_size())
            out.append(dict(case=(hq, hkv, name), err=max(errs), fwd=fwd_bytes, bwd=bwd_bytes,
                            expected=expected, shape=tuple(y.shape)))
    return out


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype,tol", [("float32", FP32_TOL), ("bfloat16", BF16_TOL)])
def test_ulysses_matches_single_process(world, dtype, tol):
    results = run_ranks(ulysses_vs_reference, world, dtype)
    for rank_results in results:
        assert len(rank_results) == 2 * len(CASES)  # every case applies at P = 2 and 4
        for r in rank_results:
            assert r["err"] < tol, r
            assert r["shape"] == (B, S // world, r["case"][0], D), r
            # Bytes counted by comm.py == the formula (forward; backward sends the same).
            assert r["fwd"] == r["expected"] and r["bwd"] == r["expected"], r


def test_mha_bytes_formula_is_the_papers():
    """4 b S h bytes (P-1)/P^2 for MHA, h = heads * head_dim."""
    from megaulysses.parallel.ulysses import ulysses_bytes_per_layer
    b, S, heads, d, P = 1, 8192, 16, 64, 4
    assert ulysses_bytes_per_layer(b, S, heads, heads, d, P, 4) == \
        4 * b * S * heads * d * 4 * (P - 1) // P ** 2
