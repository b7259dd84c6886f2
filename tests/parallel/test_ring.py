"""Ulysses x Ring on 4 gloo ranks == one-process math attention, forward and backward, for
every mask; bytes sent equal the formulas; plain causal and full masks run every ring step
on the fused kernel (model/attention/fused.py), the other masks none, and under the causal
mask the ring's working set is the memory plan's, byte for byte; the zigzag layout and
packed-document batches."""

import contextlib

import pytest
import torch

from dist import run_ranks
from helpers import host_syncs

B, S, D = 2, 64, 8
FP32_TOL = 1e-5  # relative to the largest entry
# bf16 ring (fused steps) against the fp32 reference: measured 8.0e-3 (out and grads, cp 4
# and Ulysses 2 x cp 2, GQA 4/2)
BF16_TOL = 3e-2


def masks():
    from megaulysses.model.attention import AttentionMask, SparseLayout
    docs = torch.tensor([[0] * 9 + [1] * 30 + [2] * 25, [0] * 40 + [1] + [2] * 23])
    return {"causal": AttentionMask(), "full": AttentionMask(causal=False),
            "window": AttentionMask(window=12), "documents": AttentionMask(documents=docs),
            "bigbird": AttentionMask(layout=SparseLayout("bigbird", 8, 2, 1, 1, seed=3))}


FUSED = ("causal", "full")  # the masks whose ring steps all run on the fused kernel


def cases():
    """(mask name, hq, hkv, dtype): every mask x heads in fp32 (the full mask: GQA only),
    and causal GQA in bf16."""
    fp32 = [(name, hq, hkv, torch.float32) for name in masks() if name != "full"
            for hq, hkv in ((4, 4), (4, 2), (2, 1))]  # (2, 1): more ranks than heads
    return fp32 + [("full", 4, 2, torch.float32), ("causal", 4, 2, torch.bfloat16)]


def usp_vs_reference(rank, world, sp, cp):
    from megaulysses.model.attention import fused as fused_attention
    from megaulysses.model.attention import math_attention
    from megaulysses.parallel.comm import Comm
    from megaulysses.parallel.dims import CP, SP, ParallelDims, build_mesh
    from megaulysses.parallel.ring import RingAttention, local_positions, ring_bytes_per_layer
    from megaulysses.parallel.ulysses import UlyssesAttention, ulysses_bytes_per_layer
    from megaulysses.training.live_bytes import LiveBytes
    comm = Comm(build_mesh(ParallelDims(dp=1, tp=1, pp=1, sp=sp, cp=cp), "cpu"))
    mine = local_positions(S, cp, comm.rank(CP), sp, comm.rank(SP))
    core = RingAttention(comm)
    if sp > 1:
        core = UlyssesAttention(core, comm)
    out = []
    for name, hq, hkv, dtype in cases():
        mask = masks()[name]
        g = torch.Generator().manual_seed(hq + hkv)
        q, k, v, grad = (torch.randn(B, S, h, D, generator=g) for h in (hq, hkv, hkv, hq))
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = math_attention(*full, 0.0, mask)
        ref_grads = torch.autograd.grad(ref, full, grad)
        local = [t[:, mine].to(dtype).requires_grad_() for t in (q, k, v)]
        dy = grad[:, mine].to(dtype)
        planned = sp == 1 and name == "causal"  # its working set against the plan's
        comm.stats.pop()
        fused_attention.CALLS.clear()
        syncs = host_syncs()  # watched for the fused masks only (the blocks' plan syncs)
        with syncs if name in FUSED else contextlib.nullcontext():
            with LiveBytes() if planned else contextlib.nullcontext() as fwd_mem:
                y = core(*local, 0.0, mask)
            with LiveBytes() if planned else contextlib.nullcontext() as bwd_mem:
                grads = torch.autograd.grad(y, local, dy)
        sent = comm.stats.pop()
        errs = [_rel(y, ref[:, mine])] + [_rel(a, b[:, mine])
                                          for a, b in zip(grads, ref_grads, strict=True)]
        e = torch.finfo(dtype).bits // 8
        fwd, bwd = ring_bytes_per_layer(B, S, max(hkv, sp) // sp, D, cp, e)
        a2a = 2 * ulysses_bytes_per_layer(B, S // cp, hq, hkv, D, sp, e) if sp > 1 else 0
        calls = fused_attention.CALLS
        out.append(dict(case=(name, hq, hkv, str(dtype)), err=max(errs),
                        tol=FP32_TOL if dtype == torch.float32 else BF16_TOL,
                        ring=sent.get("ring", 0), ring_formula=fwd + bwd,
                        a2a=sent.get("all_to_all", 0), a2a_formula=a2a,
                        fused_calls=(sum(n for (_, way), n in calls.items() if way == "forward"),
                                     sum(n for (_, way), n in calls.items() if way == "backward")),
                        fused_expected=(cp, cp) if name in FUSED else (0, 0),
                        host_syncs=syncs.n,
                        # beyond the kept out and lse; backward: beyond dout
                        working_set=(fwd_mem.peak - _nbytes(y) - 4 * B * hq * len(mine),
                                     bwd_mem.peak) if planned else None,
                        planned=_planned(hq, hkv, e, cp, comm.rank(CP)) if planned else None))
    return out


def _planned(hq: int, hkv: int, e: int, cp: int, cp_rank: int) -> tuple[int, int]:
    """The memory plan's fused ring working sets (forward, backward less dout) for ring
    rank `cp_rank` holding S/cp positions of hq heads."""
    from megaulysses.planner import memory as mp
    T = B * S // cp
    s = mp._Shape(b=B, S=S, T=T, Tr=T, h=hq * D, d=D, hq=hq, hkv=hkv, kv=hkv, f=1, V=1, e=e,
                  r=e,
                  tp=1, sp=1, cp=cp, mega_sp=False, swiglu=False, rope=False,
                  layernorm=False, hidden_dropout=False, kernel="ring", ce_rows=1,
                  fused=True, cp_rank=cp_rank)
    return mp._ring_fused_forward(s), mp._ring_fused_backward(s) - e * s.Q


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("sp,cp", [(1, 4), (2, 2)], ids=["ring4", "ulysses2-ring2"])
def test_ring_matches_single_process(sp, cp):
    for rank_results in run_ranks(usp_vs_reference, sp * cp, sp, cp):
        assert len(rank_results) == len(cases())
        for r in rank_results:
            assert r["err"] < r["tol"], r
            assert r["ring"] == r["ring_formula"] and r["a2a"] == r["a2a_formula"], r
            # one fused call per ring step each way for plain masks, none for the others
            assert r["fused_calls"] == r["fused_expected"], r
            if r["case"][0] in FUSED and sp == 1:  # Ulysses' all-to-all has its own
                assert r["host_syncs"] == 0, r
            if r["planned"] is not None:  # planner/memory/cores.py's ring terms are exact
                assert tuple(r["working_set"]) == tuple(r["planned"]), r


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
    from megaulysses.model.attention import computed_pairs
    from megaulysses.parallel.ring import zigzag_positions
    S, C, block = 1024, 4, 32
    work = [sum(computed_pairs(AttentionMask(), zigzag_positions(S, C, c),
                               zigzag_positions(S, C, src), block) for src in range(C))
            for c in range(C)]
    assert len(set(work)) == 1, work
