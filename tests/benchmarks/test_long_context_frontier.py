"""Issue 24's planner targets and their small-scale check (benchmarks/long_context_frontier.py).

The planner fits Llama-3-8B's shape at 4M tokens on 8 H100 and at 16M on 32 H100 (one
sample, bf16, untied; the grids it picks use activation offload) on the GPU table's nodes
(2 TB of host memory for 8 GPUs). With an fp32 residual stream (--fp32-residual-connection)
the offloaded block inputs take twice the host bytes, and 4M on 8 is refused for host
memory, saying so. The plan of the headline grids holds at small scale: the same flags on
one fake rank of 8 and of 32, measured (benchmarks/fake_rank.py: the real trainer and step,
shapes only), within 10% of the plan.
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
    for gpus, seq in TARGETS:
        c, _ = f.fastest("Llama-3-8B", gpus, gpu_spec("H100"), seq)
        assert c is not None, f"Llama-3-8B at {seq} tokens fits no grid of {gpus} H100"
        assert c.prediction.memory_bytes <= c.prediction.usable_bytes
        assert c.prediction.fits_host
        assert c.prediction.tokens_per_s > 0 and 0 < c.prediction.mfu < 1
        out[gpus] = c.grid
    return out


def test_planner_fits_4m_on_8_and_16m_on_32_h100(headline):
    # the fastest fitting grids: Ulysses over every GPU, full recomputation, ZeRO >= 2
    assert all(g.sp == gpus and g.recompute == "full" and g.zero >= 2
               for gpus, g in headline.items()), headline


def test_fp32_residual_doubles_host_bytes_and_is_refused_for_host_memory(headline):
    import long_context_frontier as f
    from megaulysses.config import parse_args
    from megaulysses.hardware import gpu_spec
    from megaulysses.planner.memory import plan_memory
    from megaulysses.planner.search import configure, evaluate
    gpus, seq = TARGETS[0]
    c, cfg = f.fastest("Llama-3-8B", gpus, gpu_spec("H100"), seq, f.FP32_RESIDUAL)
    assert c is None
    _, base16 = f.fastest("Llama-3-8B", gpus, gpu_spec("H100"), seq)
    host = []
    for base in (base16, cfg):
        run = configure(base, headline[gpus])
        host.append(plan_memory(run, run.dims, 0, "cuda").offload_bytes)
    assert host[1] == 2 * host[0] > 0  # the offloaded block inputs, 16-bit and fp32
    refused = evaluate(cfg, headline[gpus], gpu_spec("H100"), 4.0)
    assert refused.kind == "memory" and "GiB of host memory per GPU" in refused.reason


@pytest.mark.parametrize("gpus", [8, 32])
def test_headline_plan_holds_at_small_scale(headline, gpus):
    import long_context_frontier as f
    r = f.small_scale_check(headline[gpus], gpus)
    if headline[gpus].offload:  # the offloaded inputs, counted apart from device bytes
        assert r["host"] > 0
    assert abs(r["planned"] - r["measured"]) <= PLAN_TOLERANCE * r["measured"], r
