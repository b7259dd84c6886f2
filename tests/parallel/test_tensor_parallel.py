"""One transformer block under tensor parallelism (plain and Megatron-SP) == one process,
forward and backward, and the bytes its collectives send == the formula; counted with a
step's key, the first pass runs the counting dispatch mode and later passes add the same
bytes without it (CommStats.counted_once)."""

import pytest
import torch

from dist import run_ranks
from helpers import llama_config

B, S, H = 2, 16, 64
FP32_TOL = 1e-5


def block_tp(rank, world, sequence_parallel):
    from torch.distributed.tensor.parallel import parallelize_module
    from megaulysses.model.attention import math_attention
    from megaulysses.model.gpt import build_model
    from megaulysses.parallel.comm import Comm
    from megaulysses.parallel.dims import ParallelDims, build_mesh
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    from megaulysses.parallel.tensor import _block_plan, megatron_sp_bytes_per_layer
    cfg = llama_config(num_layers=1, hidden_size=H, num_attention_heads=4, num_query_groups=2,
                      seq_length=S, vocab_size=128)
    comm = Comm(build_mesh(ParallelDims(dp=1, tp=world, pp=1, sp=1), "cpu"))
    ref_model = build_model(cfg, math_attention, seed=5)
    tp_model = build_model(cfg, math_attention, seed=5)
    ref, block = ref_model.layers["0"], tp_model.layers["0"]
    parallelize_module(block, comm.mesh("tp"), _block_plan(block, sequence_parallel))
    g = torch.Generator().manual_seed(0)
    x, grad = torch.randn(B, S, H, generator=g), torch.randn(B, S, H, generator=g)
    rotary = ref_model.rotary(torch.arange(S).expand(B, S))
    xr = x.clone().requires_grad_()
    yr = ref(xr, rotary)
    yr.backward(grad)
    n = S // world
    keep = slice(rank * n, (rank + 1) * n) if sequence_parallel else slice(None)
    xt = x[:, keep].clone().requires_grad_()
    with comm.counting_dtensor_collectives():
        yt = block(xt, rotary)
        fwd = comm.stats.pop()
        yt.backward(grad[:, keep])
        bwd = comm.stats.pop()
    err = [_rel(yt, yr[:, keep]), _rel(xt.grad, xr.grad[:, keep])]
    for p, q in zip(block.parameters(), ref.parameters(), strict=True):
        gp = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        err.append(_rel(gp, q.grad))
    # (bytes counted, whether a dispatch mode ran) of passes keyed alike; after the
    # gradients are compared, as these passes add to them
    keyed = []
    for _ in range(3):
        with comm.counting_dtensor_collectives(key=("step", B, S)):
            mode = _get_current_dispatch_mode() is not None
            block(xt.detach().requires_grad_(), rotary).backward(grad[:, keep])
        keyed.append((comm.stats.pop(), mode))
    return max(err), fwd, bwd, megatron_sp_bytes_per_layer(B, S, H, world, 4), keyed


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-megatron-sp"])
def test_block_matches_single_process_and_bytes(sequence_parallel):
    for err, fwd, bwd, formula, keyed in run_ranks(block_tp, 2, sequence_parallel):
        assert err < FP32_TOL
        whole = {k: fwd.get(k, 0) + bwd.get(k, 0) for k in set(fwd) | set(bwd)}
        assert keyed == [(whole, True), (whole, False), (whole, False)], keyed
        if sequence_parallel:
            assert fwd == formula, fwd
            # backward: each all-gather's gradient is a reduce-scatter and vice versa
            assert bwd == {"all_gather": formula["reduce_scatter"],
                           "reduce_scatter": formula["all_gather"]}, bwd
        else:  # plain TP: one all-reduce of [b, s, h] after attention and after the MLP
            n = B * S * H * 4
            assert fwd == {"all_reduce": 2 * 2 * n * (2 - 1) // 2}, fwd
            assert bwd == {"all_reduce": 2 * 2 * n * (2 - 1) // 2}, bwd
