"""Ulysses x Ring on 4 gloo ranks == one-process math attention, forward and backward, for
every mask; bytes sent equal the formulas; the zigzag layout and packed-document batches."""

import pytest
import torch

from dist import run_ranks

B, S, D = 2, 64, 8
FP32_TOL = 1e-5  # relative to the largest entry


def masks():
    from megaulysses.model.attention import AttentionMask, SparseLayout
    docs = torch.tensor([[0] * 9 + [1] * 30 + [2] * 25, [0] * 40 + [1] + [2] * 23])
    return {"causal": AttentionMask(), "window": AttentionMask(window=12),
            "documents": AttentionMask(documents=docs),
            "bigbird": AttentionMask(layout=SparseLayout("bigbird", 8, 2, 1, 1, seed=3))}


def usp_vs_reference(rank, world, sp, cp):
    from megaulysses.model.attention import math_attention
    from megaulysses.parallel.comm import Comm
    from megaulysses.parallel.dims import CP, SP, ParallelDims
    from megaulysses.parallel.ring import RingAttention, local_positions, ring_bytes_per_layer
    from megaulysses.parallel.ulysses import UlyssesAttention, ulysses_bytes_per_layer
    comm = Comm(ParallelDims(dp=1, tp=1, pp=1, sp=sp, cp=cp).build_mesh("cpu"))
    mine = local_positions(S, cp, comm.rank(CP), sp, comm.rank(SP))
    core = RingAttention(comm)
    if sp > 1:
        core = UlyssesAttention(core, comm)
    out = []
    for name, mask in masks().items():
        for hq, hkv in ((4, 4), (4, 2), (2, 1)):  # (2, 1): more ranks than heads
            g = torch.Generator().manual_seed(hq + hkv)
            q, k, v, grad = (torch.randn(B, S, h, D, generator=g) for h in (hq, hkv, hkv, hq))
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = math_attention(*full, 0.0, mask)
            ref_grads = torch.autograd.grad(ref, full, grad)
            local = [t[:, mine].clone().requires_grad_() for t in (q, k, v)]
            comm.stats.pop()
            y = core(*local, 0.0, mask)
            grads = torch.autograd.grad(y, local, grad[:, mine])
            sent = comm.stats.pop()
            errs = [_rel(y, ref[:, mine])] + [_rel(a, b[:, mine])
                                              for a, b in zip(grads, ref_grads)]
            fwd, bwd = ring_bytes_per_layer(B, S, max(hkv, sp) // sp, D, cp, 4)
            a2a = 2 * ulysses_bytes_per_layer(B, S // cp, hq, hkv, D, sp, 4) if sp > 1 else 0
            out.append(dict(case=(name, hq, hkv), err=max(errs), ring=sent.get("ring", 0),
                            ring_formula=fwd + bwd, a2a=sent.get("all_to_all", 0),
                            a2a_formula=a2a))
    return out


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("sp,cp", [(1, 4), (2, 2)], ids=["ring4", "ulysses2-ring2"])
def test_ring_matches_single_process(sp, cp):
    for rank_results in run_ranks(usp_vs_reference, sp * cp, sp, cp):
        assert len(rank_results) == 12
        for r in rank_results:
            assert r["err"] < FP32_TOL, r
            assert r["ring"] == r["ring_formula"] and r["a2a"] == r["a2a_formula"], r


def test_zigzag_positions_cover_the_sequence_once():
    from megaulysses.parallel.ring import local_positions, zigzag_positions
    assert zigzag_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert zigzag_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    held = torch.cat([local_positions(48, 3, c, 2, u) for c in range(3) for u in range(2)])
    assert sorted(held.tolist()) == list(range(48))
    assert local_positions(8, 1, 0, 2, 1).tolist() == [4, 5, 6, 7]  # cp 1: contiguous


def test_packed_documents_batch():
    """Positions restart after each EOD and document ids count EODs before a token, both
    from the whole sample; a rank keeps its positions' slice and the whole documents."""
    from megaulysses.data.loader import BatchBuilder

    sample = [5, 6, 0, 7, 8, 9, 0, 0, 4]  # eod = 0; tokens are sample[:-1]
    builder = BatchBuilder([sample], 1, 1, positions=torch.tensor([0, 1, 6, 7]), eod=0,
                           eod_mask_loss=True, reset_position_ids=True,
                           reset_attention_mask=True)
    b = builder.micro_batches(0)[0]
    assert b["documents"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 2]]
    assert b["position_ids"].tolist() == [[0, 1, 3, 0]]  # positions 0, 1, 6, 7 of 01201230
    assert b["tokens"].tolist() == [[5, 6, 0, 0]]
    assert b["loss_mask"].tolist() == [[1.0, 1.0, 0.0, 0.0]]


def test_flops_count_attended_blocks_only():
    from megaulysses.config import ModelConfig
    from megaulysses.training.metrics import flops_per_iteration
    dense = ModelConfig(seq_length=4096, vocab_size=1000)
    window = ModelConfig(seq_length=4096, vocab_size=1000, window_size=512)
    m = dense
    scores = 3 * 2 * m.num_layers * 2 * m.seq_length * m.hidden_size * m.seq_length
    saved = flops_per_iteration(dense, 1) - flops_per_iteration(window, 1)
    # window 512 at blocks of 64: 8.5 of 64.5 average key blocks per query block computed
    fraction = 1 - saved / scores
    assert fraction == pytest.approx((64 * 9 - 36) / (64 * 65 / 2), rel=1e-9)


def test_zigzag_balances_causal_work():
    """Every ring rank computes the same number of (query, key) blocks over its C steps;
    contiguous chunks would give rank C-1 about 2C-1 times rank 0's."""
    from megaulysses.model.attention import AttentionMask
    from megaulysses.model.block_attention import computed_pairs
    from megaulysses.parallel.ring import zigzag_positions
    S, C, block = 1024, 4, 32
    work = [sum(computed_pairs(AttentionMask(), zigzag_positions(S, C, c),
                               zigzag_positions(S, C, src), block) for src in range(C))
            for c in range(C)]
    assert len(set(work)) == 1, work
