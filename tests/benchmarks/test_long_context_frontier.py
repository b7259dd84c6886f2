"""Issue 24's planner targets and their small-scale check (benchmarks/long_context_frontier.py).

The planner fits Llama-3-8B's shape at 4M tokens on 8 H100 and at 16M on 32 H100 (one
sample, bf16, untied; the grids it picks use activation offload) on nodes with 4 TB of
host memory; on the table's 2 TB nodes it refuses them for the offloaded activations'
host bytes (fp32, 256 GiB a GPU at 4M on 8), saying so. The plan of the 4 TB grids holds
at small scale: the same flags on one fake rank of 8 and of 32, measured
(benchmarks/fake_rank.py: the real trainer and step, shapes only), within 10% of the plan.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "benchmarks"))

PLAN_TOLERANCE = 0.10  # the memory plan's accuracy everywhere (test_memory_plan.py)
TARGETS = ((8, 4 * 2 ** 20), (32, 16 * 2 ** 20))  # (H100s, tokens): issue 24's


@pytest.fixture(scope="module")
def headline():
    """{gpus: the fastest grid that fits} at 4M tokens on 8 and 16M on 32 H100."""
    import long_context_frontier as f
    from megaulysses.hardware import gpu_spec
    out = {}
    h100 = gpu_spec("H100", host_memory_gib=f.NODE_HOST_GIB["4 TB"])
    for gpus, seq in TARGETS:
        c, _ = f.fastest("Llama-3-8B", gpus, h100, seq)
        assert c is not None, f"Llama-3-8B at {seq} tokens fits no grid of {gpus} H100"
        assert c.prediction.memory_bytes <= c.prediction.usable_bytes
        assert c.prediction.tokens_per_s > 0 and 0 < c.prediction.mfu < 1
        out[gpus] = c.grid
    return out


def test_planner_fits_4m_on_8_and_16m_on_32_h100(headline):
    assert all(g.offload and g.recompute == "full" and g.zero == 3
               for g in headline.values())


def test_two_tb_nodes_are_refused_for_host_memory():
    import long_context_frontier as f
    from megaulysses.config import parse_args
    from megaulysses.hardware import gpu_spec
    from megaulysses.planner.search import evaluate
    gpus, seq = TARGETS[0]
    c, cfg = f.fastest("Llama-3-8B", gpus, gpu_spec("H100"), seq)
    assert c is None
    c, base = f.fastest("Llama-3-8B", gpus, gpu_spec("H100", host_memory_gib=1e4), seq)
    refused = evaluate(base, c.grid, gpu_spec("H100"), 4.0)
    assert refused.kind == "memory" and "GiB of host memory per GPU" in refused.reason


@pytest.mark.parametrize("gpus", [8, 32])
def test_headline_plan_holds_at_small_scale(headline, gpus):
    import long_context_frontier as f
    r = f.small_scale_check(headline[gpus], gpus)
    assert r["host"] > 0  # the offloaded inputs, counted apart from device bytes
    assert abs(r["planned"] - r["measured"]) <= PLAN_TOLERANCE * r["measured"], r
