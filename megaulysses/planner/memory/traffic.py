"""The memory plan's communication: bytes this rank sends per iteration.

Communication per iteration, bytes this rank sends per (group, kind), comm.py's conventions
(the group is the mesh dim: sp, cp, tp, dp_sp, pp): Ulysses
`ulysses_bytes_per_layer` over the ring rank's S/C positions per layer and micro-batch
forward, again backward, and again for layers full recomputation reruns; the ring
`ring_bytes_per_layer` (kind "ring": k, v forward, (C-1)*2*b*(S/C)*(kv/sp)*d*e; backward
the same again plus the fp32 gradient accumulators, C*2*b*(S/C)*(kv/sp)*d*4) per layer and
micro-batch, its forward again for layers full recomputation reruns and, the core being
the ring, under selective recomputation for every layer; tensor parallel: the sublayer
outputs all-reduced (e bytes) or under Megatron-SP reduce-scattered with the fp32 normed
inputs all-gathered (`megatron_sp_bytes_per_layer`), backward the same kinds swapped
(input gradients fp32), recomputation repeating the forward ones but the group's last MLP
output (the checkpoint stops at fc2's input; with a tiled MLP it reruns whole, while each
chunk's own recompute stops at fc2's input), a tiled MLP under Megatron-SP gathering its
input again; the embedding's and the vocab-parallel loss's collectives, the q/k norms' gradients
(--qk-layernorm); ZeRO over N =
dp*cp*sp (tests/parallel/test_zero.py): stage 0 all-reduce of P, stage 1 reduce-scatter and
all-gather of N padded pieces, stage 2 m reduce-scatters and one all-gather, stage 3 m
reduce-scatters and m (root + 2 x blocks) all-gathers (under pp one each); pipeline:
activations forward and gradients backward per micro-batch and local stage, the tied
embedding's gradient between the first and last stage; a few fp64 scalars (token count,
loss, grad norm).
"""

from __future__ import annotations

from collections import defaultdict

from megaulysses.config import Config
from megaulysses.parallel.dims import CP, DP_SP, PP, SP, TP, ParallelDims
from megaulysses.parallel.head_groups import regroup_bytes_per_layer
from megaulysses.parallel.ring import ring_bytes_per_layer
from megaulysses.parallel.tensor_plan import megatron_sp_bytes_per_layer
from megaulysses.parallel.ulysses import ulysses_bytes_per_layer
from megaulysses.planner.memory.activations import _Activations
from megaulysses.planner.memory.shapes import F32, _RankLayout, _Shape, _zero_ranks
from megaulysses.planner.memory.states import _States


def comm_bytes(cfg: Config, dims: ParallelDims, s: _Shape, st: _States, acts: _Activations,
               rank: _RankLayout) -> dict:
    """Bytes this rank sends per iteration, {(group, kind): bytes} (the module doc's list;
    the group is the mesh dim the collective runs over, as comm.CommStats counts it)."""
    out: defaultdict[tuple[str, str], float] = defaultdict(float)
    m, layers = rank.m, rank.layers
    forwards = m * (layers + acts.rerun[0])  # layer forwards per iteration
    if s.sp > 1:  # over the ring rank's S/C positions
        a2a = ulysses_bytes_per_layer(s.b, s.Sc, s.hq, s.hkv, s.d, s.sp, s.e)
        out[(SP, "all_to_all")] += a2a * (forwards + m * layers)
        # --attention-head-groups: each group's recomputation sends its q, k, v again
        out[(SP, "all_to_all")] += m * layers * regroup_bytes_per_layer(
            s.b, s.Sc, s.hq, s.hkv, s.d, s.sp, s.e, s.groups)
    if s.cp > 1:  # the ring: keys and values forward, again with their gradients backward;
        # its forward reruns with the layer (full) or the core (selective) recomputed
        fwd, bwd = ring_bytes_per_layer(s.b, s.S, s.kv // s.sp, s.d, s.cp, s.e)
        rings = forwards + (m * layers if acts.recompute == "selective" or s.groups > 1
                            else 0)  # the core recomputed: selective, or head groups
        out[(CP, "ring")] += fwd * rings + bwd * m * layers
    if s.tp > 1:
        # Sublayer outputs reduced beyond two per layer forward: recompute.py's early stop
        # skips each group's last fc2 (with a tiled MLP it is off: the group reruns whole)
        extra = -acts.rerun[1] if cfg.memory.tiled_mlp_chunks == 1 and s.groups == 1 else 0
        _tensor_parallel(out, cfg, s, rank, forwards, m * extra,
                         m if st.fsdp_per_block else 1)
    _zero(out, st, m)
    if dims.pp > 1:
        _pipeline_p2p(out, cfg, s, st, rank)
    _scalars(out, dims)
    return {key: int(v) for key, v in out.items() if v}


def bytes_by_kind(by_group: dict) -> dict:
    """{(group, kind): bytes} summed over groups: {kind: bytes}."""
    out: defaultdict[str, int] = defaultdict(int)
    for (_, kind), n in by_group.items():
        out[kind] += n
    return dict(out)


def _tensor_parallel(out: dict, cfg: Config, s: _Shape, rank: _RankLayout, forwards: int,
                     extra: int, norm_syncs: int):
    """Forward: the sublayer outputs (e bytes) all-reduced, or under Megatron-SP
    reduce-scattered with the fp32 normed inputs all-gathered; backward the same kinds
    swapped (input gradients fp32). `extra`: sublayer outputs reduced beyond two per layer
    forward (negative: recomputations that stop before the last one). Plus the
    vocab-parallel embedding's and loss's collectives, and under Megatron-SP the norm
    weights' partial gradients, with --qk-layernorm the q/k norms' always (`norm_syncs`
    times). All over the tp group."""
    m, layers, frac = rank.m, rank.layers, (s.tp - 1) / s.tp
    full = s.T * s.h  # elements of [b, s/sp, h]
    outputs = 2 * forwards + extra  # sublayer outputs reduced in forward
    ag, rs, ar = (TP, "all_gather"), (TP, "reduce_scatter"), (TP, "all_reduce")
    if s.mega_sp:  # per layer forward, two of each: [b, s/sp, h] gathered, reduce-scattered
        fp32 = megatron_sp_bytes_per_layer(s.b, s.T // s.b, s.h, s.tp, F32)
        half = megatron_sp_bytes_per_layer(s.b, s.T // s.b, s.h, s.tp, s.e)
        out[ag] += fp32["all_gather"] * forwards + half["all_gather"] * m * layers
        out[rs] += half["reduce_scatter"] // 2 * outputs + fp32["reduce_scatter"] * m * layers
        if cfg.memory.tiled_mlp_chunks > 1:  # a tile's recompute gathers its input again
            out[ag] += fp32["all_gather"] // 2 * m * layers
        norms = 2 * layers + rank.last
        out[ar] += 2 * F32 * s.h * frac * norms * norm_syncs
    else:
        out[ar] += 2 * full * frac * (s.e * outputs + 2 * F32 * m * layers)
    if s.qk_norm:  # q_norm and k_norm: replicated, partial gradients of this rank's heads
        out[ar] += 2 * F32 * s.d * (2 if s.layernorm else 1) * frac * 2 * layers * norm_syncs
    if rank.first:
        out[ar] += 2 * s.e * full * frac * m  # the lookup's partial sums (compute dtype)
        if s.mega_sp:
            out[ag] += s.r * full * frac * m  # its gradient, made whole
    if rank.last:
        out[ar] += 2 * 3 * F32 * s.T * frac * m  # row max, sum of exps, picked
        if s.mega_sp:  # the loss gathers its input, backward reduce-scatters the gradient
            out[ag] += s.e * full * frac * m
            out[rs] += s.e * full * frac * m
        else:
            out[ar] += 2 * s.e * full * frac * m  # the input gradient


def _zero(out: dict, st: _States, m: int):
    """Gradients over dp x cp x sp: N ranks, each collective moving (N-1)/N of its
    buffer."""
    if st.n == 1:
        return
    frac, whole = (st.n - 1) / st.n, st.n * st.piece  # padded: what ZeRO moves
    reduce, gather = st.reduce_e / F32, st.gather_e / F32
    ar, ag, rs = (DP_SP, "all_reduce"), (DP_SP, "all_gather"), (DP_SP, "reduce_scatter")
    if st.stage == 0:
        out[ar] += 2 * st.local * reduce * frac
    elif st.stage == 1:  # the distributed optimizer gathers 16-bit weights
        out[rs] += whole * reduce * frac
        out[ag] += whole * (gather if st.dist_opt else 1) * frac
    elif not st.fsdp_per_block or st.stage == 2:
        out[rs] += (m if st.fsdp_per_block else 1) * whole * reduce * frac
        out[ag] += whole * gather * frac
    else:  # stage 3: the root once and each block twice (forward, backward) per micro-batch
        root = st.n * st.root_piece
        out[rs] += m * whole * reduce * frac
        out[ag] += m * (root + 2 * (whole - root)) * gather * frac


def _pipeline_p2p(out: dict, cfg: Config, s: _Shape, st: _States, rank: _RankLayout):
    """Each local stage sends its micro-batches' outputs forward (but the last stage) and
    input gradients backward (but the first); the tied embedding's gradient (ZeRO: its
    rows) goes between the first and the last stage."""
    sends = 2 * rank.chunks - rank.first - rank.last
    out[(PP, "p2p")] += sends * rank.m * s.r * s.Tr * s.h  # the residual stream
    tied = not cfg.model.untie_embeddings_and_output_weights
    if tied and rank.first != rank.last:
        rows = s.V if st.stage == 0 else -(-s.V // st.n)
        out[(PP, "p2p")] += F32 * rows * s.h


def _scalars(out: dict, dims: ParallelDims):
    """The token count, the loss and the gradient norm: a few fp64 numbers."""
    ring = lambda p, nbytes: 2 * nbytes * (p - 1) / p  # noqa: E731
    out[(DP_SP, "all_reduce")] += 3 * ring(_zero_ranks(dims), 8)
    out[(PP, "all_reduce")] += 2 * ring(dims.pp, 8)
    out[(TP, "all_reduce")] += ring(dims.tp, 16)
