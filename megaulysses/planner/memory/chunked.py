"""The memory plan of --ds-sequence-parallel-fpdt (parallel/fpdt.py): Ulysses attention in C
chunks of the sequence, on the block kernel, per (query chunk, key chunk) pair.

Notation of shapes.py; a chunk holds 1/C of every whole-sequence tensor of the core (Q/C
elements of q, K/C of k), and one pair runs `partial_forward` / `partial_backward` of the
block kernel over S/C query positions and S/C keys (`fpdt_pair`).
    kept            the chunks of q, k, v, out (q's dtype) and the fp32 lse: e*(2Q + 2K)
                    + lse, as SDPA keeps; with --ds-sequence-parallel-fpdt-offloading on
                    the host (none on the device)
    forward         the handed-over local q, k, v (held by the call until it returns) and
                    the local output it fills, e*(2Q + 2K); one pair: q_i, the running fp32
                    out and the pair's fp32 partial, k_j, v_j fetched (offloading), the
                    block kernel's grouped copies and a block of scores; q_{i+1} in flight
                    (parallel/a2a_overlap.py: sent and received, 2e*Q/C; at sp = 1 no
                    exchange, so none, and q_i a copy only for b > 1)
    backward        dout and dq (local, whole: dq filled chunk by chunk), e*2Q; the fp32
                    key/value gradient sums, 4*2K (on the host when offloading); one query
                    chunk: dout_i, its fp32 dq_i, q_i, out_i fetched (offloading) and a pair's
                    partial_backward (the masked kernel's working set over 1/C), dout_{i+1}
                    in flight (2e*Q/C; none at sp = 1); at the end dk, dv in q's dtype,
                    e*2K, with one sum's chunk fetched
    host            offloading: what a layer keeps, for each layer whose backward is pending
                    (every layer of the stage without recomputation, a recomputed group's
                    under full, one under selective)
    host link       offloading, per layer forward: the kept chunks out once, every k_j, v_j
                    back C times; backward: q_i, out_i, lse_i back once, every k_j, v_j
                    back C times, each sum chunk down and up C times and back once
"""

from __future__ import annotations

from dataclasses import replace

from megaulysses.planner.memory.shapes import F32, _Shape


def fpdt_pair(s: _Shape) -> _Shape:
    """One (query chunk, key chunk) pair as the masked block kernel's shape: 1/C of the
    positions; a query block attends at most a chunk's keys (fewer under a window or a
    sparse layout: the static mask's bound, `keys`)."""
    C = s.chunks
    return replace(s, T=s.T // C, Tr=s.Tr // C, S=s.S // C, keys=min(s.keys or s.S, s.S // C),
                   kernel="masked", chunks=0)


def fpdt_kept(s: _Shape) -> int:
    """What the core keeps for backward, wherever it is (device or host)."""
    return s.e * (2 * s.Q + 2 * s.K) + s.lse


def fpdt_terms(s: _Shape) -> dict:
    if s.fpdt_host:
        return {}
    return {"core q,k,v,out (chunks)": s.e * (2 * s.Q + 2 * s.K), "core logsumexp": s.lse}


def fpdt_forward(s: _Shape, block_forward: int) -> int:
    """`block_forward`: the block kernel's forward working set over one pair (cores.py's,
    of `fpdt_pair(s)`)."""
    p, e = fpdt_pair(s), s.e
    fetched = 2 * e * p.K if s.fpdt_host else 0  # k_j, v_j copies
    if s.fused:  # the pair's fp32 out (its diagonal's, widened) and lse; a run's partial
        pair = F32 * p.Q + p.lse + (e + F32) * p.Q // s.sp
    else:  # the running out and the pair's partial, fp32, and the block kernel's set
        pair = 2 * F32 * p.Q + block_forward
    return e * (2 * s.Q + 2 * s.K) + _received(s) + fetched + pair


def _received(s: _Shape) -> int:
    """Query chunk q_i as the exchange hands it over, and q_{i+1} in flight: under Ulysses
    q_i and q_{i+1}'s send and receive buffers (3e*Q/C); at sp = 1 no exchange
    (parallel/fpdt_chunks.py): q_i's contiguous copy, none for one sample (its slice
    already is contiguous)."""
    q = s.e * fpdt_pair(s).Q
    if s.sp > 1:
        return 3 * q
    return q if s.b > 1 else 0


def fpdt_backward(s: _Shape, block_backward: int, scratch: int = 0) -> int:
    """`block_backward`: the block kernel's backward working set over one pair (cores.py's,
    of `fpdt_pair(s)`); `scratch`: the fused kernel's own buffers for one call on CUDA
    (cores.py's `kernel_scratch` of the pair: the diagonal runs batched, or the whole pair
    unmasked, the largest call)."""
    p, e = fpdt_pair(s), s.e
    sums = 0 if s.fpdt_host else F32 * 2 * s.K
    fetched = e * (2 * p.Q + 2 * p.K) + p.lse if s.fpdt_host else 0  # q_i, out_i, k_j, v_j
    if s.fused:  # dout_i; the pair's fp32 dq, dk, dv and the diagonal's shares (q's dtype);
        # on CUDA the kernel's own buffers for the pair's largest call (`scratch`)
        pair = e * p.Q + (F32 + e) * (p.Q + 2 * p.K) + scratch
    else:  # partial_backward (dout_i is its input, counted there)
        pair = block_backward
    # dq_i's fp32 sum; with offloading a sum's chunk fetched to add the pair's share
    ahead = 2 * e * p.Q if s.sp > 1 else 0  # dout_{i+1} in flight (sp = 1: no exchange)
    step = F32 * p.Q + fetched + pair + (F32 * p.K if s.fpdt_host else 0) + ahead
    end = e * (2 * s.Q + 2 * s.K) + (F32 + e) * p.K  # dout, dq, dk, dv; a sum's chunk
    return max(e * 2 * s.Q + sums + step, end + sums)


def fpdt_host_layers(kept_layers: int, recompute, group_layers: int) -> int:
    """Layers whose chunks are on the host at once (offloading)."""
    if recompute == "full":
        return group_layers
    return 1 if recompute == "selective" else kept_layers


def fpdt_link(s: _Shape) -> int:
    """Host-link bytes of one layer's forward and backward (offloading)."""
    if not s.fpdt_host:
        return 0
    C, e, kv = s.chunks, s.e, 2 * s.e * s.K
    forward = fpdt_kept(s) + C * kv
    backward = e * 2 * s.Q + s.lse + C * kv + F32 * 2 * s.K * (2 * C + 1)
    return forward + backward
