"""The memory plan's moments: where the peak can be, and what is held at each.

The peak is the largest of these moments (the table shows which):
    head backward        the loss's backward, everything kept alive: its dW^T accumulator
                         (4*h*V), the input gradient (e*T*h) and the largest of a chunk's
                         dW product, two chunks of exps (the next recomputed while the
                         last is still referenced; e+4 bytes each under autocast), the
                         final e-byte dW
    mlp backward         the last layer's MLP backward: two e*T*f gradients beyond what it
                         keeps and the residual stream's gradient (on the last stage also
                         the loss's input gradient, 4*T'*h, still referenced; under
                         Megatron-SP fc2's gradient all-gathered, 4*T*h, per chunk when
                         tiled); what recomputation brings back (full: the group's layers
                         in full, while earlier groups keep their inputs; tiled: one chunk
                         of the MLP, and the chunks' input gradients, 4*T'*h in all); a
                         tied embedding's gradient waiting for the embedding's own backward
    core backward        the last layer's attention core backward, the MLP freed: the
                         core's gradients (block kernel: two 64-row gradient blocks; and
                         under selective recomputation the core's internals again); the
                         masked block kernel and the ring below
    qkv backward         q, k and v's input gradients summed, the core's freed: dq, dk, dv
                         and three 4*T*h tensors at once under tensor parallelism (DTensor
                         adds out of place; Megatron-SP: T is the whole sequence), two
                         without
    attention recomputed (full recomputation under Ulysses, or with the masked kernel or
                         the ring) the last layer rerunning its attention: q, k, v before
                         the all-to-all (the caller still holds them) beside those after
                         it, and the output all-to-all's packing or the core's forward
                         working set (below)
    FSDP (stages 2/3, no pp): after the head's backward its unsharded gradients wait for the
                         root unit's reduce-scatter at the end of backward (all moments)
    block reduce-scatter (stages 2/3) right after the last layer's backward
    reduction, step      stage 0/1's buckets, stage 1's all-gather (activations freed)
"""

from __future__ import annotations

from megaulysses.planner.memory.activations import _Activations
from megaulysses.planner.memory.shapes import _RankLayout, _Shape
from megaulysses.planner.memory.states import _States

BATCH_BYTES_PER_TOKEN = 3 * 8 + 4  # tokens, labels, positions (int64), loss mask (fp32)
DOCUMENT_ID_BYTES = 4  # the batch's documents: int32 ids of the whole sample, every rank


def _held_outside_model(s: _Shape, rank: _RankLayout, pp: int, full_recompute: bool) -> int:
    """The step's micro-batches (concatenated once more under pp) and the pipeline's
    buffers in flight (`_p2p_buffers`)."""
    per_micro = s.T * BATCH_BYTES_PER_TOKEN + (
        DOCUMENT_ID_BYTES * s.b * s.S if s.documents else 0)  # the whole samples' ids
    batches = rank.m * per_micro * (2 if pp > 1 else 1)
    if pp == 1:
        return batches
    return batches + _p2p_buffers(rank, full_recompute) * s.r * s.Tr * s.h


def _p2p_buffers(rank: _RankLayout, full_recompute: bool) -> int:
    """Receive (and sent) buffers, 4*T'*h each, held at a backward. parallel/pipeline.py's
    stages allocate one when its micro-batch's receive is posted and drop it after that
    micro-batch's backward (torch's own keep one per micro-batch and direction): an
    activation per model chunk in flight on a stage that receives (the chunk's input,
    kept for backward; under full recomputation it is the first checkpoint's input,
    counted with the activations), the gradient of the chunk whose backward runs; and
    on a stage that receives, the input gradient it sent last, which the schedule's send
    ops reference until the next backward's (measured). Not counted: under
    interleaved-1f1b and zero-bubble the stages drop each send once its receive is posted
    (parallel/pipeline_sends.py); a few stay pending (at most ~2 pp, whatever m)."""
    receiving = rank.chunks - rank.first  # chunks whose stage is not the first
    acts = 0 if full_recompute else -(-rank.in_flight * receiving // rank.chunks)
    grads = 1 if rank.chunks > rank.last else 0  # some chunk's stage is not the last
    return acts + grads + (1 if receiving else 0)


def _moments(st: _States, acts: _Activations, rank: _RankLayout, other: int) -> dict:
    """{moment: {params, grads, optimizer, activations, transient}} where the peak can be.

    In flight are `rank.in_flight` model chunks (micro-batches without virtual stages),
    each keeping 1/chunks of what a micro-batch keeps on this rank; the one whose
    backward runs frees some of its own and adds temporaries (transient). Under
    zero-bubble `rank.pending` of them also keep what their weight-gradient pass needs
    (`_Activations.pending_kept`)."""
    unit, kept = acts.per_micro_batch() // rank.chunks, acts.per_micro_batch()
    flight, total = rank.in_flight, rank.m * rank.chunks
    later = flight if total > flight else flight - 1  # while forwards remain
    moments = {}

    def add(name, grads, act, transient, params):
        moments[name] = {"params": params, "grads": grads, "optimizer": st.optimizer,
                         "activations": act, "transient": transient + other}

    def both(name, act, transient, params, new_grads=(0, 0)):
        # zero-bubble: the chunks waiting for their W pass
        act += acts.pending_kept(head=name == "head backward")
        add(f"{name}, first", new_grads[0], (flight - 1) * unit + act, transient, params)
        if total > 1:
            add(f"{name}, later", st.grads_accumulated() + new_grads[1],
                (later - 1) * unit + act, transient, params)

    done = {"head backward": 0, "mlp backward": st.block_mlp, "core backward": st.block,
            "qkv backward": st.block, "attention recomputed": 0}
    # FSDP: the head's unsharded gradients wait for the root unit's reduce-scatter, at the
    # end of the micro-batch's backward
    head = st.head_grads if rank.last and st.fsdp_per_block else 0
    for name, live in acts.backward_moments().items():
        blocks = 1 if name in ("head backward", "attention recomputed") else min(2, acts.layers)
        part = (done[name] if acts.layers else 0) + (head if name != "head backward" else 0)
        both(name, unit + min(0, live - kept), max(0, live - kept),
             st.held_params + st.gathered(blocks, name == "head backward") + st.cast_copies,
             (st.new_grads(part, False), st.new_grads(part, True)))
    if st.block_reduce_scatter():  # the block itself is resharded before it
        both("block reduce-scatter", unit - acts.head - acts.last_layer_kept(),
             st.block_reduce_scatter(), st.held_params + st.gathered(1))
    for name, (grads, transient) in st.reduction().items():
        add(name, grads, 0, transient, st.held_params)
    return moments
