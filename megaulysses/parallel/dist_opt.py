"""Megatron-LM's distributed optimizer (--use-distributed-optimizer under --bf16/--fp16).

What each rank holds, per parameter of its model (P = dp x sp ranks, ZeRO's group):

    model weights      16-bit, whole (the tensors the forward uses: no autocast copies)   2
    gradient buffer    fp32, whole, bucketed (16-bit: --grad-reduce-in-bf16; under --fp16  4 / 2
                       unless --accumulate-allreduce-grads-in-fp32, as in Megatron-LM)
    main weights       fp32, this rank's rows                                             4/P
    Adam moments       fp32, this rank's rows                                             8/P
    main gradients     the buffer's own rows (fp32), or their fp32 copy (16-bit buffer)   0 / 4/P

that is Megatron-LM's 6 + 12/P bytes per parameter, or 4 + 16/P with 16-bit gradients.

A step: each linear layer adds its micro-batch's weight gradient into the buffer itself,
in the buffer's dtype (Megatron-LM's gradient-accumulation fusion, its default:
model/fused_linear.py hands x and the output gradient to `wgrad`; no 16-bit weight
gradient, no `.grad`). Every other gradient (and every one under
--no-gradient-accumulation-fusion, tensor parallelism or zero-bubble) is made by autograd
in 16 bits and added into the buffer at once (a post-accumulate hook; `.grad` is then
dropped). Either way gradients accumulate in the buffer's dtype. On the step's last
backward each bucket is
reduce-scattered in place as soon as its parameters are done; this rank's rows of the sum
are its main gradients. AdamW steps the main weights; their 16-bit roundings are
all-gathered back into every rank's model weights. The gather lands in the gradient
buffer, free between the optimizer step and the next backward, so no step allocates more
than the table above.

The buffer of a bucket is laid out by rank, `[P, section]`: row r holds rank r's rows
(`RowShard`) of every parameter of the bucket, zero-padded. Rows are the layout of every
ZeRO stage here, so the optimizer states (and the main weights, which checkpoints save as
the model's weights) are the same DTensors ZeRO-1 saves: a checkpoint written under either
loads under the other and under every other stage and grid.

Numerics: the forward sees the same 16-bit weights as ZeRO-1 under autocast (the rounding
of the same fp32 master); unfused, the fp32 buffer sums the same 16-bit gradients in the
same order, so the two train bit-identically (tested); fused, the linears' gradients
skip the 16-bit rounding of each micro-batch (closer to the exact sum: tested). With a
16-bit buffer the micro-batches' gradients are summed in 16 bits, as in Megatron-LM.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from megaulysses.model.fused_linear import linear_to_sink
from megaulysses.parallel.comm import Comm, Waitable
from megaulysses.parallel.dims import DP_SP
from megaulysses.parallel.grad_reduce import RowShard, _local, _make_buckets, _storage_bytes
from megaulysses.parallel.offload import HostState
from megaulysses.parallel.dist_opt_plan import (describe, fuses_weight_gradients,  # noqa: F401
                                                grad_buffer_dtype)
from megaulysses.parallel.wgrad import accumulate_wgrad, wgrad_backend  # noqa: F401
from megaulysses.parallel.zero import ShardedAdamW

DIM = DP_SP


class _Bucket:
    """Parameters whose gradients are reduce-scattered together, and their buffer."""

    def __init__(self, params: list, shards: dict, dtype: torch.dtype, device):
        self.params = params
        self.offsets, section = {}, 0
        for p in params:
            self.offsets[p] = section
            section += shards[p].padded_numel
        self.section = section
        ranks = shards[params[0]].ranks
        self.grads = torch.zeros(ranks, section, dtype=dtype, device=device)  # [P, section]
        self.ready = 0
        self.work: Optional[Waitable] = None  # the reduce-scatter in flight
        # (slots, work): the updated weights' all-gather not yet copied
        self.gather: Optional[tuple[torch.Tensor, Optional[Waitable]]] = None

    def by_rank(self, p, shard: RowShard) -> torch.Tensor:
        """`p`'s `[P, padded rows]` slots of the buffer (a view)."""
        off = self.offsets[p]
        return self.grads[:, off:off + shard.padded_numel]

    def scratch(self, dtype: torch.dtype) -> torch.Tensor:
        """The buffer's memory as `[P, section]` of `dtype` (no larger than the buffer):
        where the updated 16-bit weights are gathered."""
        flat = self.grads.view(-1).view(dtype)
        return flat[:self.grads.numel()].view(self.grads.shape)


def _to_dtype(p: torch.nn.Parameter, dtype: torch.dtype) -> None:
    """`p` in `dtype`, the object kept. A DTensor's `.data =` would leave its local tensor
    as it was: swapped whole instead (which a fake tensor's weak references refuse; plain
    parameters, all that benchmarks/fake_rank.py measures here, take `.data =`)."""
    if hasattr(p, "to_local"):
        torch.utils.swap_tensors(p, torch.nn.Parameter(p.detach().to(dtype)))
    else:
        p.data = p.data.to(dtype)


def _scatter_add(slots: torch.Tensor, flat: torch.Tensor) -> None:
    """slots [P, n] += the flat tensor cut into P pieces of n (the last ones shorter)."""
    n = slots.shape[1]
    full, rest = divmod(flat.numel(), n)
    if full:
        slots[:full].add_(flat[:full * n].view(full, n))
    if rest:
        slots[full, :rest].add_(flat[full * n:])


def _gather_into(flat: torch.Tensor, slots: torch.Tensor) -> None:
    """The inverse of `_scatter_add`, copying: flat = the first flat.numel() of slots."""
    n = slots.shape[1]
    full, rest = divmod(flat.numel(), n)
    if full:
        flat[:full * n].view(full, n).copy_(slots[:full])
    if rest:
        flat[full * n:].copy_(slots[full, :rest])


_WAITING: dict = {}  # module class -> its subclass whose weight reads wait (`attach`)


def _waiting_class(cls: type[torch.nn.Module]) -> type[torch.nn.Module]:
    """`cls` whose attribute reads of a parameter first finish that parameter's pending
    all-gather (the owner's `_gathers`, a DistributedOptimizer): same name, same behaviour."""
    if cls in _WAITING.values():
        return cls
    if cls not in _WAITING:
        def __getattr__(self, name: str):
            value = cls.__getattr__(self, name)  # parameters, buffers, submodules
            gathers = self.__dict__["_gathers"]
            if gathers.pending:
                gathers.wait_for((value,))
            return value
        _WAITING[cls] = type(cls.__name__, (cls,), {"__getattr__": __getattr__,
                                                    "__qualname__": cls.__qualname__,
                                                    "__module__": cls.__module__})
    return _WAITING[cls]


class DistributedOptimizer(ShardedAdamW):
    """AdamW on fp32 main rows of 16-bit model weights (module doc). To the trainer and
    checkpoints it is ZeRO-1's `ShardedAdamW` whose rows (`views`) are the main weights."""

    def __init__(self, groups: list[dict], comm: Comm, dtype: torch.dtype,
                 grad_dtype: torch.dtype, bucket_bytes: int,
                 make_adamw: Callable[[list[dict]], torch.optim.Optimizer],
                 align: Optional[Callable[[list], None]] = None,
                 offload: Optional[float] = None, overlap: bool = False):
        """`offload`: --optimizer-offload-fraction under --optimizer-cpu-offload (None:
        nothing on the host); `overlap`: --overlap-cpu-optimizer-d2h-h2d. `attach` makes
        the weights' all-gather overlap the next forward (--overlap-param-gather)."""
        self.comm, self.dtype, self.align = comm, dtype, align
        self.ranks, self.rank = comm.size(DIM), comm.rank(DIM)
        self.groups = [list(g["params"]) for g in groups]
        self.params = [p for g in self.groups for p in g]
        self.shards = {p: RowShard.of(_local(p), self.ranks, self.rank) for p in self.params}
        self.host = HostState(self.params, offload, overlap, _local(self.params[0]).device)
        # fp32 main rows, from the fp32 initial (or loaded) weights, before those go 16-bit
        self.views = {p: self.host.main(p, self.shards[p].mine(_local(p).detach()))
                      for p in self.params}
        for p in self.params:  # in place: the same Parameter objects, now 16-bit
            _to_dtype(p, dtype)
        device = _local(self.params[0]).device
        self.buckets = [_Bucket(b, self.shards, grad_dtype, device)
                        for b in _make_buckets(self.params, bucket_bytes / 2 ** 20)]
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.inner = make_adamw([{**g, "params": [self.views[p] for p in g["params"]]}
                                 for g in groups])
        self.main_grads: dict = {}  # param -> fp32 rows of its reduced gradient
        self.armed = False
        self.deferred = False  # --overlap-param-gather: gathers finish at first reads
        self.uses: dict = {}  # fused weight -> its forwards whose backward has not come
        self.pending = False  # some bucket's gather is not copied into the weights yet
        if self.host.params:  # Adam's moments on the host from the start, marked as such
            self._materialize_state()
            self.host.mark_states(self.inner.state, self.views)
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._accumulate)

    # -- gradients --------------------------------------------------------------------------

    def _accumulate(self, p) -> None:
        """Autograd's gradient of `p` (16-bit) into the buffer; on the last backward, a
        bucket whose parameters are all in is reduce-scattered at once."""
        if p.grad is None:  # a fused linear's weight (`wgrad`): autograd gave it nothing
            return
        if self.pending:  # a weight no forward used: its bucket's gather ends here
            self.wait_all()
        if self.align is not None:
            self.align([p])
        bucket = self.bucket_of[p]
        _scatter_add(bucket.by_rank(p, self.shards[p]), _local(p.grad).reshape(-1))
        p.grad = None
        self._ready(p)

    def _ready(self, p) -> None:
        """`p`'s gradient is all in the buffer: on the last backward, a bucket whose
        parameters are all in is reduce-scattered at once."""
        if self.armed:
            bucket = self.bucket_of[p]
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._launch(bucket)

    # -- gradient-accumulation fusion (model/fused_linear.py calls these) -------------

    def fuse_weight_gradients(self, model: torch.nn.Module) -> list:
        """Megatron-LM's gradient-accumulation fusion: every plain `nn.Linear` whose weight
        this optimizer holds (tensor-parallel DTensor weights keep autograd's path) adds
        its weight gradient into the buffer itself, in the buffer's dtype (fp32: no 16-bit
        rounding, no `.grad`). Returns the fused modules."""
        fused = [m for m in model.modules() if isinstance(m, torch.nn.Linear)
                 and m.weight in self.bucket_of and not hasattr(m.weight, "to_local")]
        for m in fused:  # an instance attribute shadows the class's forward
            m.forward = functools.partial(self._fused_forward, m)  # type: ignore[method-assign]
        self.uses = {m.weight: 0 for m in fused}
        return fused

    def _fused_forward(self, m: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """A fused linear's forward: its weight gradient comes here (`wgrad`)."""
        return linear_to_sink(x, m.weight, m.bias, self)

    def used(self, p) -> None:
        """A forward used `p` (not a recomputation): one more weight gradient to come."""
        self.uses[p] += 1

    def wgrad(self, p, x: torch.Tensor, g: torch.Tensor) -> None:
        """One use's weight gradient of `p` [out, in] = g^T x (x [T, in], g [T, out]),
        added into `p`'s slots of the buffer: each rank's rows of it into that rank's slot
        (`RowShard`), by `wgrad.accumulate_wgrad`; `p` is ready when its last use is in."""
        if self.pending:  # as `_accumulate`
            self.wait_all()
        shard, slots = self.shards[p], self.bucket_of[p].by_rank(p, self.shards[p])
        rows, cols = shard.shape[0], shard.row_numel
        for r in range(self.ranks):
            lo, hi = min(r * shard.chunk, rows), min((r + 1) * shard.chunk, rows)
            if hi > lo:
                accumulate_wgrad(slots[r, :(hi - lo) * cols].view(hi - lo, cols),
                                  g[:, lo:hi], x)  # [rows of rank r, in]
        self.uses[p] -= 1
        if self.uses[p] == 0:
            self._ready(p)

    def take(self, p, grad: torch.Tensor) -> None:
        """One use's gradient of `p`, handed over by `layers.compute_weight` (`grad_sink`):
        into the buffer now. The bucket's count waits for `p`'s own hook (its other use)."""
        p.grad = grad
        was, self.armed = self.armed, False
        self._accumulate(p)
        self.armed = was

    def flush(self) -> None:
        """Gradients autograd did not hand to the hook (zero-bubble's weight pass assigns
        them): into the buffer now."""
        for p in self.params:
            if p.grad is not None:
                self.take(p, p.grad)

    def arm(self) -> None:
        """Before the step's last backward: reduce buckets as they complete."""
        self.armed = True
        for b in self.buckets:
            b.ready = 0

    def _launch(self, bucket: _Bucket) -> None:
        if self.ranks > 1:
            bucket.work = self.comm.reduce_scatter_flat(bucket.grads[self.rank],
                                                        bucket.grads.view(-1), DIM,
                                                        async_op=True)

    def finish(self) -> None:
        """After the last backward: every bucket reduced; the main gradients are this
        rank's rows of the sums (fp32)."""
        self.flush()
        for b in self.buckets:
            if b.work is None:
                self._launch(b)
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None
            mine = b.grads[self.rank]  # [section]
            for p in b.params:
                rows = self.shards[p].unpack(mine[b.offsets[p]:])
                self.main_grads[p] = self.host.grad(p, rows)
        self.host.arrived()
        self.armed = False
        self.uses = dict.fromkeys(self.uses, 0)  # a forward without backward counts no more

    def grad_of(self, p: torch.Tensor) -> torch.Tensor:
        return self.main_grads[p]

    def has_grad(self, p: torch.Tensor) -> bool:
        return p in self.main_grads

    # -- the step -------------------------------------------------------------------------

    def step(self) -> None:
        for p, main in self.views.items():
            main.grad = self.main_grads[p]
        self.inner.step()
        for main in self.views.values():
            main.grad = None
        self.main_grads.clear()  # the buffer's rows are overwritten by the gather next
        self.publish(defer=self.deferred)

    def publish(self, defer: bool = False) -> None:
        """The main weights, rounded to 16 bits, into every rank's model weights: each
        rank's rows gathered in the gradient buffer of their bucket, launched in the
        order the forward needs them. `defer`: each is finished (waited for and copied)
        by the first forward that uses a weight of it, not here."""
        for b in reversed(self.buckets):  # buckets are in backward order
            slots = b.scratch(self.dtype)  # [P, section] 16-bit
            for p in b.params:  # this rank's slot; its padding is never read back
                off = b.offsets[p]
                slots[self.rank, off:off + self.shards[p].numel].copy_(
                    self.views[p].reshape(-1), non_blocking=self.host.overlap)
            work = (self.comm.all_gather_flat(slots.view(-1), slots[self.rank], DIM,
                                              async_op=True) if self.ranks > 1 else None)
            b.gather = (slots, work)
        self.pending = True
        if not defer:
            self.wait_all()

    def _finish_gather(self, b: _Bucket, slots: torch.Tensor, work: Optional[Waitable]) -> None:
        """`b`'s gather (`b.gather`: `slots`, `work`) waited for, copied into the weights."""
        b.gather = None
        if work is not None:
            work.wait()
        for p in b.params:
            off = b.offsets[p]
            _gather_into(_local(p).detach().view(-1),
                         slots[:, off:off + self.shards[p].padded_numel])
        b.grads.zero_()

    def wait_for(self, params) -> None:
        """Before a forward uses `params`: their buckets' gathers finished."""
        if self.pending:
            for p in params:
                b = self.bucket_of.get(p)
                if b is not None and b.gather is not None:
                    self._finish_gather(b, *b.gather)

    def wait_all(self) -> None:
        for b in reversed(self.buckets):
            if b.gather is not None:
                self._finish_gather(b, *b.gather)
        self.pending = False

    def attach(self, model: torch.nn.Module) -> None:
        """--overlap-param-gather: the first read of a weight, wherever the model reads it,
        finishes its bucket's gather (that bucket's only); the gathers run until then.

        Not a module pre-hook: the head's loss reads `output.weight` (or the tied
        `embed.word.weight`) without calling that module. Every read of a parameter goes
        through its module's attribute (parameters live in `_parameters`, so
        `nn.Module.__getattr__` serves each `module.weight`): each module holding weights
        gets a subclass of its class whose `__getattr__` waits first, as torch's own
        parametrize and FSDP2 extend a module's class."""
        self.deferred = True
        for m in model.modules():
            if next(m.parameters(recurse=False), None) is not None:
                m.__class__ = _waiting_class(type(m))
                m.__dict__["_gathers"] = self

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)
        for p in self.params:
            p.grad = None
        self.main_grads.clear()
        for b in self.buckets:
            if b.gather is None:  # a gather in flight zeroes its bucket when copied
                b.grads.zero_()

    # -- checkpoints: the main weights are the model's weights ------------------------------

    def model_state_dict(self, fqns: dict) -> dict:
        """{"<name>": fp32 DTensor of the main rows, global shape}: the weights a
        checkpoint keeps (loads under any stage and grid)."""
        return {fqns[p]: self._as_dtensor(p, self.views[p]) for p in self.params}

    def load_model_state_dict(self, state: dict, fqns: dict) -> None:
        """After DCP filled `model_state_dict`'s tensors: main rows, then model weights."""
        for p in self.params:
            self.views[p].copy_(_local(state[fqns[p]]))
        self.publish()

    # -- memory -----------------------------------------------------------------------------

    def held_bytes(self, seen: set) -> dict:
        """Bytes of the buffers and main state (each storage once): grads (buffers and
        main gradients), optim (main weights and moments)."""
        host = self.host.held_bytes(seen, self.inner.state, self.views)
        grads = sum(_storage_bytes(b.grads, seen) for b in self.buckets)
        grads += sum(_storage_bytes(g, seen) for g in self.main_grads.values())
        optim = sum(_storage_bytes(v, seen) for v in self.views.values())
        optim += sum(_storage_bytes(v, seen) for state in self.inner.state.values()
                     for v in state.values() if isinstance(v, torch.Tensor))
        return {"grads": grads, "optim": optim, **({"host": host} if self.host.params else {})}
