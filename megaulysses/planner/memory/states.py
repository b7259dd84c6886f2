"""The memory plan's model states: parameters, gradients, AdamW's states, ZeRO's shards and
working sets, the gradient buckets (`_States`).

Model states, per rank (rank 0 of dp x cp x sp): P = fp32 bytes of its parameters (its
stage, its tp shard); ZeRO over N = dp*cp*sp (the ranks that see different tokens) cuts each
along dim 0 into ceil(rows/N)-row pieces.
    parameters  stage 0/1: P; 2/3: the padded piece;
                + autocast's cached e-byte copies of the blocks' weights (stages 0/1);
                + FSDP's gathered copies (compute dtype): stage 2 (and 2/3 under pp)
                everything, stage 3 the root unit (embedding, final norm, output layer;
                nothing when untied: those are units of their own, gathered for their
                forward, the head also for its backward) and one block at the loss's
                backward, two (this one and the prefetched one) during a block's backward
    gradients   stage 0/1 (and 2/3 under pp) P from a step's first backward on, in place;
                stage 2/3 the piece, plus a block's unsharded gradients during its
                backward; the last layer's fresh gradients in a step's first backward;
                the head's unsharded ones (its reduce-scatter input when it is a unit
                of its own) through the last layer's backward
    optimizer   AdamW's two fp32 moments of the rank's rows + 4 bytes of step per tensor
    host        --zero-param-offload (stage 3): the parameter pieces, their gradient pieces
                and the optimizer's states on the host (`host`), none on the device; the
                units' copies over the host link (`param_link_bytes`)
    distributed --use-distributed-optimizer under bf16/fp16 (stage <= 1): 16-bit weights
    optimizer   P/2, the gradient buffer P (P/2 in bf16) from the first backward on,
                fp32 main weights and moments of the rows (3 x rows), and at the step
                the main gradients' fp32 copy of the rows with a bf16 buffer; reduced
                and gathered in place (no working set): Megatron-LM's 6 + 12/N and
                4 + 16/N bytes per parameter (the buffer fp16 under --fp16 unless
                --accumulate-allreduce-grads-in-fp32); unfused (no gradient-accumulation
                fusion) a block linear's 16-bit weight gradient in its layer's backward;
                --optimizer-cpu-offload moves its fraction
                of the main weights, moments and main gradients to the host (`host`)
    reduction   stage 0: a flat copy of every bucket (25 MiB, --ddp-bucket-size) until
                all all-reduces end, + P; stage 1: earlier buckets in flight, the last
                one's gradients, padded pieces and their concatenation; at the step the
                reduced rows and the all-gather of the updated rows (N pieces); FSDP: a
                block's reduce-scatter input (padded, reduce dtype) beside its gradients
    pipeline    the receive buffers of the micro-batches in flight (4*T'*h each;
                moments.py's `_p2p_buffers`); the step's micro-batches (28 bytes a
                token; with packed documents also their int32 ids of the whole samples,
                4*b*S, on every rank), twice under pp (concatenated)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch

from megaulysses.config import Config, pipeline_layout
from megaulysses.parallel.dims import ParallelDims
from megaulysses.parallel.dist_opt_plan import fuses_weight_gradients, grad_buffer_dtype
from megaulysses.parallel.grad_reduce import bucket_bytes
from megaulysses.parallel.tensor_plan import BLOCK_LINEARS, VOCAB_PARALLEL
from megaulysses.planner.memory.shapes import F32, _RankLayout, _Shape

# parallel/tensor.py's plan: these weights are split by rows (dim 0; their biases too),
# those by columns (dim 1; their biases stay whole); everything else is replicated.
_COLWISE = tuple(f"{name}." for name, kind in BLOCK_LINEARS.items() if kind == "colwise") + \
    tuple(f"{name}." for name in VOCAB_PARALLEL)
_ROWWISE = tuple(f"{name}." for name, kind in BLOCK_LINEARS.items() if kind == "rowwise")


_PARAMS_CACHE: dict = {}  # (model config, layout, stages) -> {tp: ((name, shape), ...)}; the
# planner's grid search plans many grids of one model (a meta GPT takes ~50 ms to build)


def _stage_params(cfg: Config, dims: ParallelDims, rank: _RankLayout) -> tuple:
    """(name, tensor-parallel local shape) of every parameter this pipeline rank holds:
    the GPT built on the meta device and cut to the rank's stages as parallelize does."""
    layout = pipeline_layout(cfg.model.num_layers, cfg.parallel) if dims.pp > 1 else None
    key = (repr(cfg.model), repr(layout), rank.ids)
    if key not in _PARAMS_CACHE:
        from megaulysses.model.gpt import GPT
        from megaulysses.parallel.pipeline import keep_stages
        with torch.device("meta"):
            model = GPT(cfg.model)
        if layout is not None:
            keep_stages(model, layout, list(rank.ids))
        if len(_PARAMS_CACHE) >= 256:
            _PARAMS_CACHE.clear()
        _PARAMS_CACHE[key] = {1: tuple((n, tuple(p.shape)) for n, p in model.named_parameters())}
    by_tp = _PARAMS_CACHE[key]  # {tp: the tp-local list}, each made once
    if dims.tp not in by_tp:
        by_tp[dims.tp] = tuple((n, _tp_local(n, shape, dims.tp)) for n, shape in by_tp[1])
    return by_tp[dims.tp]


def _tp_local(name: str, shape: tuple, tp: int) -> tuple:
    if tp > 1 and any(k in name for k in _COLWISE):
        return (shape[0] // tp,) + shape[1:]
    if tp > 1 and any(k in name for k in _ROWWISE) and name.endswith("weight"):
        return (shape[0], shape[1] // tp)
    return shape


@dataclass(frozen=True)
class _Sizes:
    """fp32 bytes of some parameters: whole (tp shards), one rank's ZeRO piece (padded to
    ceil(rows/N) rows, as FSDP stores and collectives move it), rank 0's actual rows."""

    whole: int
    piece: int
    rows: int

    @classmethod
    def of(cls, shapes: list, n: int) -> "_Sizes":
        chunk = lambda sh: -(-sh[0] // n)  # noqa: E731
        return cls(whole=F32 * sum(math.prod(sh) for sh in shapes),
                   piece=F32 * sum(chunk(sh) * math.prod(sh[1:]) for sh in shapes),
                   rows=F32 * sum(min(chunk(sh), sh[0]) * math.prod(sh[1:]) for sh in shapes))


@dataclass(frozen=True)
class _Summary:
    """What `_States` needs of a parameter list, in fp32 bytes (`_summary`)."""

    everything: _Sizes
    block_params: tuple  # (name, shape) of the first block's parameters
    block: int  # a block's bytes (tp shards)
    block_mlp: int  # its MLP's
    block_padded: int  # its N padded ZeRO pieces
    root: int  # the root unit's (not a block's; without the ends where they are units)
    root_piece: int  # the piece of what a micro-batch gathers once (traffic.py)
    head_unit: int  # the head's N padded pieces where it is a unit of its own, else 0
    sizes: tuple  # (bytes, padded bytes) per parameter, for `_buckets`
    cast_copies: int  # 16-bit bytes of the blocks' 2-D weights (autocast's copies)
    head: _Sizes  # the output layer's (the word embedding's when tied)


@functools.lru_cache(maxsize=256)
def _summary(params: tuple, n: int, ends: bool, tied: bool) -> _Summary:
    """Sums over `params` ((name, tp-local shape) each) at ZeRO over `n` ranks; cached: the
    planner's search plans many grids of one parameter list (a 64-layer model's ~800
    parameters summed per grid were most of a search's time)."""
    first_block = next((_block(name) for name, _ in params if _block(name)), None)
    block = tuple((name, sh) for name, sh in params if _block(name) == first_block)
    block_sizes = _Sizes.of([sh for _, sh in block], n)
    root = _Sizes.of([sh for name, sh in params if not _block(name) and not (
        ends and name.startswith(("embed.", "head.")))], n)
    once = _Sizes.of([sh for name, sh in params if not _block(name) and not (
        ends and name.startswith("head."))], n)
    head_unit = _Sizes.of([sh for name, sh in params if ends and name.startswith("head.")], n)
    return _Summary(
        everything=_Sizes.of([sh for _, sh in params], n), block_params=block,
        block=block_sizes.whole, block_mlp=_Sizes.of([sh for name, sh in block
                                                      if ".mlp." in name], n).whole,
        block_padded=n * block_sizes.piece, root=root.whole, root_piece=once.piece,
        head_unit=n * head_unit.piece,
        sizes=tuple((F32 * math.prod(sh), n * _Sizes.of([sh], n).piece) for _, sh in params),
        cast_copies=2 * sum(math.prod(sh) for name, sh in params
                            if _block(name) and len(sh) == 2),
        head=_Sizes.of([sh for name, sh in params if name.startswith("head.")
                        or (tied and name.startswith("embed.word"))], n))


class _States:
    """Parameters, gradients and optimizer states of this rank (rank 0 of dp x cp x sp), and
    the ZeRO working sets, in bytes (the module doc's "Model states")."""

    def __init__(self, params: tuple, stage: int, n: int, pipeline: bool, s: _Shape,
                 cfg: Config):
        self.stage, self.n, self.pipeline = stage, n, pipeline
        half = cfg.train.bf16 or cfg.train.fp16
        tied = not cfg.model.untie_embeddings_and_output_weights
        # ZeRO-3 without pp, untied (parallel/zero_units.py): the embedding and the head
        # are units of their own, freed after forward like a block. Else they are in the
        # root unit, gathered all step.
        ends = stage == 3 and not pipeline and not tied
        p = _summary(params, n, ends, tied)
        self.local, self.piece = p.everything.whole, p.everything.piece
        self.block, self.block_mlp, self.block_padded = p.block, p.block_mlp, p.block_padded
        # root_piece: of what a micro-batch gathers once (traffic.py), the root unit and
        # (ends) the embedding, not gathered for its backward, which needs no weights
        self.root, self.root_piece, self.head_unit = p.root, p.root_piece, p.head_unit
        self.buckets = _buckets(p.sizes, bucket_bytes(cfg.parallel, self.local // F32, F32))
        self.optimizer = (2 * (self.local if stage == 0 else p.everything.rows)
                          + F32 * len(params))
        self.held_params = self.piece if stage >= 2 else self.local
        # autocast caches e-byte copies of the blocks' linear weights, saved for backward
        self.cast_copies = p.cast_copies if half and stage < 2 else 0
        self.reduce_e = 2 if cfg.parallel.grad_reduce_dtype == "bf16" else F32
        self.gather_e = 2 if half else F32  # FSDP gathers in the compute dtype
        head = p.head
        # What the head's backward leaves through the last layer's backward (`new_grads`
        # scales it by gather_e): its unsharded gradients, waiting for the root unit's
        # reduce-scatter; as a unit of its own, its reduce-scatter input (padded, reduce
        # dtype), which FSDP keeps until the next unit's reduce-scatter (measured)
        self.head_grads = (n * head.piece * self.reduce_e // self.gather_e if ends
                           else head.whole)
        self.host = self.host_link = 0  # bytes on the host, copied each way per step
        # Megatron-LM's distributed optimizer (parallel/dist_opt.py): 16-bit weights, a
        # gradient buffer in the reduce dtype, fp32 main weights and moments of the rows
        self.dist_opt = half and stage <= 1 and cfg.parallel.use_distributed_optimizer
        if self.dist_opt:
            self._distributed_optimizer(cfg, self.local if n == 1 else p.everything.rows,
                                        p.block_params, len(params))
        # --zero-param-offload (FSDP2's CPUOffloadPolicy): ZeRO-3's shards on the host,
        # n = 1 too (one rank's units, unsharded pieces, still stream from the host)
        self.param_offload = stage == 3 and cfg.parallel.zero_param_offload
        self.param_link = 0  # bytes the units' copies move over the host link: per
        # micro-batch (per step under pp; `param_link_bytes`)
        if self.param_offload:
            self._param_offload()

    def _distributed_optimizer(self, cfg: Config, rows: int, block: tuple,
                               tensors: int) -> None:
        """Megatron-LM's distributed optimizer's states, `rows`: this rank's bytes of the
        fp32 rows it steps."""
        self.optimizer = 3 * rows + F32 * tensors
        self.held_params, self.cast_copies = self.local // 2, 0
        # fp16 under --fp16 (Megatron-LM's); reduce-scattered in that dtype too
        self.reduce_e = buffer_e = grad_buffer_dtype(cfg).itemsize
        self.buffer = self.local * buffer_e // F32
        # the main gradients: the buffer's own rows, or their fp32 copy
        self.main_grads = rows if buffer_e != F32 else 0
        self.gather_e = 2  # the updated weights are gathered in 16 bits
        self._offload(cfg.parallel, rows, tensors)
        # Unfused (--no-gradient-accumulation-fusion, tensor parallelism, zero-bubble),
        # autograd makes each block linear's weight gradient in 16 bits before it is added
        # into the buffer: the largest lives during its layer's backward. Fused, the
        # linears add theirs into the buffer directly (model/fused_linear.py).
        linears = [math.prod(sh) for name, sh in block if len(sh) == 2
                   and name.split(".", 2)[2].rsplit(".", 1)[0] in BLOCK_LINEARS]
        self.wgrad16 = 0 if fuses_weight_gradients(cfg) else 2 * max(linears, default=0)

    def _offload(self, par, rows: int, tensors: int) -> None:
        """--optimizer-cpu-offload (parallel/offload.py): that fraction of the main rows,
        their moments and an fp32 copy of their gradient rows on the host; each step
        moves the gradient rows there and the updated rows back, fp32 both ways."""
        f = par.optimizer_offload_fraction if par.optimizer_cpu_offload else 0.0
        host = int(f * rows)
        self.host = 4 * host + F32 * int(f * tensors)  # main, moments, gradients; steps
        self.host_link = 2 * host  # bytes a step copies each way
        self.optimizer -= 3 * host + F32 * int(f * tensors)
        self.main_grads -= host if self.main_grads else 0

    def _param_offload(self) -> None:
        """--zero-param-offload: every fp32 parameter shard, its gradient shard (fp32: the
        parameter's dtype) and AdamW's states live on the host, which steps them; the
        device holds what FSDP2 brings in (the gathered units: `gathered`) and what a
        unit's reduce-scatter makes before its output goes down (`block_reduce_scatter`).
        Over the host link per step: each gather's input, the fp32 shard, up (stage 3: the
        root once and each block twice per micro-batch; under pp once), and each
        reduce-scatter's output, in the reduce dtype, down (per micro-batch; under pp
        once). FSDP2 issues both with its prefetched collectives (`param_link`)."""
        self.host = 2 * self.piece + self.optimizer
        self.optimizer = self.held_params = 0
        up = self.piece if self.pipeline else self.root_piece + 2 * (self.piece - self.root_piece)
        self.param_link = up + self.piece * self.reduce_e // F32

    def param_link_bytes(self, m: int) -> int:
        """--zero-param-offload's bytes over the host link per step, both ways together,
        with `m` micro-batches (FSDP gathers and reduces once a step under pp)."""
        return self.param_link * (1 if self.pipeline else m)

    @property
    def fsdp_per_block(self) -> bool:
        """Stages 2/3 without pp: FSDP gathers and reduce-scatters block by block, every
        micro-batch; under pp it does so once a step, like stage 0 in between."""
        return self.stage >= 2 and not self.pipeline

    def grads_accumulated(self) -> int:
        """Gradients held after a micro-batch's backward, before the step's last one."""
        if self.dist_opt:
            return self.buffer
        if self.fsdp_per_block:  # the shards: on the host under --zero-param-offload
            return 0 if self.param_offload else self.piece
        return self.local

    def gathered(self, blocks: int, head: bool = False) -> int:
        """Parameters FSDP holds unsharded (compute dtype): everything (stage 2, and 2/3
        under pp), or (stage 3) the root unit and `blocks` blocks, and with `head` (at
        the loss's backward) the head where it is a unit of its own."""
        if self.stage < 2:
            return 0
        if self.pipeline or self.stage == 2:
            return self.local * self.gather_e // F32
        own = self.head_unit if head else 0
        return (self.root + own + blocks * self.block_padded) * self.gather_e // F32

    def new_grads(self, done: int, later: bool) -> int:
        """Gradients the last layer's backward has made so far (`done` bytes of its
        parameters) beyond what is held: fresh in a step's first backward, accumulated in
        place later; FSDP makes them unsharded in the compute dtype in every backward."""
        if self.fsdp_per_block:
            return done * self.gather_e // F32
        if self.dist_opt:  # the buffer, from the start; in a block's backward, unfused, one
            # linear's 16-bit weight gradient before it is added into the buffer
            return (0 if later else self.buffer) + (self.wgrad16 if done else 0)
        return 0 if later else done

    def block_reduce_scatter(self) -> int:
        """FSDP reduce-scattering a block's gradients: the flat input (padded, reduce
        dtype) beside the unsharded gradients, then beside the output."""
        if self.stage < 2:
            return 0
        rs_in = self.block_padded * self.reduce_e // F32
        return rs_in + max(self.block * self.gather_e // F32, rs_in // self.n)

    def reduction(self) -> dict:
        """{moment: (gradients, working set)} of the dp x cp x sp reduction and the step."""
        if self.dist_opt:  # reduced and gathered in place, in the buffer
            return {"step": (self.buffer + self.main_grads, 0)}
        if self.n == 1 or self.stage >= 2:
            return {"step": (self.grads_accumulated(), 0)}
        last_local, last_padded = self.buckets[-1]
        if self.stage == 0:  # each bucket's flat copy, cast from an fp32 concatenation
            flats = sum(b for b, _ in self.buckets) * self.reduce_e // F32
            return {"reduction": (self.local, flats + (last_local if self.reduce_e != F32
                                                       else 0))}
        earlier = (sum(b for _, b in self.buckets) - last_padded) * self.reduce_e // F32
        return {"reduction": (last_local, earlier + 2 * last_padded),
                "step": (self.piece, (1 + self.n) * self.piece)}


def _block(name: str) -> Optional[str]:
    """The layer index of a block's parameter, None for the root unit's."""
    return name.split(".")[1] if name.startswith("layers.") else None


@functools.lru_cache(maxsize=256)
def _buckets(sizes: tuple, limit: int) -> tuple[tuple[int, int], ...]:
    """grad_reduce._make_buckets over (bytes, padded bytes) per parameter: in reverse order, a
    bucket closed once it reaches `limit` bytes (BUCKET_BYTES, or --ddp-bucket-size's);
    both sums per bucket."""
    buckets, local, padded = [], 0, 0
    for n, n_padded in reversed(sizes):
        local, padded = local + n, padded + n_padded
        if local >= limit:
            buckets.append((local, padded))
            local, padded = 0, 0
    if local:
        buckets.append((local, padded))
    return tuple(buckets) or ((0, 0),)  # cached: a tuple, not to be changed
