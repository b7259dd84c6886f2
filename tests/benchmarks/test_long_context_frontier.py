"""Issue 40's planner targets and their small-scale checks (benchmarks/long_context_frontier.py).

The planner's own search (every grid, offload, chunking and optimizer option, as
`tools/plan.py --gpus N --gpu H100` with Llama-3-8B's flags only) fits 512K tokens on one
H100, 6M on 8 and 24M on 32 (one sample, bf16, untied), each with 10% of the attention
backward's unmeasured kernel buffers free beyond the plan and the host within its share
of the 2 TB nodes. With an fp32 residual stream (--fp32-residual-connection) the
offloaded block inputs take twice the host bytes, and the 8-GPU grid is refused for host
memory, saying so. The plan of each target's grid holds at small scale: the same flags
on one fake rank of the same world, measured on CPU (benchmarks/fake_rank.py) and on a
fake CUDA rank (training/fake_cuda.py), within 10% of the plan's cpu and cuda branches.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "benchmarks"))

PLAN_TOLERANCE = 0.10  # the memory plan's accuracy everywhere (test_memory_plan.py)


@pytest.fixture(scope="module")
def targets():
    """{gpus: the planner's fastest fitting grid} at each of issue 40's targets."""
    import long_context_frontier as f
    out = {}
    for gpus, seq, _ in f.TARGETS:
        c, _ = f.planned(gpus, seq)
        assert c is not None, f"Llama-3-8B at {seq} tokens fits no grid of {gpus} H100"
        p = c.prediction
        assert p.margin_bytes > 0  # flash's buffers at these lengths: GiBs, 10% kept free
        assert p.memory_bytes + p.margin_bytes <= p.usable_bytes and p.fits_host
        assert p.tokens_per_s > 0 and 0 < p.mfu < 1
        out[gpus] = c.grid
    return out


def test_planner_meets_the_targets_with_host_and_device_together(targets):
    one, eight = targets[1], targets[8]
    # one GPU: ZeRO-3's shards, gradients and AdamW on the host, every layer's input too
    assert one.param_offload and one.offload == 32 and one.recompute == "full"
    # eight: offloading all 32 layers' inputs outgrows the host's share; the rest stay
    assert eight.sp == 8 and 0 < eight.offload < 32, eight
    assert all(g.recompute == "full" and g.zero == 3 for g in targets.values()), targets


def test_fp32_residual_doubles_host_bytes_and_is_refused_for_host_memory(targets):
    import long_context_frontier as f
    from megaulysses.hardware import gpu_spec
    from megaulysses.planner.memory import plan_memory
    from megaulysses.planner.search import configure, evaluate
    gpus, seq, _ = f.TARGETS[1]
    _, base16 = f.planned(gpus, seq)
    _, base32 = f.fastest("Llama-3-8B", gpus, gpu_spec("H100"), seq, f.FP32_RESIDUAL)
    host = []
    for base in (base16, base32):
        run = configure(base, targets[gpus])
        host.append(plan_memory(run, run.dims, 0, "cuda").offload_bytes)
    assert host[1] == 2 * host[0] > 0  # the offloaded block inputs, 16-bit and fp32
    refused = evaluate(base32, targets[gpus], gpu_spec("H100"), 4.0)
    assert refused.kind == "memory" and "GiB of host memory per GPU" in refused.reason


@pytest.fixture(scope="module")
def checks(targets):
    """{gpus: (CPU rank's check, fake CUDA rank's)}, all measured in one spawned process."""
    import long_context_frontier as f
    return f.small_scale_checks(targets)


@pytest.mark.parametrize("gpus", [1, 8, 32])
def test_target_plans_hold_at_small_scale_on_cpu_and_fake_cuda(targets, checks, gpus):
    r, c = checks[gpus]
    if targets[gpus].offload or targets[gpus].param_offload:  # counted apart from the device
        assert r["host"] > 0
    assert abs(r["planned"] - r["measured"]) <= PLAN_TOLERANCE * r["measured"], r
    assert not isinstance(c, str), c
    assert "flash" in c["kernels"], c  # the CUDA branch ran, not a fallback
    assert abs(c["planned"] - c["measured"]) <= PLAN_TOLERANCE * c["measured"], c
