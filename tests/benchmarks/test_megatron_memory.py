"""Issue 29's targets in --dry-run (benchmarks/megatron_memory.py prints them with the
numbers before): Megatron-LM's GPT-3 175B example as written fits 128 H100s (every
pipeline rank <= 80 GiB); a Llama-3-8B bf16 run with --use-distributed-optimizer
--grad-reduce-in-bf16 on 8 x H200 fits at <= 6.3 bytes of model states per parameter; the
Llama-3-8B shape fits one H100 at 64K tokens with --optimizer-cpu-offload."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import megatron_memory as mm  # noqa: E402

LLAMA3_8B_PARAMS = 8.03e9


def test_gpt3_175b_receive_buffers_are_those_in_flight():
    """(The example's --dry-run on 128 H100s: tests/examples/test_megatron_scripts.py.)"""
    before, after = mm.receive_buffers()
    assert before > 140 and after < 0.1  # GiB: 1536 micro-batches' buffers -> in flight


def test_llama3_8b_fits_8_h200s_at_megatron_lms_bytes_per_parameter():
    out = mm.dry_run(mm.DP8_H200 + mm.DIST_OPT)
    assert out["fits"].startswith("fits H200"), out["fits"]
    assert mm.states_per_param(out["plans"][0], LLAMA3_8B_PARAMS) <= 6.3


def test_llama3_8b_fits_one_h100_at_64k_with_the_optimizer_on_the_host():
    out = mm.dry_run(mm.ONE_H100 + mm.OFFLOAD)
    assert out["fits"].startswith("fits H100"), out["fits"]
    assert out["plans"][0]["host memory"] > 100 * 1024  # MiB: fp32 state, on the host
