"""ZeRO across the data x sequence-parallel ranks ("dp_sp"): who holds which model states.

Sequence-parallel ranks hold the same parameters and see different tokens, exactly like
data-parallel ranks, so ZeRO shards over all N = dp * sp of them: model-state memory per
rank falls by N, not by dp alone (the Ulysses paper's second idea).

    stage 0  every rank holds everything; gradients all-reduced while backward runs
    stage 1  + optimizer states sharded: gradients reduce-scattered onto each rank's rows
             while the last backward runs, AdamW updates those rows (views into the full
             parameters), the updated rows are all-gathered back (`ShardedAdamW`)
    stage 2  + gradients sharded, with FSDP2 `fully_shard` per block and one root unit
             (embedding, head): parameters gathered at a step's first forward and kept
             until its last backward; each micro-batch's gradients reduce-scattered as
             backward produces them
    stage 3  + parameters sharded: each block gathered before its forward and again
             before its backward and freed after each; the next block's all-gather is
             issued while the current one computes (prefetch); so are the embedding and
             the head of an untied model, the root unit holding nothing then
             (zero_units.py: the units, and why a tied model's stay in the root);
             --zero-param-offload keeps the shards, their gradients and so the
             optimizer's states on the host (zero_units.offload_policy)

Every stage cuts a parameter's local tensor (its tensor-parallel shard) along dim 0 into
N pieces the way torch.chunk does (`RowShard`), FSDP2's own layout, so optimizer states
are the same DTensors in the checkpoints of stages 1, 2 and 3.

Under pipeline parallelism (FSDP's rule: no resharding inside a step, since a pipeline
stage runs many forwards and backwards interleaved): stages 2 and 3 gather a pipeline
stage's parameters at its first forward and keep them, and its gradients unsharded, until
its last backward; the gradients are then reduce-scattered once. Within a step they hold
what stage 1 holds; between steps parameters (stage 2, 3), gradients and optimizer states
are sharded. Stages 0 and 1 behave under pp exactly as without it.

The gradient contract is unchanged: every rank's loss is already divided by the global
token count, so gradients are summed over dp x sp, never averaged (FSDP's averaging is off).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DeviceMesh, DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from megaulysses.parallel.comm import Comm
from megaulysses.parallel.dims import DP_SP, TP
from megaulysses.parallel.grad_norm import GradPart
from megaulysses.parallel.grad_reduce import (BUCKET_MB, GradReducer, RowShard, _local,
                                              _storage_bytes)
from megaulysses.parallel.zero_units import (host_tensors, mark_host_grads,
                                             mark_host_states)
from megaulysses.parallel.zero_units import (mixed_precision, offload_policy,  # noqa: F401
                                             offloads, shard_blocks, shard_root)  # FSDP2 units

if TYPE_CHECKING:
    from torch.distributed.tensor import Placement

    from megaulysses.parallel.dist_opt import DistributedOptimizer

DIM = DP_SP

# FSDP2 warns when a wrapped module returns a view (the GPT's per-token losses are one):
# an in-place op on it would skip FSDP's pre-backward hook. Nothing modifies them in place.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


# -- stage 1: the sharded optimizer ----------------------------------------------------------

class ShardedAdamW:
    """ZeRO-1: AdamW over this rank's rows of every parameter.

    The rows are views into the (replicated) parameters, so the update writes in place;
    `step()` then all-gathers every rank's updated rows into every rank's full copy. The
    gradients it steps on are `reducer.shard_grads` (reduce-scattered rows). Looks like a
    torch optimizer to the trainer: `param_groups` (lr), `step`, `zero_grad`.
    """

    def __init__(self, groups: list[dict], comm: Comm, reducer: GradReducer,
                 make_adamw: Callable[[list[dict]], torch.optim.Optimizer]):
        if reducer.shards is None:
            raise ValueError("ShardedAdamW needs a GradReducer built with row shards (ZeRO-1)")
        self.comm, self.reducer = comm, reducer
        self.shards: dict = reducer.shards
        self.views = {p: self.shards[p].mine(_local(p).detach()) for g in groups
                      for p in g["params"]}
        self.inner = make_adamw([{**g, "params": [self.views[p] for p in g["params"]]}
                                 for g in groups])
        self.groups = [list(g["params"]) for g in groups]  # parameters of each inner group
        self.params = [p for g in self.groups for p in g]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @property
    def state(self) -> dict[torch.Tensor, Any]:
        return self.inner.state

    def grad_of(self, p: torch.Tensor) -> torch.Tensor:
        return self.reducer.shard_grads[p]

    def step(self) -> None:
        for p, view in self.views.items():
            view.grad = self.reducer.shard_grads[p]
        self.inner.step()
        self._gather_rows()

    def _gather_rows(self):
        """Every rank's updated rows into every rank's parameters, bucket by bucket."""
        launched = []
        for bucket in self.reducer.buckets:
            mine = torch.cat([self.shards[p].pad(self.views[p]) for p in bucket])
            out = mine.new_empty(self.comm.size(DIM), mine.numel())  # [P, pieces]
            launched.append((bucket, out, self.comm.all_gather_flat(out.view(-1), mine, DIM,
                                                                     async_op=True)))
        for bucket, out, work in launched:
            work.wait()
            offset = 0
            for p in bucket:
                shard, local = self.shards[p], _local(p).detach()
                piece = out[:, offset:offset + shard.padded_numel]  # [P, padded rows]
                local.view(-1).copy_(piece.reshape(-1)[:local.numel()])
                offset += shard.padded_numel

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)
        for p in self.params:
            p.grad = None
        self.reducer.shard_grads.clear()

    # -- checkpoints: the layout of torch's flattened optimizer state dict -----------------

    def dcp_state_dict(self, fqns: dict) -> dict:
        """{"state.<name>.<key>": DTensor over dp x sp (x tp) with the parameter's global
        shape, "param_groups.<name>.<key>": value}: what `get_optimizer_state_dict` gives
        for stage 0 (flattened), so DCP loads either into either."""
        self._materialize_state()
        out = {}
        for group, params in zip(self.inner.param_groups, self.groups, strict=True):
            hyper = {k: v for k, v in group.items() if k != "params"}
            for p in params:
                name = fqns[p]
                for key, value in self.inner.state[self.views[p]].items():
                    out[f"state.{name}.{key}"] = (self._as_dtensor(p, value)
                                                  if value.dim() > 0 else value)
                for key, value in hyper.items():
                    out[f"param_groups.{name}.{key}"] = value
        return out

    def load_dcp_state_dict(self, state: dict, fqns: dict) -> None:
        """The inverse of `dcp_state_dict` (after DCP filled it in)."""
        for p in self.params:
            mine = self.inner.state[self.views[p]]
            for key in mine:
                value = state[f"state.{fqns[p]}.{key}"]
                mine[key].copy_(_local(value))
        for group, params in zip(self.inner.param_groups, self.groups, strict=True):
            for key in group:
                saved = f"param_groups.{fqns[params[0]]}.{key}"
                if key != "params" and saved in state:
                    group[key] = state[saved]

    def _materialize_state(self):
        """AdamW creates its states at the first step; DCP needs them before that (a
        load into a fresh run): one step of zero gradients at lr 0 creates them, then the
        step counts are reset, so nothing a later step computes changes."""
        if self.inner.state:
            return
        lrs = [g["lr"] for g in self.inner.param_groups]
        for g in self.inner.param_groups:
            g["lr"] = 0.0
        for view in self.views.values():
            view.grad = torch.zeros_like(view)
        self.inner.step()
        for g, lr in zip(self.inner.param_groups, lrs, strict=True):
            g["lr"] = lr
        for view in self.views.values():
            view.grad = None
            self.inner.state[view]["step"].zero_()

    def _as_dtensor(self, p, local: torch.Tensor) -> DTensor:
        mesh, placements = row_shard_spec(p, self.comm)
        shape = p.shape  # global: a DTensor parameter's shape is the whole one
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape,
                                  stride=stride)


def row_shard_spec(p: torch.Tensor, comm: Comm) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """(mesh, placements) of rows of `p`'s local tensor cut over dp x sp, as a DTensor
    of `p`'s global shape: what FSDP2 builds for its sharded parameters. Under tensor
    parallelism the rows of a tp shard of dim 0 interleave (`_StridedShard`)."""
    dp_sp = comm.mesh(DIM)
    if not isinstance(p, DTensor):
        return dp_sp, (Shard(0),)
    tp_placement = p.placements[0]
    mesh = DeviceMesh._concatenate([dp_sp, p.device_mesh])
    split = p.device_mesh.size() if tp_placement == Shard(0) else 1
    first = _StridedShard(0, split_factor=split) if split > 1 else Shard(0)
    return mesh, (first, tp_placement)


# -- the data x sequence-parallel side of a training step, at any stage ------------------------

class Zero:
    """Gradient reduction, optimizer and held model states of this rank, for any stage.

    The trainer calls, per step: `before_backward(last)` before each micro-batch's
    backward (or the pipeline calls `before_last_backward`), `finish_grads()` after the
    last one, `grad_parts()` to clip, `step()`, `zero_grad()`. `grad_of(p)` is the tensor
    holding this rank's reduced gradient of `p` (the whole gradient, or its rows).
    """

    def __init__(self, model: nn.Module, comm: Comm, stage: int, groups: list[dict],
                 make_adamw: Callable[[list[dict]], torch.optim.Optimizer],
                 reduce_dtype: torch.dtype, fsdp_roots: list,
                 align: Optional[Callable[[list], None]] = None,
                 optimizer: Optional[DistributedOptimizer] = None,
                 bucket_mb: float = BUCKET_MB):
        self.comm, self.stage, self.fsdp_roots, self.align = comm, stage, fsdp_roots, align
        self.params = [p for g in groups for p in g["params"]]
        # `optimizer` (own): one that reduces, holds and steps (dist_opt.py)
        self.reducer: Optional[GradReducer] = None
        self.own = optimizer
        n = comm.size(DIM)
        if stage <= 1 and n > 1 and optimizer is None:
            shards = ({p: RowShard.of(_local(p), n, comm.rank(DIM)) for p in self.params}
                      if stage == 1 else None)
            self.reducer = GradReducer(list(model.parameters()), comm, DIM, bucket_mb,
                                       shards=shards, reduce_dtype=reduce_dtype, align=align)
        self.optimizer: ShardedAdamW | torch.optim.Optimizer
        if optimizer is not None:
            self.optimizer = optimizer
        elif stage == 1:  # ZeRO-1 runs only where dp x sp has ranks: `reducer` is built
            assert self.reducer is not None, "stage 1 on one dp x sp rank"
            self.optimizer = ShardedAdamW(groups, comm, self.reducer, make_adamw)
        else:
            self.optimizer = make_adamw(groups)
        self._reduces = self.reducer or optimizer  # what arm() and finish() go to, if any
        # every FSDP unit (blocks, an untied model's embedding and head under stage 3,
        # the roots): what reshard, held_bytes and stage 2's reshard switch go over
        self._fsdp = [m for root in fsdp_roots for m in root.modules()
                      if isinstance(m, FSDPModule)]
        self.peak: dict = {}  # most bytes held at the moments observed since pop_peak()
        self.at_step: dict = {}  # bytes held right after the last optimizer step
        # --zero-param-offload (zero_units.offload_policy): FSDP2 keeps these units'
        # shards, their gradients and so the optimizer's states on the host
        self.host_offload = any(fp.offload_to_cpu for fp in self._fsdp_params())
        if self.host_offload:
            mark_host_grads(self.params, comm)
            self.mark_host()

    # -- a step ---------------------------------------------------------------------------

    def before_backward(self, last: bool) -> None:
        """Before a micro-batch's backward (no pipeline): the last one reduces as it runs;
        stage 2 keeps its gathered parameters until then."""
        if self.stage == 2:
            for root in self.fsdp_roots:
                root.set_reshard_after_backward(last)
        if last:
            self.before_last_backward()

    def before_last_backward(self) -> None:
        if self._reduces is not None:
            self._reduces.arm()
        self.observe()  # parameters are gathered now (stage 2; stage 3: the last blocks)

    def finish_grads(self) -> None:
        """After the last backward: gradients reduced over dp x sp and in their
        parameters' tensor-parallel layout (FSDP did both already on stages 2 and 3)."""
        if self._reduces is not None:
            self._reduces.finish()
            self.observe()  # the reduced gradients exist beside the buffers now
        elif self.stage <= 1 and self.align is not None:
            self.align([p for p in self.params if p.grad is not None])

    def grad_of(self, p: torch.Tensor) -> torch.Tensor:
        if isinstance(self.optimizer, ShardedAdamW):  # its own (dist_opt.py) or ZeRO-1's
            return self.optimizer.grad_of(p)
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return _local(p.grad)

    def grad_parts(self, excluded: Iterable[torch.Tensor] = ()) -> list:
        skip = {id(p) for p in excluded}
        sharded = (DIM,) if self.stage >= 1 and self.comm.size(DIM) > 1 else ()
        return [GradPart(self.grad_of(p), sharded + ((TP,) if _tp_sharded(p) else ()),
                         id(p) not in skip)
                for p in self.params if self._has_grad(p)]

    def param_parts(self, excluded: Iterable[torch.Tensor] = ()) -> list:
        """This rank's pieces of the parameters, between steps, for their global norm:
        FSDP's shards (stages 2, 3) add up over dp x sp, tensor-parallel shards over tp;
        stages 0 and 1 hold whole (replicated) parameters."""
        skip = {id(p) for p in excluded}
        own = self.own  # its fp32 main weights, this rank's rows, are the parameters
        sharded = (DIM,) if (self.stage >= 2 or own) and self.comm.size(DIM) > 1 else ()
        return [GradPart(own.views[p] if own else _local(p).detach(),
                         sharded + ((TP,) if _tp_sharded(p) else ()), id(p) not in skip)
                for p in self.params]

    def _has_grad(self, p) -> bool:
        if self.own is not None:
            return self.own.has_grad(p)
        if self.stage == 1 and self.reducer is not None:
            return p in self.reducer.shard_grads
        return p.grad is not None

    def step(self) -> None:
        self.optimizer.step()
        self.mark_host()  # AdamW makes its states at the first step
        self.at_step = self.observe()  # gradients and optimizer states are all here now

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def settle(self) -> None:
        """Nothing left in flight (--overlap-param-gather's last gathers, at the end)."""
        if self.own is not None:
            self.own.wait_all()

    def reshard(self) -> None:
        """Free parameters gathered outside training steps (evaluation, stage 2/3)."""
        for m in self._fsdp:
            m.reshard()

    # -- memory -------------------------------------------------------------------------

    def held_bytes(self) -> dict:
        """Bytes of model states this rank holds now, from the tensors themselves (each
        storage once, at its allocated size, padding included): `params` (FSDP: the
        shards and any gathered copies still allocated), `grads` (ZeRO-1: also the
        reduced rows; FSDP: also unsharded gradients being accumulated), `optim`; under
        --zero-param-offload `host`: the shards, their gradients and AdamW's states
        (the other kinds then hold what is on the device)."""
        seen: set = set()
        # --zero-param-offload: the shards, their gradients and AdamW's states, first
        host = sum(_storage_bytes(t, seen) for t in host_tensors(self.params, self.optimizer)
                   if self.host_offload)
        params = sum(_storage_bytes(p, seen) for p in self.params)
        if self.own is not None:
            return {"params": params, **self.own.held_bytes(seen)}
        grads = sum(_storage_bytes(p.grad, seen) for p in self.params)
        for fp in self._fsdp_params():
            params += sum(_storage_bytes(t, seen) for t in fp.all_gather_outputs)
            unsharded = getattr(fp, "_unsharded_param", None)
            grads += _storage_bytes(getattr(unsharded, "grad", None), seen)
            grads += _storage_bytes(fp.unsharded_accumulated_grad, seen)
        if self.reducer is not None:
            grads += sum(_storage_bytes(g, seen) for g in self.reducer.shard_grads.values())
        optim = sum(_storage_bytes(v, seen) for state in self.optimizer.state.values()
                    for v in state.values() if isinstance(v, torch.Tensor))
        return {"params": params, "grads": grads, "optim": optim,
                **({"host": host} if self.host_offload else {})}

    def mark_host(self) -> None:
        """--zero-param-offload: the host's shards and states marked (zero_units.py)."""
        if self.host_offload:
            mark_host_states(self._fsdp_params(), self.optimizer)

    def observe(self) -> dict:
        self.mark_host()
        held = self.held_bytes()
        for kind, n in held.items():
            self.peak[kind] = max(self.peak.get(kind, 0), n)
        return held

    def pop_peak(self) -> dict:
        """The most bytes of each kind held at the observed moments since the last call."""
        out, self.peak = self.peak, {}
        return out

    def _fsdp_params(self):
        for m in self._fsdp:
            group = m._get_fsdp_state()._fsdp_param_group
            if group is not None:
                yield from group.fsdp_params


def _tp_sharded(p) -> bool:
    """Is `p` split over tensor-parallel ranks (as opposed to replicated on them)?"""
    if not isinstance(p, DTensor):
        return False
    names = p.device_mesh.mesh_dim_names
    if names is None:  # an unnamed mesh has no tensor-parallel dimension
        return False
    return any(pl.is_shard() or isinstance(pl, _StridedShard)
               for name, pl in zip(names, p.placements, strict=True) if name == TP)
