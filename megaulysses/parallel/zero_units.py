"""ZeRO-2/3's FSDP2 units over dp x sp: which parameters are gathered together, and when.

    blocks      every transformer block is a unit of its own. Stage 3 (no pp) gathers it
                before its forward and again before its backward and frees it after each,
                the next block's all-gather issued early (prefetch); stage 2, and any
                stage under pp, keeps it gathered until backward
    embedding,  stage 3, no pp, untied output layer: `model.embed` and `model.head`
    head        (final norm + output layer) are units of their own too, freed after their
                forward like a block: the head is gathered once more for its backward,
                at the start of backward; the embedding never again (its backward needs
                no weights). Their vocabulary-sized weights are not held through the
                blocks' forward and backward, nor is the head's unsharded gradient
                (reduce-scattered right after the head's backward, no longer at the end
                of the whole backward; FSDP keeps that reduce-scatter's input, as it
                does a block's, until the next unit's, the last block's, reduce-scatter)
    root        `shard_root`: the whole GPT (or each pipeline stage) is the root unit,
                holding what no other unit holds, kept gathered from forward to backward.
                With the units above that is nothing (FSDP still needs the root: it runs
                the end of backward, where the embedding's gradients are reduced, its
                input, the token ids, having no gradient to hook); otherwise (stage 2,
                pp, tied embeddings) it is the embedding, final norm and output layer

A tied model keeps the embedding and the head in the root unit: the head computes with
`embed.word`'s weight, and an FSDP2 parameter belongs to one unit, gathered only while
that unit's module runs; a unit of the embedding alone would have it freed (sharded)
when the head needs it.

Under pp no unit is resharded inside a step (a pipeline stage runs many forwards and
backwards interleaved): the units stay as they were, blocks and one root per stage.

--zero-param-offload (`offload_policy`): every unit's fp32 shards and their gradients live
on the host (pinned beside a GPU), so AdamW steps there; FSDP2 copies a unit's shard to
the device before its all-gather (with the prefetch) and its reduced gradient shard back
after its reduce-scatter. Under pp that happens once a step (the gathered stage stays).
"""

from __future__ import annotations

from itertools import pairwise
from typing import TYPE_CHECKING, Iterable, Iterator, Optional, cast

import torch
import torch.nn as nn
from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy,
                                    OffloadPolicy, fully_shard, register_fsdp_forward_method)

from megaulysses.parallel.comm import Comm
from megaulysses.parallel.dims import DP_SP
from megaulysses.parallel.grad_reduce import _local
from megaulysses.parallel.host_memory import mark_host

if TYPE_CHECKING:
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    from megaulysses.model.gpt import GPT


def mixed_precision(compute: torch.dtype, reduce: torch.dtype) -> MixedPrecisionPolicy:
    """Gather parameters in the compute dtype (bf16/fp16: half the all-gather bytes), reduce
    gradients in `reduce`; the sharded parameters (the master copy) stay fp32. This is the
    one mixed-precision policy of every stage (`layers.compute_weight`: every parameter used
    in the compute dtype), so stages 2/3 compute what 0/1 compute. Block inputs are not
    cast: the residual stream keeps the dtype the embedding gave it (16-bit, or fp32 under
    --fp32-residual-connection) and autocast picks each op's dtype. Gradients accumulated
    over micro-batches stay in `reduce` (FSDP upcasts them)."""
    return MixedPrecisionPolicy(param_dtype=None if compute == torch.float32 else compute,
                                reduce_dtype=reduce, cast_forward_inputs=False)


def offload_policy(on: bool, device_type: str) -> OffloadPolicy:
    """--zero-param-offload: FSDP2 keeps each unit's fp32 parameter and gradient shards on
    the host (the optimizer steps them there), copies the shard to the device for the
    unit's all-gather and the reduced gradient back. Pinned beside a GPU (asynchronous
    copies); on a CPU device the shards are host memory already, and pinning needs CUDA."""
    return CPUOffloadPolicy(pin_memory=device_type == "cuda") if on else OffloadPolicy()


def offloads(policy: OffloadPolicy) -> bool:
    """Does `policy` put the shards on the host?"""
    return isinstance(policy, CPUOffloadPolicy)


def shard_blocks(model: GPT, comm: Comm, stage: int, mp: MixedPrecisionPolicy,
                 pipeline: bool, offload: Optional[OffloadPolicy] = None) -> None:
    """fully_shard every transformer block this rank holds over dp x sp, and under stage 3
    without pp the embedding and the head of an untied model (`separate_ends`). Stage 3
    frees a unit's gathered parameters after its forward (and gathers the next one early);
    stage 2, and any stage under pp, keeps them until backward. Before `shard_root`."""
    reshard = stage == 3 and not pipeline
    ends = separate_ends(model) if reshard else False
    modules: list[nn.Module] = list(model.layers.values())
    if ends:
        modules = [model.embed, *modules, model.head]
    units: list[FSDPModule] = []
    for m in modules:
        units.append(fully_shard(m, mesh=comm.mesh(DP_SP), reshard_after_forward=reshard,
                                 mp_policy=mp, offload_policy=offload or OffloadPolicy()))
        _configure(units[-1], comm)
    if reshard:
        for prev, nxt in pairwise(units):
            prev.set_modules_to_forward_prefetch([nxt])
            nxt.set_modules_to_backward_prefetch([prev])
    if ends:
        # The GPT computes the loss with `head.loss`, not `head.forward`: FSDP's gather
        # before it, the reshard after it and the backward hooks must wrap that call too.
        register_fsdp_forward_method(model.head, "loss")
        # The embedding's backward reads no weights (the output gradient added into rows
        # by token id; FSDP's option for embeddings): it is never gathered in backward,
        # and the first block's prefetch of it is a no-op.
        embed = units[0]  # model.embed, an FSDP unit now
        embed.set_unshard_in_backward(False)
        # Nor does it prefetch anything: without a list of its own FSDP would gather the
        # unit before it in its recorded forward order, which after an evaluation's
        # forwards (recorded, never consumed by a backward) is the head, once more. A list
        # naming itself turns that off (and is a no-op).
        embed.set_modules_to_backward_prefetch([embed])


def separate_ends(model: nn.Module) -> bool:
    """Can the embedding and the head be units of their own? Both on this rank (no pp)
    and the output layer untied (see the module doc for the tied case)."""
    head = getattr(model, "head", None)
    return (getattr(model, "embed", None) is not None and head is not None
            and head.output is not None)


def shard_root(module: nn.Module, comm: Comm, mp: MixedPrecisionPolicy,
               offload: Optional[OffloadPolicy] = None) -> nn.Module:
    """fully_shard the parameters of `module` no other unit holds (the whole GPT, or a
    pipeline stage): the root unit. Kept gathered from forward to backward, which starts
    with them."""
    unit = fully_shard(module, mesh=comm.mesh(DP_SP), reshard_after_forward=False, mp_policy=mp,
                       offload_policy=offload or OffloadPolicy())
    _configure(unit, comm)
    return module


def _configure(module: FSDPModule, comm: Comm) -> None:
    module.set_gradient_divide_factor(1.0)  # sum over dp x sp, never average
    module.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
    all_gather, reduce_scatter = comm.fsdp_collectives()
    # torch types these with ABCs of a private module that older torch lacks: ours match
    # their calls without subclassing them
    module.set_custom_all_gather(cast("AllGather", all_gather))
    module.set_custom_reduce_scatter(cast("ReduceScatter", reduce_scatter))


# -- --zero-param-offload: what is on the host, for the live-bytes tracker ----------------

def mark_host_states(fsdp_params: Iterable, optimizer) -> None:
    """The offloaded shards and AdamW's states as host memory (parallel/host_memory.py):
    on a CPU device nothing else tells them from device memory. FSDP2 swaps a shard's
    tensor at its lazy init (padding, pinning) and AdamW makes its states at the first
    step: marked again at each moment `Zero` observes (each storage once)."""
    for fp in fsdp_params:
        mark_host(fp._sharded_param_data)
        mark_host(_local(fp.sharded_param))
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                mark_host(_local(v))  # a DTensor's storage is its local shard's


def mark_host_grads(params: list, comm: Comm) -> None:
    """Each reduced gradient shard as host memory the moment FSDP2 hands it over (FSDP2
    runs these hooks itself). On a CPU device it is a view of the reduce-scatter's output,
    marked with it. Not on CUDA: there it is a pinned host tensor already, and such a hook
    would make FSDP2 wait for each copy to the host."""
    if comm.meshes and comm.meshes["world"].device_type == "cuda":
        return
    for p in params:
        p.register_post_accumulate_grad_hook(lambda q: mark_host(_local(q.grad)))


def host_tensors(params: list, optimizer) -> Iterator[torch.Tensor]:
    """What --zero-param-offload keeps on the host: the shards, their gradients, AdamW's
    states."""
    for p in params:
        yield p
        yield p.grad
    for state in optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))
