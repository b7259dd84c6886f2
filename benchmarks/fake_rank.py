"""One rank's training step at any grid, in one process, without memory or arithmetic:
its peak live tensor bytes (a feasibility prototype for issue 12's benchmark).

    python benchmarks/fake_rank.py --world 8 -- <pretrain_gpt.py flags>
    python benchmarks/fake_rank.py --world 8 --ranks all --compare-real -- <flags>

The process joins torch's fake process group (`FakeStore`, backend "fake": every
collective returns at once, its output buffers untouched) as each of `--ranks` of
`--world` in turn, builds the real `Trainer` under `FakeTensorMode` (every tensor is
shapes only), and runs exactly the trainer's `train_step`, the last of `--steps` inside
`LiveBytes` (with `--steps 2` AdamW's states exist before it, as in a running job). It
prints what the rank held before the step (parameters and buffers, optimizer states and
the distributed optimizer's main weights and gradient buffers, its micro-batches) and
the peak bytes the step allocated on top, broken down by phase: "data" (token count, the
batches moved), "forward" (what a forward keeps for backward, and its transients),
"backward" (gradients, their temporaries), "optimizer" (gradient reduction buffers, the
norm, AdamW's states: the first step creates them).

`--compare-real` also runs the same step on `--world` real gloo ranks (spawned, same
harness, same counting) and prints both per rank: the fake run is only worth having if
they agree.

Three things of the trainer do not run under fake tensors as they are; this script
patches them from outside (the megaulysses changes that would make the patches unnecessary
are listed in the report on issue 12):

1. `dims.build_mesh`: `init_device_mesh` turns its rank tensor into Python lists
   (`tolist()`): built with the fake mode switched off (the mesh holds no model data).
2. The trainer builds the GPT on the meta device and `parallelize` materializes it with
   `Module.to_empty`; for fake parameters that goes through `torch.utils.swap_tensors`,
   which refuses tensors the fake mode holds weak references to. Here the GPT is built on
   the real device (fake: no memory) and `to_empty` is skipped for modules whose
   parameters are all fake already.
3. `float(tensor)` / `.item()` of a fake tensor (the token count, the loss sum, the
   gradient norm: `train_step`, `global_sum`, `parallel/grad_norm.py`, the pipeline's loss): a
   dispatch mode answers every data-dependent scalar with 1 (1.0, True), so the step takes
   its normal path (the norm is finite, the optimizer steps and creates its states).

Everything else runs unchanged on the fake group: DTensor (tensor parallelism, the
vocab-parallel loss), FSDP2 (ZeRO-2/3), ZeRO-0/1's bucketed reductions, the Ulysses
all-to-alls, the pipeline schedules, recomputation, autocast. (The trainer's start-up log
of held parameter bytes is wrong under fake tensors: `zero._storage_bytes` tells storages
apart by `data_ptr()`, which is 0 for every fake or meta storage.) The phases are set by
hooks on the model's forward, so under pipeline parallelism (stages run submodules) all
of a step is "data".
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MIB = 2 ** 20
PHASES = ("data", "forward", "backward", "optimizer")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n")[:2]),
                                usage="%(prog)s [options] -- <pretrain_gpt.py flags>")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--ranks", default="0", help="'all' or comma-separated ranks to fake")
    p.add_argument("--compare-real", action="store_true",
                   help="also run the step on --world real gloo ranks")
    p.add_argument("--steps", type=int, default=1,
                   help="train this many steps, measure the last (2: AdamW's states exist)")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--verbose", action="store_true", help="the trainer's log lines")
    argv = sys.argv[1:] if argv is None else list(argv)
    ours, flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [])
    args = p.parse_args(ours)
    args.flags = flags
    args.rank_list = (list(range(args.world)) if args.ranks == "all"
                      else [int(r) for r in args.ranks.split(",")])
    return args


# -- one step, counted (the same harness for fake and real ranks) --------------------------

def measure_step(trainer, steps: int = 1) -> dict:
    """Run the trainer's train_step on `steps` global batches, the last inside LiveBytes
    (from the second on, AdamW's states exist before the step: a running job's state)."""
    import megaulysses.training.step as tr
    from megaulysses.training.live_bytes import LiveBytes, storage_bytes
    t = trainer.cfg.train
    for i in range(steps - 1):
        tr.train_step(trainer.model, trainer.train_data.micro_batches(i * t.global_batch_size),
                      trainer.zero, trainer.scaler, t.clip_grad, trainer.device, trainer.dtype,
                      trainer.comm, trainer.pipeline)
    batches = trainer.train_data.micro_batches((steps - 1) * t.global_batch_size)
    if trainer.zero is not None:  # --zero-param-offload: AdamW's new states are the host's
        trainer.zero.mark_host()
    opt = trainer.optimizer
    optim_states = [v for s in opt.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor)]
    # the distributed optimizer's main weights and gradient buffers, held between steps
    # too; what --optimizer-cpu-offload keeps on the host is not device memory
    if hasattr(opt, "buckets"):  # (ZeRO-1's rows are views of the parameters)
        optim_states += list(opt.views.values()) + [b.grads for b in opt.buckets]
    params = list(trainer.model.parameters()) + list(trainer.model.buffers())
    held = {"params": storage_bytes(params, host=False),  # --zero-param-offload's: host
            "optim": storage_bytes(optim_states, host=False),
            "batches": storage_bytes(v for b in batches for v in b.values())}
    mem = LiveBytes(label="data")
    hooks = [trainer.model.register_forward_pre_hook(lambda *_: _set(mem, "forward"),
                                                     prepend=True),  # before FSDP's
             trainer.model.register_forward_hook(lambda *_: _set(mem, "backward"))]
    finish = tr._finish_grads_and_step

    def finish_labelled(*a, **k):
        with mem.phase("optimizer"):
            return finish(*a, **k)

    tr._finish_grads_and_step = finish_labelled
    try:
        gc.collect()
        start = time.perf_counter()
        with mem:
            tr.train_step(trainer.model, batches, trainer.zero, trainer.scaler, t.clip_grad,
                          trainer.device, trainer.dtype, trainer.comm, trainer.pipeline)
            seconds = time.perf_counter() - start
            after = mem.current
    finally:
        tr._finish_grads_and_step = finish
        for h in hooks:
            h.remove()
    # host memory (never in the peak): offloaded parameters and optimizer states, the most activations
    # --cpu-offloading-num-layers had on the host at once
    host = storage_bytes(optim_states + params, host=True) + mem.host_peak
    return {"held": held, "peak": mem.peak, "by_phase": dict(mem.peak_by_label),
            "after": after, "seconds": seconds, "host": host}


def _set(mem, label):
    mem.label = label


# -- fake ranks ------------------------------------------------------------------------------

class _Scalars(torch.utils._python_dispatch.TorchDispatchMode):
    """Answers data-dependent scalars of fake tensors (`float(t)`, `t.item()`) with 1."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
            t = args[0]
            if isinstance(t, FakeTensor):
                if t.constant is not None:  # small tensors made from Python numbers
                    with unset_fake_temporarily():
                        return t.constant.item()
                return True if t.dtype == torch.bool else 1.0 if t.is_floating_point() else 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _fake_patches():
    """Patches 1 and 2 of the module doc, undone on exit."""
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
    import megaulysses.training.run as tr  # the module that builds the mesh and the GPT
    from torch.distributed.device_mesh import DeviceMesh
    build_mesh, gpt, to_empty = tr.build_mesh, tr.GPT, torch.nn.Module.to_empty
    mesh_init = DeviceMesh.__init__

    def real_mesh(dims, device_type, timeout=None):
        with unset_fake_temporarily():
            return build_mesh(dims, device_type, timeout)

    def real_mesh_init(self, *args, **kwargs):  # FSDP2 over a 2-D (dp_sp, tp) mesh makes one
        with unset_fake_temporarily():
            mesh_init(self, *args, **kwargs)

    def gpt_on_device(cfg, core):
        with torch.device("cpu"):  # inside the trainer's torch.device("meta"): wins
            return gpt(cfg, core)

    def to_empty_unless_fake(self, *, device, recurse=True):
        local = (getattr(p, "_local_tensor", p) for p in self.parameters())
        if all(isinstance(p, FakeTensor) for p in local):
            return self
        return to_empty(self, device=device, recurse=recurse)

    tr.build_mesh, tr.GPT = real_mesh, gpt_on_device
    torch.nn.Module.to_empty, DeviceMesh.__init__ = to_empty_unless_fake, real_mesh_init
    try:
        with _p2p_held_until_wait():
            yield
    finally:
        tr.build_mesh, tr.GPT = build_mesh, gpt
        torch.nn.Module.to_empty, DeviceMesh.__init__ = to_empty, mesh_init


class _HeldWork:
    """A fake Work that keeps its tensors for as long as it lives, as a gloo Work does
    (waited or not): torch's 1F1B keeps its last warm-up send's Work, so the activation
    it sent stays allocated until the schedule returns."""

    def __init__(self, work, tensors):
        self.work, self.tensors = work, tensors

    def wait(self, *args, **kwargs):
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.work, name)


@contextlib.contextmanager
def _p2p_held_until_wait():
    """Point-to-point ops as the fake group runs them (done at once, nothing moved), their
    Works holding the tensors. Not dispatched to the group: under the fake mode each op
    cost ~1 ms of Python dispatch, a quarter of a 32-way ring rank's time (a pass a step)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch._C._distributed_c10d import FakeWork
    isend, irecv, batch = c10d.isend, c10d.irecv, c10d.batch_isend_irecv

    def held_isend(tensor, *args, **kwargs):
        return _HeldWork(FakeWork(), [tensor])

    def held_irecv(tensor, *args, **kwargs):  # not isend's: ops are told apart by it
        return _HeldWork(FakeWork(), [tensor])

    def held_batch(ops):
        return [_HeldWork(FakeWork(), [op.tensor]) for op in ops]

    patched = {"isend": held_isend, "irecv": held_irecv, "batch_isend_irecv": held_batch}
    for name, fn in patched.items():
        setattr(c10d, name, fn)
        setattr(dist, name, fn)
    try:
        yield
    finally:
        for name, fn in (("isend", isend), ("irecv", irecv), ("batch_isend_irecv", batch)):
            setattr(c10d, name, fn)
            setattr(dist, name, fn)


def fake_rank(rank: int, world: int, flags: list, steps: int = 1,
              verbose: bool = False) -> dict:
    """This process as fake rank `rank` of `world`: one Trainer, `steps` steps. Best once
    per process: torch keeps meshes and group names of a destroyed process group around
    (`run_fake_rank` runs it in a fresh process; long_context_frontier.py runs its three
    grids in one, checked to measure the same bytes as three fresh processes)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from megaulysses.config import parse_args as parse_flags
    from megaulysses.training.trainer import Trainer
    _quiet(verbose)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        start = time.perf_counter()
        with _fake_patches(), FakeTensorMode():
            trainer = Trainer(parse_flags(flags))
            built = time.perf_counter() - start
            with _Scalars():
                out = measure_step(trainer, steps)
        out["init_seconds"] = built
        return out
    finally:
        dist.destroy_process_group()


def run_fake_rank(rank: int, world: int, flags: list, steps: int = 1,
                  verbose: bool = False) -> dict:
    """`fake_rank` in a fresh (spawned) process."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fake_rank, rank, world, flags, steps, verbose).result()


def _quiet(verbose: bool):
    import warnings
    if not verbose:
        logging.disable(logging.INFO)
    warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")


# -- real ranks ------------------------------------------------------------------------------

def real_rank(rank: int, world: int, flags: list, steps: int = 1,
              verbose: bool = False) -> dict:
    from megaulysses.config import parse_args as parse_flags
    _quiet(verbose)
    from megaulysses.training.trainer import Trainer
    start = time.perf_counter()
    trainer = Trainer(parse_flags(flags))
    built = time.perf_counter() - start
    out = measure_step(trainer, steps)
    out["init_seconds"] = built
    return out


# -- report ------------------------------------------------------------------------------------

def _mib(n: float) -> str:
    return f"{n / MIB:.2f}"


def describe(kind: str, rank: int, r: dict) -> list:
    held = sum(r["held"].values())
    phases = " ".join(f"{p} {_mib(r['by_phase'].get(p, 0))}" for p in PHASES
                      if r["by_phase"].get(p))
    return [kind, rank, _mib(r["held"]["params"]), _mib(r["held"]["optim"]),
            _mib(r["held"]["batches"]),
            _mib(r["peak"]), phases, _mib(held + r["peak"]), _mib(r.get("host", 0)),
            f"{r['init_seconds']:.2f}", f"{r['seconds']:.2f}"]


def main(argv=None):
    args = parse_args(argv)
    from _common import table
    rows, fake = [], {}
    for rank in args.rank_list:
        fake[rank] = run_fake_rank(rank, args.world, args.flags, args.steps, args.verbose)
        rows.append(describe("fake", rank, fake[rank]))
    real = None
    if args.compare_real:
        from _common import launch
        real = launch(real_rank, args.world, args.flags, args.steps, args.verbose,
                      timeout=args.timeout)
        for rank in args.rank_list:
            rows.append(describe("real", rank, real[rank]))
    print(f"training step {args.steps}, world {args.world}: {' '.join(args.flags)}")
    print("MiB; 'peak' = the most bytes the step allocated at once above what the rank "
          "held before it (params = parameters and buffers; optim = optimizer states; batches = "
          "its micro-batches); "
          "phases = that peak by where each live storage was allocated; total = held + peak; "
          "host = host memory beside it (offloaded optimizer states and activations)")
    print(table(["run", "rank", "params", "optim", "batches", "peak", "peak by phase", "total",
                 "host", "init s", "step s"], rows))
    if real is not None:
        worst = max(abs(fake[r]["peak"] - real[r]["peak"]) / max(real[r]["peak"], 1)
                    for r in args.rank_list)
        print(f"fake vs real peak: largest relative difference {worst:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
