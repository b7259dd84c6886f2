"""comm.py's collectives against local computations, forward and backward, with bytes."""

import torch

from dist import run_ranks


def collectives(rank, world):
    from megaulysses.parallel.comm import Comm
    from megaulysses.parallel.dims import ParallelDims, build_mesh
    comm = Comm(build_mesh(ParallelDims(dp=world, tp=1, pp=1, sp=1), "cpu"))
    g = torch.Generator().manual_seed(0)
    full = torch.randn(world, 3, 4 * world, generator=g)  # rank r holds full[r]
    upstream = torch.randn(3, 4 * world * world, generator=g)
    errs = {}
    # all_gather along dim 1, backward = reduce-scatter of the upstream gradient.
    x = full[rank].clone().requires_grad_()
    y = comm.all_gather(x, "dp", gather_dim=1)
    errs["ag_fwd"] = (y - torch.cat(list(full), dim=1)).abs().max().item()
    (grad,) = torch.autograd.grad(y, x, upstream)
    chunk = upstream.shape[1] // world
    want = world * upstream[:, rank * chunk:(rank + 1) * chunk]  # every rank sent the same
    errs["ag_bwd"] = (grad - want).abs().max().item()
    bytes_ag = comm.stats.pop()
    # reduce_scatter along dim 1 of a per-rank tensor, backward = all-gather.
    x = full[rank].clone().requires_grad_()
    y = comm.reduce_scatter(x, "dp", scatter_dim=1)
    n = full.shape[2] // world
    errs["rs_fwd"] = (y - full.sum(0)[:, rank * n:(rank + 1) * n]).abs().max().item()
    (grad,) = torch.autograd.grad(y, x, torch.ones_like(y) * (rank + 1))
    want = torch.cat([torch.ones(3, n) * (r + 1) for r in range(world)], dim=1)
    errs["rs_bwd"] = (grad - want).abs().max().item()
    total = torch.tensor([float(rank)])
    comm.all_reduce_sum(total, "dp")
    errs["ar"] = abs(total.item() - sum(range(world)))
    return errs, bytes_ag, comm.stats.pop()


def test_all_gather_reduce_scatter_all_reduce():
    world = 4
    for errs, bytes_ag, bytes_rest in run_ranks(collectives, world):
        assert max(errs.values()) < 1e-5, errs
        x_bytes = 3 * 4 * world * 4  # one rank's fp32 input
        # all-gather of the output (world * x) sends x to each of the P-1 others;
        # its backward reduce-scatter sends the same amount.
        assert bytes_ag == {"all_gather": 3 * x_bytes, "reduce_scatter": 3 * x_bytes}
        assert bytes_rest["reduce_scatter"] == x_bytes * 3 // 4
        assert bytes_rest["all_gather"] == x_bytes * 3 // 4
        assert bytes_rest["all_reduce"] == 2 * 4 * 3 // 4
