"""The fake accelerator taken for CUDA: the memory plan's CUDA branch checked on a CPU-only
torch (issue 40, item 4).

    with fake_cuda_rank(rank=1, world=2):
        trainer = Trainer(parse_args(flags))   # every tensor a FakeTensor on "fakeaccel"
        ...                                    # the model chooses its kernels as on CUDA

    python -m megaulysses.training.fake_cuda    # the table: measured vs planned (cuda)

The device must exist before the process runs any backward (autograd sizes its device
queues once): a process of its own, as tests/training/test_fake_cuda_plan.py spawns.

Why not FakeTensors on device "cuda" itself: `FakeTensorMode` makes them on a CPU-only
build, and their forward ops run, but the first autograd node on one aborts the process
(`AccumulateGrad` asks for the CUDA device guard, which a CPU build does not link:
"PyTorch is not linked with support for cuda devices", a C++ `terminate`). So the rank is
fake_device.py's PrivateUse1 device, and what the model and torch decide by "is it CUDA"
is made to answer yes (`as_cuda`):

- attention: `select_backend` and its checks see a CUDA device (`auto`: SDPA for plain
  causal; no flash_attn package here, as the plan assumes for that path);
  `sdpa_repeats_kv` and the fused ring/FPDT step (`fused._choose`) take CUDA's branch;
- SDPA: a kernel at the device's autograd key picks what CUDA's `sdp_utils` picks on an
  H100 (flash for 16-bit with head dim up to 256, padded to a multiple of 8, GQA
  included; else the memory-efficient kernel, head dim a multiple of 4 (fp32) or 8, no
  GQA; else math, explicit scores) and calls that aten op, so autograd saves
  what it saves on CUDA (q, k, v, out, the logsumexp, the RNG seed and offset) and the
  backward is its `_backward` op; their shapes come from torch's meta functions;
- what is CUDA's already on any PrivateUse1 device: dropout is `native_dropout` (a
  1-byte mask, `is_fused_kernel_acceptable`), AdamW is fused, the cross entropy's
  chunks have CUDA's budget (any device but the CPU), autocast casts as fake_device.py
  registers it.

Not faked, so not measured here (each only while its kernel runs):
- the attention backward's own buffers, allocated inside the kernel (at::empty: the
  caching allocator's, so in torch.cuda.max_memory_allocated): flash's fp32 `dq_accum`
  and `softmax_d`, and under GQA its dk, dv expanded to the hq heads; the efficient
  kernel's fp32 grad-q accumulator. The plan counts them at its core backward moments
  (planner/memory/cores.py `attention_backward_scratch`); the table shows one call's
  beside each grid. At the headline grids they are large (Ulysses runs the core on the
  whole sequence): Llama-3-8B on 8 H100 at 6,029,312 tokens (sp 8: 4 q heads, 1 kv head
  a rank) 23.1 GiB, on 32 H100 at 22,282,240 tokens 10.7 GiB, which the plan missed
  before this check;
- pinned host memory: `pin_memory()` has no fake kernel (NYI), and the device is not
  CUDA, so the offloads' host copies are plain host tensors. The bytes are the same
  (pinning changes where the pages are locked, not how many), and the plan has no
  CUDA-only host term; what it does not show is the CUDA caching host allocator's
  rounding of each pinned block up to a power of two (up to 2x per block, host only);
- the CUDA caching allocator's rounding (512-byte blocks, 2 MiB segments) and
  fragmentation, cuBLAS/cuDNN workspaces, NCCL's buffers, the CUDA context: none is a
  tensor; the plan's usable memory (hardware.py's reserve) stands for them;
- side streams: activation offload copies on the default stream here; on CUDA its copy
  runs on a side stream, and a device tensor it copies lives until the copy's event
  (the overlap's extra lifetime is not measured here);
- the flash_attn package's kernels (not installed here: `auto` on CUDA without it is
  torch's SDPA, as the plan's sdpa branch assumes).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import warnings
from typing import Iterator, Union

import torch

from megaulysses.planner.memory.cores import unfaked_attention_backward  # the plan's own
from megaulysses.training import fake_device
from megaulysses.training.live_bytes import step_peak

HALF = (torch.float16, torch.bfloat16)
MIB = 2 ** 20


# -- the device as CUDA -------------------------------------------------------------------

@contextlib.contextmanager
def as_cuda() -> Iterator[None]:
    """Inside: the model's CUDA-or-not choices treat the fake accelerator as CUDA, and SDPA
    on it runs CUDA's kernels' meta functions (the module doc)."""
    from megaulysses.model.attention import backends, fused, kernels
    saved = (backends._auto, backends._check, kernels.sdpa_repeats_kv, fused._choose)
    auto, check, repeats, choose = saved
    backends._auto = lambda device, *a, **k: auto(_cuda(device), *a, **k)
    backends._check = lambda name, backend, device, *a: check(name, backend, _cuda(device),
                                                              *a)
    kernels.sdpa_repeats_kv = lambda device_type, *a: repeats(_cuda_type(device_type), *a)
    fused._choose = lambda device, *a: choose(_cuda_type(device), *a)
    fused._pick.cache_clear()  # memoized per device name
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("scaled_dot_product_attention", _sdpa_as_on_cuda, "AutogradPrivateUse1")
    try:
        yield
    finally:
        lib._destroy()
        backends._auto, backends._check, kernels.sdpa_repeats_kv, fused._choose = saved
        fused._pick.cache_clear()


def _cuda(device: torch.device) -> torch.device:
    return torch.device("cuda") if device.type == fake_device.NAME else device


def _cuda_type(device_type: str) -> str:
    return "cuda" if device_type == fake_device.NAME else device_type


def _sdpa_as_on_cuda(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *,
                     scale=None, enable_gqa=False):
    """torch's SDPA as CUDA runs it on an H100 (sdp_utils' order: flash, memory-efficient,
    math), each op called here so that autograd records it and saves its outputs."""
    aten = torch.ops.aten
    d, half = q.shape[-1], q.dtype in HALF
    gqa = enable_gqa and q.shape[-3] != k.shape[-3]
    if attn_mask is None and half and d <= 256:
        pad = -d % 8  # CUDA's SDPA pads q, k, v to a multiple of 8 for flash (copies)
        scale = d ** -0.5 if scale is None and pad else scale
        q, k, v = (torch.nn.functional.pad(t, (0, pad)) if pad else t for t in (q, k, v))
        out = aten._scaled_dot_product_flash_attention(  # [b, h, s, d] and the lse
            q, k, v, dropout_p, is_causal, False, scale=scale)[0]
        return out[..., :d] if pad else out
    if not gqa and d % (8 if half else 4) == 0:
        lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        return aten._scaled_dot_product_efficient_attention(
            q, k, v, attn_mask, lse, dropout_p, is_causal, scale=scale)[0]
    return aten._scaled_dot_product_attention_math(
        q, k, v, attn_mask, dropout_p, is_causal, None, scale=scale,
        enable_gqa=enable_gqa)[0]


@contextlib.contextmanager
def fake_cuda_rank(rank: int = 0, world: int = 1) -> Iterator[torch.device]:
    """fake_device.fake_rank, the device taken for CUDA."""
    with fake_device.fake_rank(rank, world) as device, as_cuda(), _p2p_at_once():
        yield device


@contextlib.contextmanager
def _p2p_at_once() -> Iterator[None]:
    """Sends and receives done at once, nothing moved, as the fake group does them, but
    not dispatched through the fake modes: there each cost ~1 ms, a quarter of a 32-way
    ring's step (a pass per ring step). A tensor off the device is refused, as by NCCL."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch._C._distributed_c10d import FakeWork
    names = ("isend", "irecv", "batch_isend_irecv")
    saved = [getattr(c10d, name) for name in names]

    def done(tensor: torch.Tensor) -> FakeWork:
        if tensor.device.type != fake_device.NAME:
            raise RuntimeError(f"a point-to-point op on a {tensor.device.type} tensor "
                               f"(shape {tuple(tensor.shape)}); NCCL takes "
                               f"{fake_device.NAME} tensors only")
        return FakeWork()

    def isend(tensor, *args, **kwargs):
        return done(tensor)

    def irecv(tensor, *args, **kwargs):  # a function of its own: ops are told apart by it
        return done(tensor)

    def batch(ops):
        return [done(op.tensor) for op in ops]

    for module in (c10d, dist):
        for name, fn in zip(names, (isend, irecv, batch), strict=True):
            setattr(module, name, fn)
    try:
        yield
    finally:
        for module in (c10d, dist):
            for name, fn in zip(names, saved, strict=True):
                setattr(module, name, fn)


# -- measured against the plan --------------------------------------------------------------

LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--disable-bias-linear", "--hidden-dropout", "0", "--attention-dropout", "0"]
# tests/parallel/test_memory_plan.py's small model (2 layers, hidden 64, 4 heads, seq 256,
# micro-batch 2), one step measured after one that creates AdamW's states; one micro-batch
# a step (a fake op costs the same at any size: fewer ops, a faster test)
BASE = LLAMA + ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                "--seq-length", "256", "--micro-batch-size", "2", "--global-batch-size", "2",
                "--train-iters", "2", "--lr-warmup-iters", "0", "--eval-iters", "0",
                "--log-interval", "100", "--generate", "0", "--peak-tflops", "1",
                "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "511",
                "--num-workers", "0"]  # no loader workers forked inside the fake mode
SP2, PP2 = ["--ds-sequence-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]
FULL, BF16 = ["--recompute-granularity", "full"], ["--bf16"]
GQA2 = ["--group-query-attention", "--num-query-groups", "2"]
GRIDS = {  # name: (world, ranks measured, flags)
    "plain, fp32 (efficient kernel)": (1, [0], []),
    "plain, bf16, GQA, dropout 0.1 (flash, 1-byte masks)": (1, [0], BF16 + GQA2 + [
        "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]),
    "sp2, full, activation offload 1 layer, bf16": (2, [1], SP2 + FULL + BF16 + [
        "--cpu-offloading-num-layers", "1"]),
    "sp2, FPDT 2 chunks, offloading, ZeRO-3, full, bf16": (2, [1], SP2 + FULL + BF16 + [
        "--ds-sequence-parallel-fpdt", "--ds-sequence-parallel-fpdt-chunk-size", "256",
        "--ds-sequence-parallel-fpdt-offloading", "--zero-stage", "3"]),
    "dp2, distributed optimizer, offload 0.5, bf16": (2, [1], BF16 + [
        "--global-batch-size", "4", "--use-distributed-optimizer", "--optimizer-cpu-offload",
        "--optimizer-offload-fraction", "0.5", "--grad-reduce-in-bf16"]),
    "pp2 1f1b, 4 micro-batches, bf16": (2, [0, 1], PP2 + BF16 + [
        "--global-batch-size", "8"]),
}


def measure_all(grids: dict = GRIDS) -> dict:
    """{(grid, rank): (measured peak bytes, planned peak bytes, plan's peak moment)}, or
    the traceback of the grid's error, one grid after another in this process."""
    import traceback
    logging.disable(logging.INFO)
    warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
    out: dict[tuple[str, int], Union[dict, str]] = {}
    for name, (world, ranks, flags) in grids.items():
        for rank in ranks:
            try:
                out[name, rank] = measure(BASE + flags, world, rank)
            except Exception:
                out[name, rank] = traceback.format_exc()
    return out


def measure(flags: list, world: int = 1, rank: int = 0) -> dict:
    """`rank` of `world`: "measured", the real Trainer's second step on the fake CUDA rank
    (bytes held before it + its peak live bytes); "planned", "moment", plan_memory's cuda
    branch (what `--dry-run --dry-run-device cuda` prints) for the same flags and
    pipeline rank; "kernels", the attention and dropout kernels the step ran;
    "unfaked", `unfaked_attention_backward` of one of its attention calls."""
    from megaulysses.config import parse_args
    from megaulysses.parallel.dims import CP, PP
    from megaulysses.planner.memory import plan_memory
    from megaulysses.training.trainer import Trainer
    with fake_cuda_rank(rank, world):
        trainer = Trainer(parse_args(flags))
        with _Kernels() as kernels:
            measured, _ = step_peak(trainer)
        cfg, dims = trainer.cfg, trainer.dims
        pp_rank, cp_rank = trainer.comm.rank(PP), trainer.comm.rank(CP)
        del trainer
        gc.collect()
    plan = plan_memory(cfg, dims, pp_rank, "cuda", cp_rank=cp_rank)  # plain arithmetic
    return {"measured": measured, "planned": plan.peak_bytes, "moment": plan.peak_moment,
            "kernels": sorted(kernels.seen), "unfaked": kernels.unfaked}


class _Kernels(torch.utils._python_dispatch.TorchDispatchMode):
    """The attention and dropout kernels that run (a dropout's by its mask's dtype), and
    the largest unfaked backward buffer of one attention call."""

    NAMES = {"_scaled_dot_product_flash_attention": "flash",
             "_scaled_dot_product_efficient_attention": "efficient",
             "_scaled_dot_product_attention_math": "math",
             "_flash_attention_forward": "flash", "_efficient_attention_forward": "efficient"}

    def __init__(self):
        super().__init__()
        self.seen, self.unfaked = set(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in self.NAMES:
            self.seen.add(self.NAMES[name])
            q, k = args[0], args[1]  # [b, h, s, d] (the _forward ops: [b, s, h, d])
            b, h, s, d = q.shape if "scaled" in name else (q.shape[0], q.shape[2],
                                                          q.shape[1], q.shape[3])
            hk = k.shape[1] if "scaled" in name else k.shape[2]
            self.unfaked = max(self.unfaked, unfaked_attention_backward(
                b, s, h, hk, d, q.dtype))
        elif name == "native_dropout":
            self.seen.add(f"dropout mask {str(out[1].dtype).removeprefix('torch.')}")
        return out


def table(results: dict) -> str:
    """The comparison, one line per (grid, rank), MiB."""
    lines = [f"{'grid':<52} rank  measured   planned  ratio  unfaked  kernels",
             "(MiB; unfaked: one attention backward's own buffers, which the plan counts "
             "and the fake rank cannot see, % of the plan's peak)"]
    for (name, rank), r in results.items():
        if isinstance(r, str):
            lines.append(f"{name:<52} {rank:>4}  error: {r.strip().splitlines()[-1]}")
            continue
        measured, planned = r["measured"], r["planned"]
        lines.append(f"{name:<52} {rank:>4}  {measured / MIB:8.3f}  {planned / MIB:8.3f}  "
                     f"{planned / measured:6.3f}  {100 * r['unfaked'] / planned:5.1f}%  "
                     f"{', '.join(r['kernels'])}; peak at {r['moment']}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(measure_all()))
