"""Peak live tensor bytes on any device: the CPU counterpart of
`torch.cuda.max_memory_allocated`, counted from tensor storages.

    with LiveBytes() as mem:
        with mem.phase("forward"):
            loss = model(x).sum()
        with mem.phase("backward"):
            loss.backward()
    mem.peak, mem.peak_by_label   # bytes; {"forward": ..., "backward": ...} at that moment

What is counted: every storage that an op dispatched on this thread while the tracker is
active *allocates* (its output is not an alias of an input: the op schema says so for
aten ops; other namespaces, such as c10d's, are checked against their inputs), at the
storage's `nbytes`, once however many views, in-place ops or tensors share it, until the
storage dies. It is a `TorchDispatchMode`, so it sees what autograd's backward (which runs
on the calling thread on CPU), `torch.utils.checkpoint`'s recomputation, DTensor's local
ops (DTensor itself is skipped: its local tensors are what hold memory), FSDP2 and c10d
collectives (their output buffers come from `torch.empty`) allocate. FSDP2 frees and
re-allocates its unsharded parameters with `UntypedStorage.resize_`, which is not
dispatched: while a tracker is active that method is wrapped, so a tracked storage
changes size and an untracked one that grows from 0 bytes is tracked from then on.

Devices: all (cpu, cuda, meta). Under `FakeTensorMode` (enter it first, then the tracker)
the fake tensors' meta storages are counted, so a step can be measured without memory or
arithmetic. The fake tensors DTensor's sharding propagation makes (a fresh FakeTensorMode,
or the active one entered again) are not counted: they are shape arithmetic, not memory.

Not counted: storages allocated before the tracker started (parameters, optimizer states
of earlier steps), unless they are resized from 0 bytes while it runs; use
`storage_bytes(tensors)` for those, and add them to `peak` for a rank's whole footprint.
Nor what lives only inside one kernel call and is no tensor (oneDNN scratchpads, a native
kernel's own temporaries, Python numbers wrapped as 0-dim tensors): on CPU `peak` is the
allocator's high-water mark less those (tests/training/test_live_bytes.py compares them).

Host memory: storages marked by `parallel.host_memory.mark_host` (an offload's copies in
host memory, which on a CPU-only machine is the same memory as the "device") are counted in
`host_current` / `host_peak`, never in `current` / `peak`; `storage_bytes(..., host=)`
splits what exists already the same way.

A storage's death is seen through a weak reference to its Python object, which PyTorch
keeps alive as long as any C++ owner (a tensor saved by autograd, a pending collective)
holds the storage: a tensor referenced only by the autograd graph stays counted until
backward frees it, and a collective's buffer until the backend lets go of it (gloo's
worker thread may do so just after `wait()` returns).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Iterable, Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megaulysses.parallel.host_memory import is_host_storage, listen

_FAKE_KEY = torch._C._TorchDispatchModeKey.FAKE
HOST = "host"  # the label of storages marked as host memory (parallel/host_memory.py)
_WAIT: Optional[torch._ops.OpOverload]
try:
    _WAIT = torch.ops._c10d_functional.wait_tensor.default
except (AttributeError, RuntimeError):  # a build without torch.distributed
    _WAIT = None
_PLAIN = (torch.Tensor, torch.nn.Parameter)

# func -> (tuple: is return i a fresh allocation per the schema, bool: check inputs too)
_FRESH: dict = {}


def _returns_info(func):
    info = _FRESH.get(func)
    if info is None:
        schema = func._schema
        fresh = tuple(r.alias_info is None for r in schema.returns)
        info = _FRESH[func] = (fresh, func.namespace != "aten")
    return info


def _has_storage(t: torch.Tensor) -> bool:
    """Plain tensors and FakeTensor have a storage of their own; wrapper subclasses
    (DTensor, ...) have inner tensors, counted when those were created."""
    return type(t) in _PLAIN or not hasattr(type(t), "__tensor_flatten__")


class _Record:
    __slots__ = ("nbytes", "label", "ref")
    nbytes: int
    label: str
    ref: weakref.ref


class LiveBytes(TorchDispatchMode):
    """Bytes of live tensor storages allocated while active (see the module doc).

    `current`, `peak` (bytes), `reset_peak()`; `phase(label)` labels what is allocated
    inside it (the label stays with the storage until it dies); `current_by_label` and
    `peak_by_label` break those two figures down (storages allocated outside any phase
    are under `label`'s initial value, "other"). Usable more than once; nested trackers
    each count independently.
    """

    def __init__(self, label: str = "other", count_meta: bool = True):
        super().__init__()
        self.label = label
        # False: plain meta tensors (a model built on the meta device: shapes, no memory)
        # are not counted; fake tensors still are.
        self.count_meta = count_meta
        self.current = 0
        self.peak = 0
        self.host_current = 0  # storages marked as host memory (`mark_host`), apart
        self.host_peak = 0
        self.current_by_label: dict = {}
        self.peak_by_label: dict = {}
        self._live: dict = {}  # id(untyped storage) -> _Record
        self._lock = threading.Lock()
        self._fake = None  # the FakeTensorMode active at entry, if any
        self._fake_depth = 0

    # -- public -------------------------------------------------------------------------

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.current
            self.peak_by_label = dict(self.current_by_label)

    @contextlib.contextmanager
    def phase(self, label: str) -> Iterator[LiveBytes]:
        before, self.label = self.label, label
        try:
            yield self
        finally:
            self.label = before

    @property
    def storages(self) -> int:
        """How many tracked storages are alive now."""
        return len(self._live)

    # -- mode ---------------------------------------------------------------------------

    def __enter__(self):
        self._fake = torch._C._get_dispatch_mode(_FAKE_KEY)
        self._fake_depth = len(self._fake.enter_stack) if self._fake is not None else 0
        _patch_resize(self)
        listen(self._to_host, True)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            _unpatch_resize(self)
            listen(self._to_host, False)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in types:
            if t not in _PLAIN and hasattr(t, "__tensor_flatten__"):
                return NotImplemented  # DTensor & co: let them run their local ops
        if func is _WAIT and _WAIT is not None and self._fake is not None:
            # Eager wait_tensor returns its input; the fake kernel a new tensor with a
            # storage of its own, which would count the collective's output twice.
            return args[0]
        out = func(*args, **(kwargs or {}))
        fake = torch._C._get_dispatch_mode(_FAKE_KEY)
        if fake is not self._fake or (fake is not None
                                      and len(fake.enter_stack) != self._fake_depth):
            return out  # DTensor's sharding propagation: not memory
        fresh, check_inputs = _returns_info(func)
        if isinstance(out, torch.Tensor):
            self._see(out, fresh[0] if fresh else True, check_inputs, args, kwargs)
        elif isinstance(out, (tuple, list)):
            single = len(fresh) == 1  # one list return (Tensor[]): its flag for all
            for i, o in enumerate(out):
                is_fresh = fresh[0] if single else (fresh[i] if i < len(fresh) else True)
                if isinstance(o, torch.Tensor):
                    self._see(o, is_fresh, check_inputs, args, kwargs)
                elif isinstance(o, (tuple, list)):
                    for x in o:
                        if isinstance(x, torch.Tensor):
                            self._see(x, is_fresh, check_inputs, args, kwargs)
        return out

    # -- bookkeeping --------------------------------------------------------------------

    def _see(self, t: torch.Tensor, fresh: bool, check_inputs: bool, args, kwargs):
        if not _has_storage(t) or (not self.count_meta and t.device.type == "meta"):
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, nested, ...: not counted
            return
        rec = self._live.get(id(st))
        if rec is not None:
            if rec.nbytes != st.nbytes():  # resized by an out= or resize_ op
                self._resize(rec, st.nbytes())
            return
        if not fresh:
            return  # a view of, or in place on, a storage from before the tracker
        if check_inputs and any(isinstance(x, torch.Tensor) and _has_storage(x)
                                and x.untyped_storage() is st
                                for x in tree_leaves((args, kwargs))):
            return  # an unannotated in-place op (c10d) on an untracked storage
        self._add(st)

    def _add(self, st):
        rec = _Record()
        rec.nbytes, rec.label = st.nbytes(), HOST if is_host_storage(id(st)) else self.label
        key = id(st)
        rec.ref = weakref.ref(st, lambda _, key=key: self._free(key))
        with self._lock:
            self._live[key] = rec
            self._change(rec.label, rec.nbytes)

    def _free(self, key: int):
        with self._lock:
            rec = self._live.pop(key, None)
            if rec is not None:
                self._change(rec.label, -rec.nbytes)

    def _resize(self, rec: _Record, nbytes: int):
        with self._lock:
            delta, rec.nbytes = nbytes - rec.nbytes, nbytes
            self._change(rec.label, delta)

    def _on_resize(self, st, before: int, after: int):
        rec = self._live.get(id(st))
        if rec is not None:
            if rec.nbytes != after:
                self._resize(rec, after)
        elif before == 0 and after > 0:
            self._add(st)  # FSDP2 re-allocating an unsharded parameter: memory from now

    def _to_host(self, key: int):
        """A tracked storage just marked as host memory: counted there from now on."""
        with self._lock:
            rec = self._live.get(key)
            if rec is not None and rec.label != HOST:
                self._change(rec.label, -rec.nbytes)
                rec.label = HOST
                self._change(HOST, rec.nbytes)

    def _change(self, label: str, delta: int):  # under the lock
        if label == HOST:
            self.host_current += delta
            self.host_peak = max(self.host_peak, self.host_current)
            return
        self.current += delta
        self.current_by_label[label] = self.current_by_label.get(label, 0) + delta
        if self.current > self.peak:
            self.peak = self.current
            self.peak_by_label = dict(self.current_by_label)


# -- UntypedStorage.resize_ is not dispatched: wrapped while any tracker is active -------

_ACTIVE: list = []
_ORIGINAL_RESIZE = torch.UntypedStorage.resize_


def _tracking_resize(st, size):
    before = st.nbytes()
    out = _ORIGINAL_RESIZE(st, size)
    after = st.nbytes()
    if before != after:
        for tracker in list(_ACTIVE):
            tracker._on_resize(st, before, after)
    return out


def _patch_resize(tracker: LiveBytes):
    if not _ACTIVE:
        torch.UntypedStorage.resize_ = _tracking_resize  # type: ignore[method-assign]
    _ACTIVE.append(tracker)


def _unpatch_resize(tracker: LiveBytes):
    if tracker in _ACTIVE:
        _ACTIVE.remove(tracker)
    if not _ACTIVE:
        torch.UntypedStorage.resize_ = _ORIGINAL_RESIZE  # type: ignore[method-assign]


# -- storages that exist already ------------------------------------------------------------

def storage_bytes(tensors: Iterable[Optional[torch.Tensor]],
                  host: Optional[bool] = None) -> int:
    """Bytes of the distinct storages behind `tensors` (None skipped; a DTensor counts its
    local tensor; each storage once, at its current size): what a rank already holds
    (parameters, gradients, optimizer states) before a tracker starts. `host`: only the
    storages marked as host memory (True), only the others (False), all (None)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):
            t = t.to_local()
        elif not _has_storage(t):
            continue
        st = t.untyped_storage()
        if host is not None and is_host_storage(id(st)) != host:
            continue
        if id(st) not in seen:
            seen.add(id(st))
            total += st.nbytes()
    return total


def step_peak(trainer) -> tuple[int, dict]:
    """A real Trainer's second step measured: the bytes held on the device before it
    (parameters, buffers, optimizer states, the distributed optimizer's buffers and main
    weights, the step's micro-batches, pipeline receive buffers) + the peak live bytes the
    step allocated; and the bytes it sent per (group, collective kind). The first step
    makes AdamW's states. What the memory plan is compared with
    (tests/parallel/test_memory_plan.py, training/fake_cuda.py)."""
    import gc

    import megaulysses.training.step as tr
    t = trainer.cfg.train

    def step(batches):
        tr.train_step(trainer.model, batches, trainer.zero, trainer.scaler, t.clip_grad,
                      trainer.device, trainer.dtype, trainer.comm, trainer.pipeline)

    step(trainer.train_data.micro_batches(0))
    batches = trainer.train_data.micro_batches(t.global_batch_size)
    if trainer.zero is not None:  # --zero-param-offload: AdamW's new states are the host's
        trainer.zero.mark_host()
    opt = trainer.optimizer
    states = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    own = [b.grads for b in getattr(opt, "buckets", [])] + list(
        getattr(opt, "views", {}).values())
    held = storage_bytes(list(trainer.model.parameters()) + list(trainer.model.buffers())
                         + states + own + [v for b in batches for v in b.values()]
                         + _pipeline_buffers(trainer.pipeline),
                         host=False)  # the device's: an offload's host copies apart
    gc.collect()
    trainer.comm.stats.pop()
    with LiveBytes() as mem:
        step(batches)
    return held + mem.peak, trainer.comm.stats.pop(by_group=True)


def _pipeline_buffers(pipeline) -> list:
    """The pipeline stages' receive buffers held between steps (torch's own stage keeps
    one per micro-batch and direction; parallel/pipeline.py's none)."""
    if pipeline is None:
        return []
    infos = [i for stage in pipeline.stages
             for table in (stage.args_recv_info, stage.grad_recv_info)
             for per_micro in table.values() for i in per_micro]
    return [getattr(i, "buffer", None) for i in infos]
