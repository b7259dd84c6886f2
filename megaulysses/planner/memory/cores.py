"""The memory plan's attention cores: what each kernel keeps for backward (`_core_terms`)
and its forward and backward working sets beyond that.

The block kernel's and the ring's working sets (measured, tests/parallel/test_memory_plan.py;
"a block": one query block's fp32 scores over the most keys it attends in one call, by the
static mask -- causal: all S; window w: (ceil((w-1)/B) + 1)*B for blocks of B; the ring per
step, from the zigzag chunks' positions (`_ring_keys`): ring rank c < C-1 meets a later
rank's S/C keys, all attended by its late chunk, the last rank S/(2C) per later step
(`plan_memory(cp_rank=...)`); a sparse layout: its most attended blocks -- per sample with
packed documents. One block is alive at a time (each is dropped before the next): forward
its scores, backward its P and dS; under autocast also half a block, a half-dtype matmul
product or cast beside them; plus the block's element mask, a byte per score):
    masked backward      dout; q scaled, k, v grouped (copies), dout grouped under GQA,
                         e*(Q + 2K (+ Q)); fp32 dq, dk, dv, 4*(Q + 2K), accumulated in
                         their returned layout; a block; row statistics
    masked forward       q scaled, k, v grouped, a block; the output is written block by
                         block into the kept one (q's dtype, [b, s, hq, d])
    ring backward        the largest of its first step, a later one and a later one with
                         keys arriving: dout (its fp32 copy under autocast); the step's
                         partial_backward (q scaled, k, v grouped, dout grouped in fp32
                         under GQA, its fp32 dq, dk, dv shares, a block); the keys and
                         values arriving for the next step (all steps but the last); later
                         steps also dq's accumulator, the step's received keys and values,
                         the last step's dk, dv shares in flight (sent as they are) and the
                         accumulators arriving, 4*4K
    ring forward         the largest of the same three steps: partial_forward's grouped
                         copies and a block, the running fp32 out (beyond the kept one,
                         e*Q, cast at the end), the keys and values arriving; later steps
                         also those received and the step's partial out and lse, 4*Q (merged
                         into the running ones in place, no temporaries of out's size)
The ring on the fused kernel (a plain causal mask; measured exactly, per ring rank: its
later steps take all query rows x half the keys, or half the rows x all keys):
    ring backward        the largest later step at the kernel's return: dout, dq's fp32
                         accumulator, the received keys and values and those arriving (all
                         steps but the last), the fp32 dk, dv accumulators in flight and
                         arriving, 4*4K, and the kernel's shares in q's dtype for its rows and
                         keys (on CUDA also the kernel's own buffers for them, below)
On CUDA each fused kernel's backward (SDPA's flash or memory-efficient kernel, the block
backend's fused kernel, a fused ring step or FPDT pair) allocates buffers of its own while
it runs, no tensor autograd sees (`attention_backward_scratch`, per call: flash's fp32 dq
accumulator, 2x q's 16-bit bytes, and under GQA dk, dv over all query heads; the efficient
kernel's fp32 grad-q accumulator): counted in the core's backward (`kernel_scratch`).
    ring forward         the largest later step at its merge: the running fp32 out beyond
                         the kept one, the received keys and values and those arriving, the
                         step's partial out (q's dtype; and its fp32 copy under autocast) and
                         lse for its rows, and the merge's four lse-sized temporaries
--attention-head-groups G (parallel/head_groups.py; each term below from one group's core,
hq/G heads, kv heads grouped alike or, fewer than G a rank, one a rank; measured):
    kept                 the groups' inputs, the rank's q, k, v (e*(Q + 2K)), and the
                         out-projection's input (the groups' outputs stacked, e*Q)
    core backward        the largest group: recomputed (its q, k, v and what its core saves)
                         and its core's backward, beside the output's gradient (e*Q, until
                         the last group takes its share) or the input gradients of the
                         groups done ((G-1)/G of e*(Q + 2K); k, v exchanged whole: 2eK).
                         Not added: under Ulysses the group before's input gradients in
                         flight (parallel/a2a_overlap.py), their whole-sequence send copy,
                         e*(Q + 2K)/G (k, v whole: e*Q/G), beside every group's backward but
                         the first's (whose output-gradient exchanges replace the output's
                         gradient, as much). Measured on one layer it adds that much to the
                         later groups' backward; in the trainer's head-groups grid the first
                         group's backward is the larger by more (the measured peak is the
                         same with and without the overlap, the plan +8% above it either
                         way), so counting it would only widen that gap
    core forward         (a layer recomputed) the earlier groups' outputs, (G-1)/G of e*Q,
                         the group's q, k, v, what its core makes, its working set; under
                         Ulysses the exchanges in flight: the next group's q, k, v, sent
                         and received (2e*(Q + 2K)/G; k, v whole: 2e*Q/G), and the group
                         before's output, whole (e*Q/G)
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from megaulysses.model.attention.block_causal import BLOCK_ROWS
from megaulysses.planner.memory.chunked import (fpdt_backward, fpdt_forward, fpdt_pair,
                                                 fpdt_terms)
from megaulysses.planner.memory.shapes import F32, _Shape

if TYPE_CHECKING:
    import torch


def _core_terms(s: _Shape) -> dict:
    if s.groups > 1:
        return _grouped_terms(s)
    if s.kernel == "fpdt":
        return fpdt_terms(s)
    qkv_out = s.T * (2 * s.hq + 2 * s.kv) * s.d
    square = F32 * s.b * s.core_heads * s.S * s.S
    if s.kernel == "block":
        return {"core q,k,v,out": F32 * qkv_out, "core probabilities": F32 * _probs(s)}
    if s.kernel == "math":
        return {"core q,k,v,out": F32 * qkv_out, "core probabilities": square}
    if s.kernel == "sdpa-math":
        return {"core q,k,v": s.e * s.T * (s.hq + 2 * s.kv) * s.d,
                "core probabilities": 3 * square}
    return {"core q,k,v,out": s.e * qkv_out, "core logsumexp": s.lse}  # sdpa, masked, ring


def _probs(s: _Shape) -> int:
    """Elements of the block kernel's causal probabilities: per (sample, head) each query
    block's rows times the keys up to its end."""
    blocks = ((i, min(i + BLOCK_ROWS, s.S)) for i in range(0, s.S, BLOCK_ROWS))
    return s.b * s.core_heads * sum((end - i) * end for i, end in blocks)


def _core_backward(s: _Shape) -> int:
    """The core's backward working set beyond what it keeps: dq, dk, dv, dout (and the
    block kernel's two gradient blocks of 64 query rows; the masked kernel's and the ring's
    below)."""
    if s.groups > 1:
        return _grouped_backward(s)
    if s.kernel == "fpdt":
        pair = fpdt_pair(s)
        return fpdt_backward(s, 0 if s.fused else _core_backward(pair),
                             kernel_scratch(pair) if s.fused else 0)
    qkv = s.T * (2 * s.hq + 2 * s.kv) * s.d
    if s.kernel == "block":
        return F32 * (qkv + 2 * s.b * s.core_heads * BLOCK_ROWS * s.S)
    if s.kernel == "masked":
        return _masked_backward(s)
    if s.kernel == "ring":
        return _ring_fused_backward(s) if s.fused else _ring_backward(s)
    return s.e * qkv + kernel_scratch(s)  # sdpa, fused: one call over the whole sequence


def attention_backward_scratch(b: int, sq: int, sk: int, hq: int, hkv: int, d: int,
                               e: int) -> int:
    """Bytes CUDA's fused attention backward allocates inside its kernel for one call (q
    [b, sq, hq, d], k and v [b, sk, hkv, d], e bytes an element): at::empty in the
    caching allocator while the kernel runs, no tensor autograd (or a fake rank) sees.
    Flash (16-bit, head dim up to 256; torch's copy of flash-attn 2's `mha_bwd`, the
    flash_attn package's alike): its fp32 dq accumulator [b, sq to 128, hq, d to 32 (past
    192: 256)], always (torch's copy loops over key blocks for any length), softmax_d,
    fp32 [b, hq, sq to 128], and under GQA dk, dv over all hq heads ([b, sk, hq, d], q's
    dtype) before they are summed to hkv. Memory-efficient (fp32; head dims flash does
    not take): split keys are on from sm70 whatever the dtype, so kNeedsAccumGradQ and its
    workspace is an fp32 grad-q accumulator per query tile, about q's elements in fp32
    (tiles' rounding and 16-byte lock words not counted); no GQA (k, v come repeated).
    Its fp32 delta's product temporary (fp32 inputs) is freed before the workspace is
    made, and is no larger."""
    if e == F32 or d > 256:
        return F32 * b * sq * hq * d
    rows = -(-sq // 128) * 128
    dr = 256 if d > 192 else -(-d // 32) * 32
    own = F32 * b * rows * hq * dr + F32 * b * hq * rows  # dq_accum, softmax_d
    return own + (2 * e * b * sk * hq * d if hq != hkv else 0)


def unfaked_attention_backward(b: int, s: int, hq: int, hkv: int, d: int,
                               dtype: torch.dtype) -> int:
    """`attention_backward_scratch` of a self-attention call on [b, s, hq, d] queries of
    torch dtype `dtype` (training/fake_cuda.py's table: what its fake rank cannot show)."""
    return attention_backward_scratch(b, s, s, hq, hkv, d, dtype.itemsize)


def core_scratch(s: _Shape) -> int:
    """The largest `kernel_scratch` one call of the core's backward allocates (a head
    group's, an FPDT pair's, else the whole core's; 0 off CUDA or off the fused kernels):
    the plan's one term no rank measures (training/fake_cuda.py)."""
    if s.groups > 1:
        return core_scratch(_group(s))
    if s.kernel == "fpdt":
        return kernel_scratch(fpdt_pair(s)) if s.fused else 0
    if s.kernel in ("sdpa", "fused") or (s.kernel == "ring" and s.fused):
        return kernel_scratch(s)
    return 0


def kernel_scratch(s: _Shape, rows: float = 1.0, keys: float = 1.0) -> int:
    """`attention_backward_scratch` of one call of the core's fused kernel on CUDA over
    `rows` of its query positions and `keys` of its keys (a ring step's or an FPDT pair's
    share; whole: SDPA, the block backend's fused kernel); its heads: hq/sp queries,
    kv/sp keys and values. None elsewhere: the CPU kernels' buffers are tensors the plan
    measured with them (tests/parallel/test_memory_plan.py). CUDA: the plan's 1-byte
    dropout masks (shapes.py sets `mask_e` 1 for CUDA alone)."""
    if s.mask_e != 1:
        return 0
    return attention_backward_scratch(s.b, int(rows * s.Sc), int(keys * s.Sc), s.core_heads,
                                      max(1, s.kv // s.sp), s.d, s.e)


def _masked_backward(s: _Shape) -> int:
    """model/attention/block.py's partial_backward over the whole sequence (measured): dout;
    q grouped and scaled, k, v grouped (copies); dout grouped (a copy with GQA); fp32 dq,
    dk, dv; one query block's P and dS (`_Shape.scores`); row statistics and masks."""
    e = s.e
    grouped = e * s.Q + 2 * e * s.K + (e * s.Q if s.rep > 1 else 0)  # q, k, v, dout
    grads = F32 * (s.Q + 2 * s.K)
    return e * s.Q + grouped + grads + _block_set(s, s.keys)


def _block_set(s: _Shape, keys: int, backward: bool = True) -> int:
    """One query block of `keys` keys (`_Shape.scores`) and the kernels' small change
    (measured): backward delta and the lse made +inf where it is -inf (with GQA also
    delta's grouped copy), the block's element mask, a byte per score of its block * rep
    rows by its keys, and a block's rows of a gradient, fp32; forward the larger of the
    mask and its negation (autocast: the mask) and a block's output."""
    out_rows = F32 * (1 if s.documents else s.b) * s.core_heads * s.block * s.d
    if not backward:  # at the scores' masking (fp32) or cast (autocast), or at the output
        return s.scores(keys, False) + max(
            (2 if s.e == F32 else 1) * s.block * s.rep * keys, out_rows,
            _dropout_set(s, keys, False))
    return (s.scores(keys) + (2 + (1 if s.rep > 1 else 0)) * s.lse
            + s.block * s.rep * keys + out_rows + _dropout_set(s, keys, True))


def _dropout_set(s: _Shape, keys: int, backward: bool) -> int:
    """Attention dropout's positional mask for one query block (model/attention/dropout.py;
    nothing of it is kept: backward hashes it again): while it is hashed, an int64 word
    per score and its shifted copy, 16 bytes a score, beside the block's scores (forward)
    or its P (backward: 12 more than the P and dS counted, which come after)."""
    if not s.attn_dropout:
        return 0
    scores = (1 if s.documents else s.b) * s.core_heads * s.block * keys
    return (12 if backward else 16) * scores


def _ring_backward(s: _Shape) -> int:
    """parallel/ring.py's backward (measured), the largest of its first step and its later
    ones (with and without keys arriving): dout (and its fp32 copy under autocast); the
    step's partial_backward: q scaled, k, v grouped, dout grouped (fp32, with GQA), its
    fp32 dq, dk, dv shares, one query block's P and dS; the keys and values arriving for
    the next step (all steps but the last). Later steps also: dq's accumulator, the step's
    received keys and values, the last step's dk, dv in flight (sent as they are, held
    until the next step's wait) and the accumulators arriving, 4*4K."""
    e, kv = s.e, 2 * s.e * s.K
    common = (e * s.Q + (F32 * s.Q if e != F32 else 0)  # dout, fp32
              + e * s.Q + kv + (F32 * s.Q if s.rep > 1 else 0)  # grouped
              + F32 * (s.Q + 2 * s.K))  # the step's shares
    later = common + F32 * s.Q + kv + 4 * F32 * s.K  # dq's sum, received, in flight
    return max(common + kv + _block_set(s, s.keys),
               later + _block_set(s, s.keys_later),
               later + kv + _block_set(s, s.keys_arriving) if s.keys_arriving else 0)


def _core_forward(s: _Shape) -> int:
    """The core's forward working set beyond what it keeps (0 where small): the masked
    kernel's q scaled, k, v grouped, one query block's scores (`_Shape.scores`), its output
    written in place into the kept one; the ring at a step's scores: partial_forward's
    grouped copies, the running fp32 out beyond the kept one (autocast: cast at the end),
    the keys and values arriving (all steps but the last) and, later steps, those received
    and the step's partial out and lse (merged into the running ones in place)."""
    if s.groups > 1:
        return _grouped_forward(s)
    if s.kernel == "fpdt":
        return fpdt_forward(s, 0 if s.fused else _core_forward(fpdt_pair(s)))
    e, kv = s.e, 2 * s.e * s.K
    grouped = e * s.Q + kv  # q scaled, k, v
    if s.kernel == "masked":
        return grouped + _block_set(s, s.keys, backward=False)
    if s.kernel != "ring":
        return 0
    if s.fused:
        return _ring_fused_forward(s)
    common = grouped + (F32 - e) * s.Q
    later = common + kv + F32 * s.Q + s.lse  # received, the step's partial
    return max(common + kv + _block_set(s, s.keys, False),
               later + _block_set(s, s.keys_later, False),
               later + kv + _block_set(s, s.keys_arriving, False) if s.keys_arriving else 0)


def _fused_ring_steps(s: _Shape) -> list[tuple[float, float, bool]]:
    """The fused ring's later steps t = 1..C-1 on ring rank s.cp_rank (parallel/ring.py's
    `fused_step`): (share of the query rows, share of the keys, the next keys arriving):
    an earlier rank's keys: all rows x its early chunk; a later rank's: the late chunk x
    all its keys."""
    c, C = s.cp_rank, s.cp
    return [((1.0, 0.5) if (c - t) % C < c else (0.5, 1.0)) + (t < C - 1,)
            for t in range(1, C)]


def _ring_fused_backward(s: _Shape) -> int:
    """parallel/ring.py's backward on the fused kernel (measured), the largest of its later
    steps at the kernel's return (step 0 holds less): dout; dq's fp32 accumulator; the
    step's received keys and values and those arriving for the next step (all but the
    last); the last step's fp32 dk, dv accumulators in flight and those arriving, 4*4K;
    the kernel's dq, dk, dv shares in q's dtype, for its rows and keys only; on CUDA the
    kernel's own buffers for its rows and keys (`kernel_scratch`). Step 0 (all rows, the
    rank's own keys) has the larger scratch but holds no dq sum, received keys or dk, dv
    sums: less by 4Q + 16K - eQ - eK at least.)"""
    e, kv = s.e, 2 * s.e * s.K
    held = e * s.Q + F32 * s.Q + kv + 4 * F32 * s.K
    return max(held + (kv if arriving else 0) + int(e * (rows * s.Q + 2 * keys * s.K))
               + kernel_scratch(s, rows, keys)
               for rows, keys, arriving in _fused_ring_steps(s))


def _ring_fused_forward(s: _Shape) -> int:
    """parallel/ring.py's forward on the fused kernel, the largest of its later steps at
    the merge: the running fp32 out beyond the kept one, the step's received keys and
    values and those arriving (all but the last); the kernel's partial out (q's dtype) and
    lse for its rows, the out's fp32 copy (16-bit) and the merge's four lse-sized
    temporaries."""
    e, kv = s.e, 2 * s.e * s.K
    held = (F32 - e) * s.Q + kv

    def partial(rows: float) -> int:
        return int(rows * ((e + (F32 if e != F32 else 0)) * s.Q + 5 * s.lse))

    return max(held + (kv if arriving else 0) + partial(rows)
               for rows, _, arriving in _fused_ring_steps(s))


# -- --attention-head-groups G (parallel/head_groups.py) -------------------------------------

def _group(s: _Shape) -> _Shape:
    """One group's core: hq/G query heads; kv heads grouped the same (kv/G), or, where the
    rank's kv_r = kv/sp heads are fewer than G (exchanged whole), one kv head a rank."""
    return replace(s, groups=1, selective=False, hq=s.hq // s.groups,
                   kv=max(s.kv // s.groups, s.sp))


def _kv_whole(s: _Shape) -> bool:
    return (s.kv // s.sp) % s.groups != 0


def _group_kv_views(g: _Shape, s: _Shape) -> int:
    """Bytes of a group's k and v that are views of the kept whole-exchanged ones (no new
    memory), counted by `_core_terms(g)` as its own."""
    return 2 * s.e * g.K if _kv_whole(s) else 0


def _grouped_terms(s: _Shape) -> dict:
    """What a layer keeps: the groups' checkpoints keep their inputs only, the rank's q, k
    and v (or k and v exchanged whole: the same bytes), nothing of the core; the
    out-projection's input is the groups' outputs stacked, never a core's saved output."""
    return {"core q,k,v (head groups' inputs)": s.e * (s.Q + 2 * s.K),
            "out input": s.e * s.Q}


def _grouped_backward(s: _Shape) -> int:
    """The core's backward, its largest group, beyond what the layer keeps: the group
    recomputed (its q, k, v and what its core saves: `_core_terms` of one group) and its
    core's backward (`_core_backward` of one group), beside the output's gradient (e*Q,
    each group's a view of it: alive until the last group takes its share) and the input
    gradients of the groups done, waiting to be stacked (per group e*(Q + 2K)/G; k and v
    exchanged whole: their gradients whole from the first group on). Selective
    recomputation adds the core's internals again (activations.py): here they are the
    group's, so that is taken off."""
    g, G, e = _group(s), s.groups, s.e

    def done(j: int) -> int:  # the input gradients of j groups
        if j == 0:
            return 0
        return j * e * g.Q + (2 * e * s.K if _kv_whole(s) else j * 2 * e * g.K)

    waiting = max((e * s.Q if j < G - 1 else 0) + done(j) for j in range(G))
    out = (sum(_core_terms(g).values()) - _group_kv_views(g, s) + _core_backward(g)
           + waiting)
    if s.selective:
        out -= sum(_core_terms(s).values()) - (
            s.e * (s.Q + 2 * s.K) if s.kernel in ("ring", "masked") else 0)
    return out


def _in_flight(g: _Shape, s: _Shape) -> int:
    """Under Ulysses, a group's input exchanges issued a group ahead (parallel/
    a2a_overlap.py): their whole-sequence side, q (k and v unless exchanged whole) of one
    group (`g`)."""
    if s.sp == 1:
        return 0
    return s.e * (g.Q + (0 if _kv_whole(s) else 2 * g.K))


def _grouped_forward(s: _Shape) -> int:
    """The forward working set (a layer recomputed), its largest group's: the outputs of
    the groups before it, waiting to be stacked, and the group's q, k, v, what its core
    makes and its output ((G-1)/G of e*Q, `_core_terms` and `_core_forward` of one group);
    under Ulysses the next group's inputs, sent and received (all but the last group), and
    the group before's output, whole (all but the first), in flight."""
    g, G = _group(s), s.groups
    own = sum(_core_terms(g).values()) - _group_kv_views(g, s) + _core_forward(g)
    ahead, behind = 2 * _in_flight(g, s), s.e * g.Q if s.sp > 1 else 0
    return own + max(j * s.e * g.Q + (ahead if j < G - 1 else 0) + (behind if j else 0)
                     for j in range(G))
