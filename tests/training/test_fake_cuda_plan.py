"""The memory plan's CUDA branch against a fake CUDA rank (issue 40, item 4).

Each grid's rank runs the real Trainer's step (the second: AdamW's states exist) on the
fake accelerator taken for CUDA (`megaulysses/training/fake_cuda.py`: SDPA's flash and
memory-efficient kernels' meta functions and what autograd saves for them, 1-byte dropout
masks, CUDA's cross-entropy chunks, fused AdamW), and its live bytes (held before the step
+ the step's peak) must be within TOLERANCE of `plan_memory(..., "cuda")`, what
`--dry-run --dry-run-device cuda` prints. The kernels each grid must have run are checked
too, so a grid that fell back to another kernel fails rather than passing on the wrong
branch. What the fake rank cannot show (the kernels' own buffers, the allocator, pinned
host blocks) is listed in fake_cuda.py; `-s` prints the table with those bounds.

One spawned process runs every grid: the fake device is that process's one PrivateUse1
backend for good (tests/training/test_fake_device.py says why).
"""

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest

TOLERANCE = 0.10  # of the measured peak, as tests/parallel/test_memory_plan.py
KERNELS = {  # grid: the kernels its step must run (fake_cuda.GRIDS)
    "plain, fp32 (efficient kernel)": ["efficient"],
    "plain, bf16, GQA, dropout 0.1 (flash, 1-byte masks)": ["dropout mask bool", "flash"],
    "sp2, full, activation offload 1 layer, bf16": ["flash"],
    "sp2, FPDT 2 chunks, offloading, ZeRO-3, full, bf16": ["flash"],
    "dp2, distributed optimizer, offload 0.5, bf16": ["flash"],
    "pp2 1f1b, 4 micro-batches, bf16": ["flash"],
}


def _measure_all():
    from megaulysses.training import fake_cuda
    return fake_cuda.measure_all()


@pytest.fixture(scope="module")
def worker():
    """One spawned process for everything here (the module doc)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool


@pytest.fixture(scope="module")
def results(worker):
    from megaulysses.training import fake_cuda
    out = worker.submit(_measure_all).result(timeout=600)
    print("\nfake CUDA rank vs the plan's cuda branch:\n" + fake_cuda.table(out))
    return out


def _grid_ranks():
    from megaulysses.training.fake_cuda import GRIDS
    return [(name, rank) for name, (_, ranks, _) in GRIDS.items() for rank in ranks]


@pytest.mark.parametrize("name,rank", _grid_ranks())
def test_plan_cuda_branch_predicts_the_fake_cuda_rank(results, name, rank):
    r = results[name, rank]
    assert isinstance(r, dict), f"{name}, rank {rank}:\n{r}"
    assert r["kernels"] == KERNELS[name], r  # the CUDA kernels, not a fallback
    measured, planned = r["measured"], r["planned"]
    assert abs(planned - measured) <= TOLERANCE * measured, (name, rank, planned, measured)


def test_every_grid_is_checked():
    from megaulysses.training.fake_cuda import GRIDS
    assert set(GRIDS) == set(KERNELS)


def test_sdpa_on_the_fake_cuda_device_runs_cudas_kernel(worker):
    """The kernel CUDA's SDPA picks on an H100, by the autograd node it records (which
    decides what is saved for backward)."""
    got = worker.submit(_sdpa_nodes).result(timeout=300)
    assert got == {
        "bf16": "ScaledDotProductFlashAttentionBackward0",
        "bf16 gqa": "ScaledDotProductFlashAttentionBackward0",
        "fp32": "ScaledDotProductEfficientAttentionBackward0",
        "fp32 gqa": "BmmBackward0",  # efficient has no GQA: math, explicit scores
        "bf16 head dim 12": "ScaledDotProductFlashAttentionBackward0",  # padded to 16
    }, got


def _sdpa_nodes() -> dict:
    import torch
    import torch.nn.functional as F
    from megaulysses.training import fake_cuda, fake_device
    cases = {"bf16": (torch.bfloat16, 4, 16), "bf16 gqa": (torch.bfloat16, 2, 16),
             "fp32": (torch.float32, 4, 16), "fp32 gqa": (torch.float32, 2, 16),
             "bf16 head dim 12": (torch.bfloat16, 4, 12)}
    out = {}
    device = fake_device.register()
    with fake_device._FakeMode(allow_non_fake_inputs=True), fake_cuda.as_cuda():
        for name, (dtype, hkv, d) in cases.items():
            q = torch.randn(2, 4, 64, d, device=device, dtype=dtype, requires_grad=True)
            k = torch.randn(2, hkv, 64, d, device=device, dtype=dtype, requires_grad=True)
            o = F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=hkv != 4)
            node = o.grad_fn
            while type(node).__name__.startswith(("Transpose", "Unsafe", "View", "Slice")):
                node = node.next_functions[0][0]
            out[name] = type(node).__name__
    return out


def test_attention_backward_scratch_counts_the_kernels_own_buffers():
    """What the plan adds at a core backward on CUDA (the fake rank cannot see it): flash
    (16-bit) an fp32 dq accumulator over rows rounded to 128 and head dims to 32, fp32
    softmax_d, under GQA dk and dv expanded to the query heads; the efficient kernel
    (fp32) an fp32 grad-q accumulator."""
    from megaulysses.planner.memory.cores import attention_backward_scratch as scratch
    own = 4 * 1024 * 4 * 128 + 4 * 4 * 1024  # dq_accum [1, 1024, 4, 128], softmax_d
    assert scratch(1, 1000, 1000, 4, 4, 128, 2) == own
    assert scratch(1, 1000, 1000, 4, 1, 128, 2) == own + 2 * 2 * 1000 * 4 * 128
    assert scratch(1, 1000, 1000, 4, 4, 100, 2) == own  # head dim 100 runs as 128
    assert scratch(1, 1000, 1000, 4, 1, 128, 4) == 4 * 1000 * 4 * 128
    # Llama-3-8B on 8 H100 at 6,029,312 tokens, sp 8: 4 query heads, 1 kv head a rank
    assert abs(scratch(1, 6029312, 6029312, 4, 1, 128, 2) / 2 ** 30 - 23.1) < 0.05
