"""The parallelization recipe: one function turns a GPT built on the meta device into this
rank's part of the grid, ready to train.

The transforms, always in this order (each module's docstring says what its step does):

    1. pipeline split   pipeline.keep_stages: drop what this rank's stages do not use, and
                        make the stage modules (pp > 1)
    2. tensor parallel  tensor.apply_tensor_parallel: DTensor shards over tp, with Megatron
                        sequence parallelism inside tp when asked (tp > 1)
    3. sequence         ring.apply_context_parallel: every attention core becomes ring
                        attention over cp (cp > 1); then ulysses.apply_ulysses puts it
                        between two all-to-alls over sp (sp > 1)
    4. recomputation    recompute.apply_recompute (--recompute-*), then
                        tiling.apply_tiled_mlp (--tiled-mlp-chunks), then
                        head_groups.apply_head_groups (--attention-head-groups), then
                        compile.apply_compile (--torch-compile): each block's forward
                        and the loss through torch.compile
    5. ZeRO-2/3         zero.shard_blocks, zero.shard_root: FSDP2 over dp x sp, per block
                        and per root (the model, or each pipeline stage)
    6. materialize      to_empty: a rank allocates its own shards only
    7. initialize       each parameter from (seed, name, whole shape), one whole parameter at
                        a time, of which the rank keeps its piece

The pipeline split comes first so that nothing of another stage is ever sharded or
allocated; tensor parallelism before ZeRO, which shards the tp shards over dp x sp (2-D);
Ulysses wraps the attention core and selective recomputation wraps the core inside it, so
the all-to-alls are not repeated; compiling comes after every transform that changes what
a block runs (it decides from the final core what it can trace) and before FSDP2, whose
hooks run eagerly around the compiled forward (torchtitan's order too); everything is
decided on the meta device, so materializing allocates shards only, and initializing
writes each rank's pieces of the values one whole model would get (every grid starts from
the same model).

Then the pipeline schedule is built over the stages (pp > 1), and `Zero` (gradient
reduction over dp x sp and the optimizer at the ZeRO stage in effect).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import Shard, _StridedShard

from megaulysses.config import RunConfig
from megaulysses.config.fields import filled
from megaulysses.config.rules_memory import fpdt_chunks
from megaulysses.model.tiling import apply_tiled_mlp
from megaulysses.parallel import zero as zero_mod
from megaulysses.parallel.compile import apply_compile, compile_blocker
from megaulysses.parallel.comm import Comm
from megaulysses.parallel.dist_opt import (DistributedOptimizer, fuses_weight_gradients,
                                          grad_buffer_dtype)
from megaulysses.parallel.grad_reduce import BUCKET_BYTES, bucket_bytes
from megaulysses.parallel.head_groups import apply_head_groups
from megaulysses.parallel.dims import DP_SP, PP, TP
from megaulysses.parallel.pipeline import Pipeline, keep_stages, local_stages, stage_modules
from megaulysses.parallel.recompute import apply_recompute
from megaulysses.parallel.ring import apply_context_parallel
from megaulysses.parallel.tensor import align_grads, apply_tensor_parallel
from megaulysses.parallel.fpdt import apply_fpdt
from megaulysses.parallel.ulysses import apply_ulysses
from megaulysses.parallel.zero import Zero

if TYPE_CHECKING:
    from megaulysses.model.gpt import GPT

log = logging.getLogger(__name__)


@dataclass
class Parallelized:
    model: GPT  # this rank's GPT: only its parts, sharded, initialized, in train mode
    pipeline: Optional[Pipeline]  # pp > 1
    zero: Zero  # gradient reduction over dp x sp and the optimizer
    zero_stage: int  # the stage in effect: 0 when dp x sp is one rank (not under
    # --zero-param-offload, whose FSDP2 units are what move the shards to the host)


def parallelize(model: GPT, comm: Comm, cfg: RunConfig, device: torch.device,
                dtype: torch.dtype,
                param_groups: Callable[[nn.Module], list[dict]],
                make_optimizer: Callable[[list[dict]], torch.optim.Optimizer]) -> Parallelized:
    """`model`: the whole GPT on the meta device. `param_groups(model)` and
    `make_optimizer(groups)` build the optimizer (ZeRO-1 runs it on row shards)."""
    par, mem, dims = cfg.parallel, cfg.memory, cfg.dims
    sequence_parallel = par.tp_sequence_parallel  # in effect: asked for, and tp > 1
    zero_stage = _zero_stage(par, comm)
    layout = [list(stage) for stage in cfg.layout] if dims.pp > 1 else None
    stages: list[nn.Module] = []
    if layout is not None:  # 1
        ids = local_stages(len(layout), dims.pp, comm.rank(PP))
        keep_stages(model, layout, ids)
        stages = list(stage_modules(model, layout, ids, residual_dtype(cfg, dtype)))
    if dims.tp > 1:  # 2
        apply_tensor_parallel(model, comm.mesh(TP), sequence_parallel, comm)
    apply_context_parallel(model, comm)  # 3
    if mem.ds_sequence_parallel_fpdt:  # the chunked Ulysses core instead (parallel/fpdt.py)
        apply_fpdt(model, comm, fpdt_chunks(cfg.model, mem),
                   mem.ds_sequence_parallel_fpdt_offloading)
    else:
        apply_ulysses(model, comm)
    apply_recompute(model, mem.recompute_granularity, mem.recompute_method,  # 4
                    mem.recompute_num_layers, early_stop=mem.tiled_mlp_chunks == 1
                    and mem.attention_head_groups == 1,  # nested checkpoints: recompute.py
                    offload_layers=mem.cpu_offloading_num_layers)
    apply_tiled_mlp(model, mem.tiled_mlp_chunks)
    apply_head_groups(model, mem.attention_head_groups)  # after both: unwraps selective's
    if par.torch_compile:  # 4b
        blocker = compile_blocker(cfg, dtype, zero_stage)
        log.info("%s", apply_compile(model, cfg.data.reset_attention_mask, blocker,
                                     dims.tp > 1))
        comm.compiled = blocker is None  # DTensor's collectives uncounted (tensor.py)
    reduce_dtype = torch.bfloat16 if par.grad_reduce_dtype == "bf16" else torch.float32
    # --zero-param-offload: FSDP2 keeps the ZeRO-3 shards on the host (zero_units.py)
    offload = zero_mod.offload_policy(par.zero_param_offload and zero_stage == 3, device.type)
    if zero_stage >= 2:  # 5
        mp = zero_mod.mixed_precision(dtype, reduce_dtype)
        zero_mod.shard_blocks(model, comm, zero_stage, mp, layout is not None, offload)
        for root in stages or [model]:
            zero_mod.shard_root(root, comm, mp, offload)
    _materialize(model, device, host=zero_mod.offloads(offload))  # 6
    model.init_weights(cfg.train.seed, write=write_piece)  # 7
    model.train()
    pipeline = None
    if layout is not None:
        schedule = filled(par.pipeline_schedule, "--pipeline-schedule")  # resolve() fills it
        pipeline = Pipeline(model, comm, layout, schedule, cfg.micro_batches,
                            _micro_shape(cfg, dtype), device, stages)
    # Megatron-LM's distributed optimizer: 16-bit runs at stage <= 1 (under fp32: ZeRO-1)
    dist_opt = (dtype if par.use_distributed_optimizer and zero_stage <= 1
                and dtype != torch.float32 else None)
    fraction = par.optimizer_offload_fraction if par.optimizer_cpu_offload else None
    zero = _build_zero(model, comm, zero_stage, pipeline, reduce_dtype,
                       param_groups(model), make_optimizer, dist_opt,
                       (fraction, par.overlap_cpu_optimizer_d2h_h2d), par.overlap_param_gather,
                       _bucket_bytes(par, model), grad_buffer_dtype(cfg),
                       fuses_weight_gradients(cfg))
    return Parallelized(model, pipeline, zero, zero_stage)


def _zero_stage(par, comm: Comm) -> int:
    """The ZeRO stage in effect: none on one data x sequence rank (nothing to shard), but
    --zero-param-offload's stage 3 stays there (FSDP2 over a one-rank group: the units'
    shards still live on the host and stream to the device)."""
    return par.zero_stage if comm.size(DP_SP) > 1 or par.zero_param_offload else 0


def _materialize(model: nn.Module, device: torch.device, host: bool) -> None:
    """Allocate this rank's shards on `device`; under --zero-param-offload on the host
    (FSDP2 refuses offloaded shards allocated elsewhere), buffers still on `device`."""
    model.to_empty(device="cpu" if host else device)
    if host:
        for module in model.modules():
            for name, buf in module.named_buffers(recurse=False):
                module._buffers[name] = buf.to(device)  # keeps its persistence
        log.info("--zero-param-offload: each ZeRO-3 unit's fp32 parameter and gradient "
                 "shards and the optimizer states on the host%s; a unit's weights come to "
                 "%s for its forward and backward", " (pinned)" if device.type == "cuda"
                 else "", device.type)


@torch.no_grad()
def write_piece(param: torch.Tensor, value: torch.Tensor) -> None:
    """Put this rank's piece of the whole `value` into `param` (a DTensor keeps its shard:
    cut locally, nothing is sent)."""
    value = value.to(param.device)
    if isinstance(param, DTensor):
        value = _local_piece(value, param)
        param = param.to_local()
    param.copy_(value)


def _local_piece(value: torch.Tensor, param: DTensor) -> torch.Tensor:
    """This rank's piece of the whole `value`: a view where the layout is plain shards (no
    second copy of the largest parameter while it is initialized), else cut by DTensor."""
    if any(isinstance(p, _StridedShard) for p in param.placements):
        return distribute_tensor(value, param.device_mesh, param.placements,
                                 src_data_rank=None).to_local()
    shape, offset = list(value.shape), [0] * value.dim()
    coords = param.device_mesh.get_coordinate()
    if coords is None:  # every rank builds the model on a mesh holding it
        raise RuntimeError("write_piece: this rank is not in the parameter's device mesh")
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard):  # torch.chunk's rule: pieces of ceil(n / k)
            d, n, k = placement.dim, shape[placement.dim], param.device_mesh.size(mesh_dim)
            full = -(-n // k)
            start = min(n, full * coords[mesh_dim])
            shape[d], offset[d] = min(n, start + full) - start, offset[d] + start
    return value[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]


def _bucket_bytes(par, model: nn.Module) -> tuple[int, int]:
    """Bytes per gradient bucket (--ddp-bucket-size, --ddp-num-buckets: Megatron-LM's
    counts of parameters) of 16-bit weights (the distributed optimizer buckets those)
    and of fp32 gradients (ZeRO-0/1's reducer)."""
    numel = sum(p.numel() for p in model.parameters())  # as _make_buckets counts them
    return bucket_bytes(par, numel, 2), bucket_bytes(par, numel, 4)


def residual_dtype(cfg: RunConfig, dtype: torch.dtype) -> torch.dtype:
    """The residual stream's dtype: the compute dtype, fp32 under
    --fp32-residual-connection (model/gpt.py's Embedding)."""
    return torch.float32 if cfg.model.fp32_residual_connection else dtype


def _micro_shape(cfg: RunConfig, dtype: torch.dtype) -> tuple:
    """(micro-batch, local tokens of a sample, local tokens between blocks, hidden, the
    residual stream's dtype)."""
    m, dims = cfg.model, cfg.dims
    s_tok = m.seq_length // dims.seq_degree
    s_hid = s_tok // dims.tp if cfg.parallel.tp_sequence_parallel else s_tok
    return cfg.train.micro_batch_size, s_tok, s_hid, m.hidden_size, residual_dtype(cfg, dtype)


def _build_zero(model, comm: Comm, stage: int, pipeline: Optional[Pipeline], reduce_dtype,
                groups: list[dict], make_optimizer, dist_opt: Optional[torch.dtype],
                offload: tuple = (None, False), overlap_gather: bool = False,
                bucket: tuple = (BUCKET_BYTES, BUCKET_BYTES),
                buffer: Optional[torch.dtype] = None,
                fuse: bool = False) -> Zero:
    """`dist_opt`: the 16-bit dtype of Megatron-LM's distributed optimizer (its weights
    in that dtype, fp32 main rows; dist_opt.py), or None (fp32 weights, this ZeRO stage);
    `offload`: its (host fraction or None, overlapped copies) (offload.py); `bucket`: bytes
    per gradient bucket of its 16-bit weights and of ZeRO-0/1's fp32 gradients
    (`_bucket_bytes`); `buffer`: its
    gradient buffer's dtype (default: `reduce_dtype`); `fuse`: its gradient-accumulation
    fusion (Megatron-LM's)."""
    roots = [model] if pipeline is None else [s.submod for s in pipeline.stages]
    align = None
    if comm.size(TP) > 1:
        align = lambda params: align_grads(params, comm)  # noqa: E731
    own = None
    if dist_opt is not None:
        own = DistributedOptimizer(groups, comm, dist_opt, buffer or reduce_dtype,
                                   bucket[0], make_optimizer, align, *offload)
        if pipeline is None and model.head.output is None:  # tied: two uses in one graph
            model.embed.word.weight.grad_sink = own.take
        if fuse:
            own.fuse_weight_gradients(model)
        if overlap_gather:
            own.attach(model)
    zero = Zero(model, comm, stage, groups, make_optimizer, reduce_dtype,
                roots if stage >= 2 else [], align, optimizer=own,
                bucket_mb=bucket[1] / 2 ** 20)
    if pipeline is not None:
        pipeline.overlap_grad_reduction(zero.before_last_backward)
        if own is not None:
            pipeline.after_weight_grads(own.flush)
    return zero
