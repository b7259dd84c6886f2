"""The all-to-all hidden behind compute (parallel/a2a_overlap.py): the overlapped Ulysses
paths compute exactly what the blocking ones do, and a profiler trace shows an exchange in
flight while attention runs.

One spawn of 2 gloo ranks (sp2), every case run overlapped and blocking in the same ranks:
  equality   forward output and every input gradient bit for bit (torch.equal: an
             exchange moves bytes, so nothing may differ), and the all-to-all bytes
             counted equal, for plain Ulysses (G = 1), head groups (G = 2, 4; MHA, GQA
             with kv grouped, kv exchanged whole, kv repeated), head groups nested in a
             block's checkpoint (full recomputation), without grad, bf16; and FPDT
             (chunks 2, 4; MHA and GQA, a window, offloaded, bf16).
  profiler   torch.profiler (CPU) over a head-group layer (G = 2) forward and backward,
             overlapped and blocking: at the start of every core run (forward, its
             recomputation) and of every core backward, the overlapped layer has an
             exchange issued and not yet waited for (the blocking one never), and at least
             one of them is physically in flight then: issued (c10d's all-to-all op on
             the main thread) and not finished (gloo's `gloo:all_to_all` record on its
             worker thread ends later). Counts of events, no timing threshold.
"""

import pytest
import torch
from torch.profiler import record_function

from dist import run_ranks

B, S, D = 2, 32, 8


def _grads(comm, layer, ins, dy, mask=None):
    """([out, *input grads] of `layer.take` on fresh leaves of `ins`, the bytes sent)."""
    leaves = [t.clone().requires_grad_() for t in ins]
    comm.stats.pop()
    y = layer.take(list(leaves), 0.0, mask)
    grads = torch.autograd.grad(y, leaves, dy)
    return [y.detach()] + list(grads), comm.stats.pop()


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _inputs(comm, hq, hkv, dtype, seed):
    from megaulysses.parallel.ulysses import slice_sequence
    g = torch.Generator().manual_seed(seed)
    return [slice_sequence(torch.randn(B, S, h, D, generator=g), comm).to(dtype)
            for h in (hq, hkv, hkv, hq)]


def ulysses_cases(comm) -> dict:
    """{case: (outputs and grads equal, bytes equal)} for Ulysses and head groups."""
    from megaulysses.model.attention import math_attention, sdpa_attention
    from megaulysses.parallel.head_groups import HeadGroups
    from megaulysses.parallel.ulysses import UlyssesAttention
    out = {}
    f32, bf16 = torch.float32, torch.bfloat16
    # (hq, hkv, G, dtype, core): G = 1 MHA, GQA repeated; G = 2, 4 MHA (kv grouped), GQA
    # kv grouped (8/4), kv whole (8/2), kv repeated (8/1); bf16
    cases = [(8, 8, 1, f32, sdpa_attention), (8, 1, 1, f32, math_attention),
             (8, 8, 2, f32, sdpa_attention), (8, 8, 4, f32, math_attention),
             (8, 4, 2, f32, sdpa_attention), (8, 2, 2, f32, math_attention),
             (8, 2, 4, f32, sdpa_attention), (8, 1, 2, f32, sdpa_attention),
             (8, 2, 2, bf16, sdpa_attention)]
    for hq, hkv, groups, dtype, core in cases:
        q, k, v, dy = _inputs(comm, hq, hkv, dtype, hq * 100 + hkv * 10 + groups)
        runs = []
        for overlap in (True, False):
            layer = UlyssesAttention(core, comm, overlap=overlap)
            layer = HeadGroups(layer, groups) if groups > 1 else layer
            runs.append(_grads(comm, layer, (q, k, v), dy))
            with torch.no_grad():
                runs[-1][0].append(layer(q, k, v, 0.0))
        (a, bytes_a), (b, bytes_b) = runs
        out[(hq, hkv, groups, str(dtype), core.__name__)] = (_same(a, b), bytes_a == bytes_b)
    return out


def nested_checkpoint_case(comm) -> tuple:
    """Head groups inside a block's checkpoint (full recomputation: early stop off, as
    parallelize.py sets it): overlapped == blocking, and == without the block's."""
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop
    from megaulysses.model.attention import sdpa_attention
    from megaulysses.parallel.head_groups import HeadGroups
    from megaulysses.parallel.ulysses import UlyssesAttention
    q, k, v, dy = _inputs(comm, 8, 8, torch.float32, 7)
    runs = []
    for overlap in (True, False):
        layer = HeadGroups(UlyssesAttention(sdpa_attention, comm, overlap=overlap), 2)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with set_checkpoint_early_stop(False):
            y = checkpoint(lambda *t, f=layer: f(*(x * 1.0 for x in t), 0.0), *leaves,
                           use_reentrant=False)
        runs.append([y.detach()] + list(torch.autograd.grad(y, leaves, dy)))
    plain = HeadGroups(UlyssesAttention(sdpa_attention, comm), 2)
    plain = _grads(comm, plain, (q, k, v), dy)[0]
    return _same(runs[0], runs[1]), _same(runs[0], plain)


def fpdt_cases(comm) -> dict:
    """{case: (outputs and grads equal, bytes equal)} for chunked Ulysses (FPDT)."""
    from megaulysses.model.attention import AttentionMask
    from megaulysses.parallel.fpdt import ChunkedUlyssesAttention
    out = {}
    # (hq, hkv, chunks, window, offload, dtype): MHA; GQA; a window (the block kernel);
    # offloaded; bf16
    for hq, hkv, chunks, window, offload, dtype in (
            (4, 4, 2, None, False, torch.float32), (4, 2, 4, None, False, torch.float32),
            (4, 2, 2, 6, False, torch.float32), (4, 4, 4, None, True, torch.float32),
            (4, 2, 2, None, False, torch.bfloat16)):
        q, k, v, dy = _inputs(comm, hq, hkv, dtype, hq + hkv + chunks)
        runs = [_grads(comm, ChunkedUlyssesAttention(comm, chunks, offload, overlap=o),
                       (q, k, v), dy, AttentionMask(window=window)) for o in (True, False)]
        (a, bytes_a), (b, bytes_b) = runs
        out[(hq, hkv, chunks, window, offload, str(dtype))] = (_same(a, b),
                                                               bytes_a == bytes_b)
    return out


class _BackwardMark(torch.autograd.Function):
    """Identity; its backward, the first of the core's, marks the core backward's start."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        with record_function("test::core_backward"):
            pass
        return grad


def marked_core(q, k, v, dropout_p=0.0, mask=None):
    """The math core in a profiler range `test::core`, its backward's start marked."""
    from megaulysses.model.attention import math_attention
    with record_function("test::core"):
        out = math_attention(q, k, v, dropout_p, mask)
    return _BackwardMark.apply(out)


def _moments(events, name: str, end: bool = False) -> list:
    return sorted(e.time_range.end if end else e.time_range.start
                  for e in events if e.name == name)


def trace_counts(prof) -> dict:
    """At each core start (forward, recomputation, backward): (exchanges issued and not
    waited for, issued and not finished), and the numbers of issues and of gloo records."""
    ev = prof.events()
    issued = _moments(ev, "c10d::alltoall_base_")
    waited = _moments(ev, "megaulysses::all_to_all_wait", end=True)
    finished = _moments(ev, "gloo:all_to_all", end=True)
    starts = _moments(ev, "test::core") + _moments(ev, "test::core_backward")

    def before(moments, t):
        return sum(1 for m in moments if m < t)

    return {"at_core": [(before(issued, t) - before(waited, t),
                         before(issued, t) - before(finished, t)) for t in starts],
            "issued": len(issued), "records": len(finished)}


def profiled(comm) -> dict:
    """A head-group layer (G = 2, MHA) forward and backward under the profiler, twice,
    overlapped and blocking: `trace_counts` of each."""
    from torch.profiler import ProfilerActivity, profile
    from megaulysses.parallel.head_groups import HeadGroups
    from megaulysses.parallel.ulysses import UlyssesAttention, slice_sequence
    g = torch.Generator().manual_seed(3)
    q, k, v, dy = (slice_sequence(torch.randn(1, 512, 8, 32, generator=g), comm)
                   for _ in range(4))
    out = {}
    for overlap in (True, False):
        layer = HeadGroups(UlyssesAttention(marked_core, comm, overlap=overlap), 2)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(2):
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                torch.autograd.grad(layer(*leaves, 0.0), leaves, dy)
        out[overlap] = trace_counts(prof)
    return out


def checks(rank, world) -> dict:
    from megaulysses.parallel.comm import Comm
    from megaulysses.parallel.dims import ParallelDims, build_mesh
    comm = Comm(build_mesh(ParallelDims(dp=1, tp=1, pp=1, sp=world), "cpu"))
    return {"ulysses": ulysses_cases(comm), "nested": nested_checkpoint_case(comm),
            "fpdt": fpdt_cases(comm), "profiled": profiled(comm)}


@pytest.fixture(scope="module")
def results():
    return run_ranks(checks, 2)


def test_overlapped_equals_blocking_bit_for_bit(results):
    for result in results:
        for case, (same, same_bytes) in {**result["ulysses"], **result["fpdt"]}.items():
            assert same and same_bytes, (case, same, same_bytes)
        assert result["nested"] == (True, True)


def test_profiler_shows_the_exchange_in_flight_while_attention_runs(results):
    for result in results:
        overlapped, blocking = result["profiled"][True], result["profiled"][False]
        for counts in (overlapped, blocking):
            # every exchange traced: issued on the main thread, run by gloo's worker
            assert counts["issued"] == counts["records"] > 0, counts
        # 2 steps x 2 groups x (forward, recomputation, backward)
        assert len(overlapped["at_core"]) == len(blocking["at_core"]) == 12
        # overlapped, every core starts with an exchange issued and not yet waited for;
        # blocking, never
        assert all(pending >= 1 for pending, _ in overlapped["at_core"]), overlapped
        assert all(pending == 0 for pending, _ in blocking["at_core"]), blocking
        # and gloo was still running one of them when a core started
        assert any(flying >= 1 for _, flying in overlapped["at_core"]), overlapped
