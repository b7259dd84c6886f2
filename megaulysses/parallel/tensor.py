"""Tensor parallelism for the GPT with DTensor: the plan, the vocab-parallel head and its
loss.

Per block: q, k, v, fc1 (and gate) are column-parallel (each rank computes its heads or its
slice of the MLP; biases split with their rows), out and fc2 row-parallel (partial sums,
all-reduced); the per-head q/k norms (--qk-layernorm) replicated, their gradients summed.
The embedding is vocab-parallel (rows split; each rank looks up its own ids, the sum is
all-reduced). The output layer is vocab-parallel too, and its loss is
`vocab_parallel_linear_cross_entropy` (here): the chunked cross entropy of
model/ops/cross_entropy.py (by chunks of tokens, recomputed in backward) with its
cross-rank reductions (`_VocabShard`) as all-reduces over the tp group, so no rank ever
holds full-vocabulary logits, nor more than one chunk of its own `[tokens, V/tp]` logits
or their gradient.

`sequence_parallel=True` is Megatron's sequence parallelism inside the tp group (the
paper's baseline): between blocks the residual stream is split along the sequence
(`[b, s/tp, h]`); norms run on that shard; an all-gather rebuilds the sequence before the
column-parallel linears and a reduce-scatter replaces the row-parallel all-reduce.

The model itself is unchanged: parameters become DTensors, `model.head` is swapped for
`VocabParallelHead` (same submodules, same parameter names).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Hashable, Iterable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle,
                                               PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from megaulysses.model.layers import compute_weight
from megaulysses.model.ops.cross_entropy import apply_linear_cross_entropy, autocast_operands
from megaulysses.parallel.blocks import blocks
from megaulysses.parallel.comm import Comm
from megaulysses.parallel.dims import TP
from megaulysses.parallel.tensor_plan import (BLOCK_LINEARS, VOCAB_PARALLEL,  # noqa: F401
                                              megatron_sp_bytes_per_layer)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Placement

    from megaulysses.model.gpt import GPT, Head


def apply_tensor_parallel(model: GPT, tp_mesh: DeviceMesh, sequence_parallel: bool = False,
                          comm: Optional[Comm] = None) -> GPT:
    """Shard `model` in place over the 1-D `tp_mesh`. No-op for a mesh of one rank.

    `comm`: the loss's collectives over TP go through it (and are counted in its stats);
    None: a Comm of the head's own over `tp_mesh`."""
    if tp_mesh.size() == 1:
        return model
    seq = Shard(1) if sequence_parallel else Replicate()
    for block in blocks(model):
        parallelize_module(block, tp_mesh, _block_plan(block, sequence_parallel))
        # its heads are the tp rank's share: attention dropout's masks are per global head
        block.attn.head_offset = tp_mesh.get_local_rank() * (block.attn.num_heads
                                                              // tp_mesh.size())
    if model.embed is not None:
        # Vocab-parallel lookup, summed over tp; with SP the block input is then this
        # rank's sequence slice (after the learned positions were added, whole).
        # a module swap: VocabParallelEmbedding serves the lookups EmbeddingTable did
        model.embed.word = VocabParallelEmbedding(  # type: ignore[assignment]
            model.embed.word, tp_mesh)
        if sequence_parallel:
            parallelize_module(model.embed, tp_mesh, PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=seq))
    if model.head is not None:
        # a module swap: VocabParallelHead serves the GPT's calls of Head (forward, loss)
        model.head = VocabParallelHead(  # type: ignore[assignment]
            model.head, tp_mesh, seq, comm if comm is not None else Comm({TP: tp_mesh}))
    return model


QK_NORMS = ("attn.q_norm", "attn.k_norm")  # replicated; each rank normalizes its own heads


def _block_plan(block, sp: bool) -> dict:
    seq = Shard(1) if sp else Replicate()
    plan: dict[str, ParallelStyle] = {}
    for name, kind in BLOCK_LINEARS.items():
        owner, _, attr = name.rpartition(".")
        if getattr(block.get_submodule(owner), attr) is None:
            continue  # no gate without SwiGLU
        plan[name] = (ColwiseParallel() if kind == "colwise"
                      else RowwiseParallel(output_layouts=seq))
    # Wrap each sublayer's input once: its gradient (partial sums from q, k, v, or from
    # fc1 and gate) is then reduced in one collective, not one per linear (Megatron's f).
    plan["attn"] = PrepareModuleInput(input_layouts=(seq, None, None),  # (x, rotary, mask)
                                      desired_input_layouts=(Replicate(), None, None))
    plan["mlp"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
    if sp:  # norms on sequence shards; all-gather before each column-parallel group
        plan.update({"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel()})
    if block.attn.q_norm is not None:
        # --qk-layernorm: a replicated [d] norm over this rank's heads (dim 2 of
        # [b, s, heads, d]); its gradient is a Partial sum over tp, all-reduced by
        # align_grads (Megatron-LM all-reduces the qk-layernorm gradients likewise)
        plan.update({name: SequenceParallel(sequence_dim=2, use_local_output=True)
                     for name in QK_NORMS})
    return plan


class VocabParallelEmbedding(nn.Module):
    """`nn.Embedding` with its rows split over the tp ranks (Megatron's vocab-parallel
    embedding): each rank looks up the ids it holds, zeros for the others, and the partial
    sums are all-reduced. Backward makes this rank's `[V/tp, h]` gradient only (DTensor's
    own embedding sharding builds the whole `[V, h]` one first: 62.5 MiB per rank at
    32000 x 512, measured). The parameter keeps its name (`weight`) and layout (Shard(0)).
    """

    def __init__(self, word: nn.Embedding, tp_mesh: DeviceMesh):
        super().__init__()
        self.mesh = tp_mesh
        self.weight = nn.Parameter(distribute_tensor(word.weight.detach(), tp_mesh, [Shard(0)]))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [b, s] -> [b, s, h], whole
        w = _local(compute_weight(self.weight))  # [V/tp, h]: rows [start, start + V/tp)
        local = ids - self.mesh.get_local_rank() * w.shape[0]
        outside = (local < 0) | (local >= w.shape[0])  # [b, s]
        # In the compute dtype, as the whole table's lookup: one rank's row plus zeros is
        # exact in any dtype, so the all-reduce moves 16-bit rows under --bf16/--fp16.
        part = F.embedding(local.masked_fill(outside, 0), w)  # [b, s, h]
        part = part.masked_fill_(outside.unsqueeze(-1), 0.0)  # this rank's share of the sum
        return DTensor.from_local(part, self.mesh, [Partial()]).redistribute(
            self.mesh, [Replicate()]).to_local()


class VocabParallelHead(nn.Module):
    """The model's Head (final norm + output layer) with vocab-sharded logits.

    forward -> logits as a DTensor sharded on the vocabulary; loss -> per-token losses
    `[b, s]` (plain, replicated on the tp ranks) from the chunked vocab-parallel cross
    entropy over `comm`'s TP group, which must be `tp_mesh`'s.
    """

    def __init__(self, head: Head, tp_mesh: DeviceMesh, seq_layout: Placement, comm: Comm):
        super().__init__()
        self.mesh, self.seq, self.comm = tp_mesh, seq_layout, comm
        self.norm = head.norm
        self.output = head.output
        if isinstance(seq_layout, Shard):
            parallelize_module(self.norm, tp_mesh, SequenceParallel())
        if self.output is not None:
            parallelize_module(self.output, tp_mesh, ColwiseParallel(
                input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False))

    def _hidden(self, x) -> DTensor:
        """Normed hidden states, whole sequence, replicated: the output layer's input."""
        x = self.norm(x)
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, self.mesh, [self.seq])
        return x.redistribute(self.mesh, [Replicate()])  # SP: all-gather the sequence

    def forward(self, x: torch.Tensor,
                tied_weight: Optional[torch.Tensor] = None
                ) -> torch.Tensor:  # -> DTensor [b, s, V], Shard(-1)
        x = self._hidden(x)
        if self.output is not None:
            return self.output(x)
        return F.linear(x, _tied(tied_weight))  # tied: the vocab-parallel embedding's weight

    def loss(self, x: torch.Tensor, labels: torch.Tensor,
             tied_weight: Optional[torch.Tensor] = None) -> torch.Tensor:  # -> [b, s] fp32
        """Per-token losses from local tensors: the normed hidden states (SP: this rank's
        sequence slice, gathered inside the op) and this rank's vocabulary rows of the
        weight. `to_local()` is differentiable: the gradients reach the DTensor parameters
        in their own layouts (the norm's as partial sums under SP, see `align_grads`)."""
        h = _local(self.norm(x))  # [b, s/tp, h] with SP, else [b, s, h]
        weight = self.output.weight if self.output is not None else _tied(tied_weight)
        gather_dim = 1 if isinstance(self.seq, Shard) else None
        return vocab_parallel_linear_cross_entropy(h, _local(weight), labels, self.comm,
                                                   TP, gather_dim)  # [b, s]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _tied(weight: Optional[torch.Tensor]) -> torch.Tensor:
    """The embedding's weight, which a head without an output layer must be given."""
    if weight is None:
        raise ValueError("tied output weights: the head needs the embedding's weight")
    return weight


# ---- the vocab-parallel loss ---------------------------------------------------------------


@dataclass(frozen=True)
class _VocabShard:
    """The output layer is split by vocabulary rows over the `dim` group of `comm`: this
    rank holds rows [start, start + V/P). The cross-rank reductions of the chunked cross
    entropy (model/ops/cross_entropy.py's `VocabShard` hooks) as all-reduces over that group.
    `reduce_dx`: all-reduce the input gradient (the sum of every shard's part) inside;
    False when the caller's all-gather of the input reduces it in its own backward."""

    comm: Comm
    dim: str
    start: int
    reduce_dx: bool

    def reduce_max(self, x: torch.Tensor) -> None:
        self.comm.all_reduce_max(x, self.dim)

    def reduce_sum(self, x: torch.Tensor) -> None:
        self.comm.all_reduce_sum(x, self.dim)

    def reduce_input_grad(self, dx: torch.Tensor) -> None:
        if self.reduce_dx:
            self.comm.all_reduce_sum(dx, self.dim)


def vocab_parallel_linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor,
                                        labels: torch.Tensor, comm: Comm, dim: str,
                                        gather_dim: Optional[int] = None,
                                        ignore_index: int = -100) -> torch.Tensor:
    """`linear_cross_entropy` with the output layer split by vocabulary over the `dim`
    group of `comm` (a `parallel.comm.Comm`): no rank holds more than one chunk of
    `[tokens, V/P]` logits.

    weight `[V/P, h]`: rank r's rows [r V/P, (r+1) V/P) (a Shard(0) DTensor's local part).
    x `[..., h]`: the same on every rank of the group; or, with `gather_dim`, this rank's
    shard of it along `gather_dim` (Megatron-SP: its sequence slice), all-gathered here
    (whose backward reduce-scatters the input gradient). labels `[...]`: those of the whole
    (gathered) x. Returns fp32 losses `[...]`, equal on every rank of the group.
    """
    x, weight = autocast_operands(x, weight)  # before the gather: 16-bit on the wire
    if gather_dim is not None:
        x = comm.all_gather(x, dim, gather_dim)
    shard = _VocabShard(comm, dim, comm.rank(dim) * weight.shape[0],
                        reduce_dx=gather_dim is None)
    return apply_linear_cross_entropy(x, weight, labels, ignore_index, shard)


def step_context(comm: Comm, key: Hashable = None) -> contextlib.ExitStack:
    """Forward and backward of a step run inside this. Under tensor parallelism it counts
    DTensor's collectives in `comm.stats` (with `key`, the step's shapes: by a dispatch
    mode the first step of those shapes only, see `Comm.counting_dtensor_collectives`);
    otherwise it does nothing. Not with compiled blocks (`comm.compiled`,
    parallel/compile.py): dynamo compiles nothing inside a dispatch mode, so they go
    uncounted."""
    stack = contextlib.ExitStack()
    if comm.size(TP) > 1 and not comm.compiled:
        stack.enter_context(comm.counting_dtensor_collectives(key))
    return stack


def align_grads(params: Iterable[nn.Parameter], comm: Comm) -> None:
    """Each gradient in its parameter's layout. Replicated parameters fed by sequence
    shards (norms under SP) get Partial sums: all-reduced here, all of them in one flat
    all-reduce per dtype over TP (as Megatron-LM's finalize_model_grads does; one per norm
    weight cost 4x the time on gloo). Sharded parameters can get a replicated gradient
    (DTensor's vocab-parallel embedding backward): this rank keeps its shard, no
    communication."""
    partial: dict[torch.dtype, list] = {}
    for p in params:
        g = p.grad
        if (not isinstance(g, DTensor) or not isinstance(p, DTensor)
                or tuple(g.placements) == tuple(p.placements)):
            continue
        if _sums_to_replicate(g.placements, p.placements):
            partial.setdefault(g.dtype, []).append(p)
        else:
            p.grad = g.redistribute(g.device_mesh, p.placements)
    for group in partial.values():
        local = [p.grad.to_local() for p in group]
        flat = torch.cat([t.reshape(-1) for t in local])  # [sum of numels]
        comm.all_reduce_sum(flat, TP)
        for p, t, part in zip(group, local, flat.split([t.numel() for t in local]),
                           strict=True):
            t.copy_(part.view_as(t))
            p.grad = DTensor.from_local(t, p.grad.device_mesh, p.placements, run_check=False)


def _sums_to_replicate(have: tuple, want: tuple) -> bool:
    return (all(isinstance(x, Partial) and x.reduce_op == "sum" for x in have)
            and all(isinstance(x, Replicate) for x in want))
