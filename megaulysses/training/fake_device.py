"""A fake accelerator for CI: a real Trainer on a device that is not the CPU.

On the CPU, a tensor made without `device=` lands where the model is, so a forgotten
`device=` passes every CPU test and fails only on a GPU. Here the trainer's device is
"fakeaccel", a Python-only PrivateUse1 device (torch's
`_setup_privateuseone_for_python_backend`), and every tensor is a `FakeTensor` (shapes,
dtypes and devices; no memory, no arithmetic). What fails as on CUDA:

- an op that meets a fakeaccel tensor and a CPU tensor (`FakeTensorDeviceMismatchError`;
  a 0-dim CPU tensor passes elementwise ops, as on CUDA, but not cat or stack);
- a collective on a CPU tensor (NCCL takes device tensors only);
- autocast: the matmuls and attention run in the 16-bit dtype, as CUDA's autocast casts
  them (a weight once per autocast region, as its cache does), so dtype mismatches there
  fail too.

What a step allocates is CUDA's too, where torch would otherwise decompose an op for want
of a device kernel (silu's backward: `OWN_BACKWARD_KERNELS`), so the live bytes of a fake
rank can be compared with the memory plan (training/fake_cuda.py).

    with fake_rank(rank=1, world=2):
        trainer = Trainer(parse_args(flags))     # everything on fakeaccel
        trainer.train()                          # forward, backward, optimizer steps

`fake_rank` joins torch's fake process group (every collective returns at once, its
buffers untouched) as one rank of the grid, so one process runs any rank of any grid, and
makes `training.device.pick_device()` answer fakeaccel. What it needs that torch does not
give:

- The device holds no data: the few real ops torch runs on it outside the fake mode
  (`torch.tensor(x, device=...)` makes a CPU tensor and copies it over in C++, then the
  fake mode wraps it) get an empty tensor, and the copy keeps the numbers on the CPU
  (`_register_ops`). The fake mode keeps no constants (`_FakeMode`): their real ops
  would need kernels the device does not have.
- `float(t)` / `t.item()` of a fake tensor: `_Values` answers from those numbers,
  carried through the ops that read only them (a NaN flag all-reduced over the fake
  group stays False), and 1 for any other tensor, so the step takes its normal path.
- Device meshes turn rank tensors into lists, and the trainer's meta GPT must be real meta
  tensors (`to_empty` swaps them, which torch refuses for the fake mode's): both are built
  with the fake mode off (`_outside_fake_mode`); so the fake mode accepts real tensors
  (they become fake ones: a real CPU tensor meeting a fakeaccel one still fails).

Not covered (no arithmetic, no real device): values and numerics, real collectives (the
fake group moves nothing, so ranks never meet and data-dependent branches take one path),
CUDA-only code (flash-attn, flex attention, NCCL itself, streams and their ordering,
`torch.cuda` memory statistics, peak-TFLOP/s timing), memory, and data-dependent shapes:
the CPU block attention kernel (masks on the CPU's `auto` backend, and the ring of context
parallelism) plans its blocks with `nonzero`, so it cannot run here.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import (FakeTensorDeviceMismatchError, FakeTensorMode,
                                           unset_fake_temporarily)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from megaulysses.training import device as devices

NAME = "fakeaccel"
_ops = None  # the torch.library registrations: they last as long as this object


def register() -> torch.device:
    """Make "fakeaccel" a device of this process (once; torch allows one PrivateUse1 name
    per process, so another name registered before is an error)."""
    from torch.utils import backend_registration as reg
    global _ops
    if _ops is not None:
        return torch.device(NAME)
    if torch._C._get_privateuse1_backend_name() not in ("privateuseone", NAME):
        raise RuntimeError(f"PrivateUse1 is {torch._C._get_privateuse1_backend_name()} "
                           f"already: no room for {NAME}")
    reg._setup_privateuseone_for_python_backend(NAME, backend_module=_Module())
    _ops = (_register_ops(), *_register_autocast())
    return torch.device(NAME)


class _Module:
    """torch.fakeaccel: what torch asks of a device's module (autocast: its dtypes; FSDP2:
    streams and events, one stream that never waits: the device runs nothing; the
    pipeline: a random generator, which has nothing to draw)."""

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def _is_in_bad_fork(self) -> bool:
        return False

    def manual_seed_all(self, seed: int) -> None:
        pass

    def get_rng_state(self, device=None) -> torch.Tensor:  # the pipeline forks the RNG
        return torch.empty(0, dtype=torch.uint8)

    def set_rng_state(self, state, device=None) -> None:
        pass

    def get_amp_supported_dtype(self) -> list:
        return [torch.float16, torch.bfloat16]

    def Stream(self, priority: int = 0) -> torch.Stream:  # noqa: N802 (torch.cuda's name)
        return torch.Stream(device=NAME, priority=priority)

    def Event(self, **kwargs) -> torch.Event:  # noqa: N802
        return torch.Event(device=NAME, **kwargs)

    def current_stream(self, device=None) -> torch.Stream:
        return torch.Stream(device=NAME)

    def stream(self, stream):
        return contextlib.nullcontext(stream)


def _register_ops() -> torch.library.Library:
    """Real fakeaccel tensors hold nothing: allocating one makes an empty tensor of the
    shape; copying a few CPU numbers into one keeps them beside it as its value
    (`torch.tensor(x, device=...)` copies in C++, outside the fake mode: `_Values`)."""
    lib = torch.library.Library("aten", "IMPL")

    def empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
        return torch._C._acc.create_empty_tensor(size, dtype or torch.get_default_dtype())

    def empty(size, dtype=None, layout=None, device=None, pin_memory=None,
              memory_format=None):
        return torch._C._acc.create_empty_tensor(size, dtype or torch.get_default_dtype())

    def copy_(self, src, non_blocking=False):
        if src.device.type == "cpu" and src.numel() <= VALUE_LIMIT:
            setattr(self, _VALUE, src.detach().clone())
        return self

    lib.impl("empty_strided", empty_strided, "PrivateUse1")
    lib.impl("empty.memory_format", empty, "PrivateUse1")
    lib.impl("copy_", copy_, "PrivateUse1")
    for name in OWN_BACKWARD_KERNELS:
        lib.impl(name, _empty_like_first, "PrivateUse1")
    return lib


# Ops with a backend kernel on CPU and CUDA and a CompositeImplicitAutograd decomposition:
# a device without the kernel gets the decomposition under autograd (sigmoid, 1 - s, and
# three products for silu's backward: temporaries CUDA never allocates). A kernel here
# gives autograd CUDA's path; under the fake mode only its meta function runs.
OWN_BACKWARD_KERNELS = ("silu_backward", "mish_backward")


def _empty_like_first(grad_output, *args):
    return torch.empty_like(grad_output)


# What CUDA's autocast runs in the 16-bit dtype (torch's list, less what a GPT never calls).
LOWER_PRECISION = ("mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "mv",
                   "addmv", "einsum", "scaled_dot_product_attention",
                   "_scaled_dot_product_flash_attention")


def _register_autocast() -> tuple:
    """Autocast on fakeaccel: the matmuls and attention in the autocast dtype, as CUDA's
    autocast casts them; every other op as it is (CUDA's also upcasts a few, such as
    softmax and layer_norm, to fp32: our model computes those in fp32 itself)."""
    key = "AutocastPrivateUse1"
    rest = torch.library.Library("_", "IMPL")
    rest.fallback(torch.library.fallthrough_kernel, key)
    lower = torch.library.Library("aten", "IMPL")
    for name in LOWER_PRECISION:
        lower.impl(name, _autocast_kernel(getattr(torch.ops.aten, name)), key,
                   with_keyset=True)
    return rest, lower


def _autocast_kernel(packet):
    skip = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)

    def kernel(keyset, *args, **kwargs):
        dtype = torch.get_autocast_dtype(NAME)

        def cast(a):  # as CUDA's: floating tensors of the device, not fp64
            eligible = isinstance(a, torch.Tensor) and a.device.type == NAME and \
                a.is_floating_point() and a.dtype != torch.float64
            if not eligible:
                return a
            if not (a.is_leaf and a.requires_grad and torch.is_autocast_cache_enabled()):
                return a.to(dtype)
            return _cached_cast(a, dtype)

        with torch._C._ExcludeDispatchKeyGuard(skip):
            return packet(*tree_map(cast, args), **tree_map(cast, kwargs))
    return kernel


# id(weight) -> (a weak reference to it, its cast): CUDA's autocast casts a leaf that
# requires grad (a weight) once per autocast region, however many matmuls (and pipeline
# micro-batches) read it; `torch.autocast` empties the cache when its outermost region
# ends (`torch.clear_autocast_cache`, wrapped in `fake_rank`).
_CASTS: dict = {}


def _cached_cast(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    hit = _CASTS.get(id(w))
    if hit is not None and hit[0]() is w and hit[1].dtype == dtype:
        return hit[1]
    cast = w.to(dtype)
    _CASTS[id(w)] = (weakref.ref(w), cast)
    return cast


@contextlib.contextmanager
def _autocast_cache():
    """Our autocast's cache emptied with torch's own."""
    clear = torch.clear_autocast_cache

    def clear_both():
        _CASTS.clear()
        clear()

    torch.clear_autocast_cache = clear_both
    try:
        yield
    finally:
        torch.clear_autocast_cache = clear
        _CASTS.clear()


class _FakeMode(FakeTensorMode):
    """No constants: a real op on a fakeaccel constant would need a kernel the device does
    not have (`_Values` keeps the values instead, on the CPU)."""

    def may_turn_const(self, t: torch.Tensor) -> bool:
        return False


class _Values(TorchDispatchMode):
    """What `float(t)` / `t.item()` of a fake tensor answers, as torch's fake constants
    would on the CPU. A tensor made from Python numbers (`torch.tensor(x, device=...)`:
    the trainer's token count and loss, `Comm.any_rank`'s flag) keeps them as a CPU tensor
    beside it, carried through every op whose tensors all have one (computed for real on
    the CPU; a collective leaves them as they are, as the fake group does); any other
    tensor answers 1 (True): a finite gradient norm, torch's pipeline warm-up voting for
    static shapes. So the step takes its normal path and the optimizer steps."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            return _item(args[0])
        if func.namespace in _COLLECTIVES:
            _check_collective(func, args, kwargs)
        elif func in _SAME_DEVICE:
            _check_same_device(func, args)
        out = func(*args, **kwargs)  # the fake op first: it checks the devices
        if func in FakeTensorMode.lift_fns:  # torch.tensor(...): args[0] is a real tensor
            _keep(out, _lifted_value(args[0]))
        else:
            _carry(func, args, kwargs, out)
        return out


VALUE_LIMIT = 64  # elements: values are numbers a step reads back, not its data
_VALUE = "_fake_device_value"
_COLLECTIVES = ("c10d", "_c10d_functional")
_SAME_DEVICE = (torch.ops.aten.cat.default, torch.ops.aten.stack.default)


def _check_collective(func, args, kwargs):
    """NCCL takes device tensors only; the fake mode runs a collective without asking the
    process group, so it would take a CPU tensor silently."""
    for t in tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor) and t.device.type != NAME:
            raise RuntimeError(f"{func}: a collective on a {t.device.type} tensor (shape "
                               f"{tuple(t.shape)}); NCCL takes {NAME} tensors only")


def _check_same_device(func, args):
    """The fake mode lets a 0-dim CPU tensor meet device tensors in any op, as CUDA's
    elementwise ops do; CUDA's cat refuses it (and stack, which is cat)."""
    devices = [t.device for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
    for other in devices[1:]:
        if other != devices[0]:
            raise FakeTensorDeviceMismatchError(func, devices[0], other)


def _item(t: torch.Tensor):
    value = getattr(t, _VALUE, None)
    if value is not None:
        with unset_fake_temporarily():
            return value.item()
    return True if t.dtype == torch.bool else 1.0 if t.is_floating_point() else 1


def _lifted_value(t: torch.Tensor):
    if t.device.type != "cpu":
        return getattr(t, _VALUE, None)
    with unset_fake_temporarily():
        return t.detach().clone()


def _keep(fake, value):
    if isinstance(fake, torch.Tensor) and isinstance(value, torch.Tensor) and \
            value.device.type == "cpu" and value.numel() <= VALUE_LIMIT:
        setattr(fake, _VALUE, value)


def _carry(func, args, kwargs, out):
    """The op on the values too, where every tensor it reads has one; else a tensor it
    writes loses its value (it is no longer known). Collectives change no value: the
    fake group leaves its buffers as they are."""
    tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    if not tensors or func.namespace in _COLLECTIVES:
        return  # a factory (torch.zeros, ...): no value, as no fake constant
    if not all(hasattr(t, _VALUE) for t in tensors):
        for t in _written(func, args, kwargs):
            if hasattr(t, _VALUE):
                delattr(t, _VALUE)
        return
    real_args, real_kwargs = tree_map(_to_value, (args, kwargs))
    with unset_fake_temporarily():
        real = func(*real_args, **real_kwargs)
    for fake, value in zip(tree_leaves(out), tree_leaves(real), strict=True):
        _keep(fake, value)


def _to_value(a):
    """A fake tensor's value; a device other than the CPU (a `.to(device)`): the CPU."""
    if isinstance(a, torch.Tensor):
        return getattr(a, _VALUE)
    if isinstance(a, torch.device) and a.type != "cpu":
        return torch.device("cpu")
    return a


def _written(func, args, kwargs) -> list:
    schema = func._schema.arguments
    # args may stop short of the schema (the rest keyword or defaulted): truncation intended
    named = dict(zip((a.name for a in schema), args, strict=False), **kwargs)
    return [t for a in schema if a.alias_info is not None and a.alias_info.is_write
            for t in tree_leaves(named.get(a.name)) if isinstance(t, torch.Tensor)]


@contextlib.contextmanager
def _outside_fake_mode():
    """Device meshes and the trainer's meta GPT are built with the fake mode off."""
    from torch.distributed.device_mesh import DeviceMesh
    from megaulysses.training import run as trainer  # the module that builds them
    mesh_init, build_mesh, gpt = DeviceMesh.__init__, trainer.build_mesh, trainer.GPT

    def real_mesh_init(self, *args, **kwargs):  # FSDP2 makes meshes too
        with unset_fake_temporarily():
            mesh_init(self, *args, **kwargs)

    def real_build_mesh(*args, **kwargs):
        with unset_fake_temporarily():
            return build_mesh(*args, **kwargs)

    def real_gpt(*args, **kwargs):
        with unset_fake_temporarily():
            return gpt(*args, **kwargs)

    DeviceMesh.__init__, trainer.build_mesh = real_mesh_init, real_build_mesh
    trainer.GPT = real_gpt
    try:
        yield
    finally:
        DeviceMesh.__init__, trainer.build_mesh = mesh_init, build_mesh
        trainer.GPT = gpt


@contextlib.contextmanager
def fake_rank(rank: int = 0, world: int = 1) -> Iterator[torch.device]:
    """This process as rank `rank` of `world` on the fake process group, every tensor fake,
    `pick_device()` the fake accelerator."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    device = register()
    dist.init_process_group(f"{NAME}:fake", store=FakeStore(), rank=rank,
                            world_size=world)
    try:
        with _outside_fake_mode(), _autocast_cache(), devices.use(device), \
                _FakeMode(allow_non_fake_inputs=True), _Values():
            yield device
    finally:
        dist.destroy_process_group()
