"""Compiled blocks (--torch-compile): every transformer block, and the loss, through
torch.compile (inductor: its C++ backend on CPU, Triton on CUDA), per block as torchtitan
compiles, not the whole model.

Each compiled function is one per run, shared by every block (dynamo keys its cache by
the code object: one graph set for all blocks, every pipeline stage's and FSDP's wrapped
class included), for static shapes (`dynamic=False`: the micro-batch and the sequence are
fixed for a run; any other shape, e.g. --generate's growing prompts, runs eagerly instead
of compiling once per length: `_OneShape`). Nothing depends on the micro-batch count or a
batch's documents; evaluation (no grad) compiles each graph once more. A block compiles in
one of two ways:

    whole        `Block.forward`, its attention core included, one graph
                 (`fullgraph=True`): plain causal attention on the CPU/SDPA core, without
                 attention dropout, on local heads (no Ulysses, ring, FPDT, head groups,
                 selective recomputation); tensor parallelism (DTensor) and FSDP2
                 compile through.
    around the   the attention's forward as two graphs, before the core (q, k, v, their
    core         norms, RoPE) and after it (the out projection), with the core
                 (`SelfAttention.attend`: the dropout key, Ulysses' all-to-alls, the ring,
                 head groups, FPDT, masks) run eagerly between them, and
                 `Block.after_attention` (residual, norm, MLP, residual) one graph; the
                 first norm runs eagerly (under tensor parallelism DTensor's input hook of
                 the attention sits between it and the projections). Those cores issue
                 collectives through autograd Functions, checkpoint, keep per-batch state
                 on the mask object and sync with the host.

The wrappers a grid puts on a block keep working: FSDP2's hooks run eagerly around the
compiled forward (which sees the gathered parameters as inputs); tensor parallelism's
module hooks and DTensor ops are traced; full recomputation and activation offload
checkpoint the compiled forward (non-reentrant: its graphs save through the checkpoint's
hooks); the tiled MLP's checkpoints are traced. The oneDNN linear steps aside while dynamo
traces (model/ops/onednn.py). Dropout draws eager's masks (`fallback_random`) and
16-bit roundings happen where eager's do (`emulate_precision_casts`): a compiled run
equals an eager one within the dtype's rounding.

The loss (`Head.loss`: final norm, output layer, the chunked cross entropy with its
chunk loop unrolled) is one graph; the vocab-parallel loss of tensor parallelism stays
eager (its all-reduces run inside its autograd Function).

Not yet (`compile_blocker`; the model then runs eagerly): zero-bubble pipelines (their
weight pass walks autograd's graph inside each block), and the distributed optimizer's
gradient-accumulation fusion and --overlap-param-gather (Python side effects on each
weight's use and read). What runs eagerly is said in the one start line `apply_compile`
returns; the first step's compile time is logged once (`CompileClock`).
"""

from __future__ import annotations

import logging
import time
import types
from typing import Callable, Optional

import torch
import torch.nn as nn

from megaulysses.config import RunConfig
from megaulysses.model.attention import cpu_attention, sdpa_attention
from megaulysses.model.gpt import Block, Head, SelfAttention
from megaulysses.parallel.dist_opt_plan import fuses_weight_gradients

log = logging.getLogger(__name__)

# Cores dynamo traces whole (with no mask but causal and no attention dropout): plain
# kernels on this rank's heads. Every other core runs eagerly between two graphs.
TRACED_CORES = (cpu_attention, sdpa_attention)
EAGER_CORES = {  # by class name: what of each dynamo cannot trace yet
    "UlyssesAttention": "Ulysses' all-to-alls", "RingAttention": "the ring's exchanges",
    "ChunkedUlyssesAttention": "FPDT's chunked all-to-alls and host copies",
    "HeadGroups": "head groups' checkpoints",
    "RecomputedCore": "selective recomputation's checkpoint around the core"}


def compile_blocker(cfg: RunConfig, dtype: torch.dtype, zero_stage: int) -> Optional[str]:
    """Why this run's model cannot compile yet (it then runs eagerly), or None."""
    par = cfg.parallel
    if par.pipeline_schedule == "zero-bubble":
        return ("--pipeline-schedule zero-bubble: its weight pass walks autograd's graph "
                "inside each block")
    dist_opt = par.use_distributed_optimizer and zero_stage <= 1 and dtype != torch.float32
    if dist_opt and fuses_weight_gradients(cfg):
        return ("the distributed optimizer's gradient-accumulation fusion: each linear hands "
                "its weight gradient to the optimizer (--no-gradient-accumulation-fusion "
                "compiles)")
    if dist_opt and par.overlap_param_gather:
        return "--overlap-param-gather: each weight's read waits for its gather"
    return None


def apply_compile(model: nn.Module, documents: bool = False,
                  blocker: Optional[str] = None, tensor_parallel: bool = False) -> str:
    """Compile every `Block` among `model`'s modules, and the loss where `model.head` is
    the plain Head; in place. After every transform that changes what a block runs (it
    decides from the final core); before or after FSDP2 (its hooks sit around
    `forward`). `documents`: batches bring document ids (--reset-attention-mask).
    `blocker`: `compile_blocker`'s reason: nothing compiles. `tensor_parallel`: tp > 1
    (the line says its collectives go uncounted). Returns the start line."""
    if blocker is not None:
        return f"--torch-compile: the model runs eagerly ({blocker}: cannot compile yet)"
    _configure()
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    mask = getattr(model, "mask", None)  # the GPT's: causal, or a window, a sparse layout
    masked = documents or not (mask is None or mask.is_causal)
    eager_core = next((r for r in (_eager_core(b, masked) for b in blocks) if r), None)
    if eager_core is None:
        forward = _OneShape(Block.forward, fullgraph=True)
    else:  # the attention's forward breaks once, at the core; the rest is one graph
        attention = _OneShape(SelfAttention.forward, fullgraph=False)
        after = _OneShape(Block.after_attention, fullgraph=True)
    # instance attributes shadow the methods (what mypy's method-assign flags, on purpose)
    for block in blocks:
        if eager_core is None:
            block.forward = types.MethodType(forward, block)  # type: ignore[method-assign]
            continue
        attn = block.attn
        attn.attend = torch.compiler.disable(  # type: ignore[method-assign]
            attn.attend, recursive=True)
        attn.forward = types.MethodType(attention, attn)  # type: ignore[method-assign]
        block.after_attention = types.MethodType(after, block)  # type: ignore[method-assign]
    head = getattr(model, "head", None)
    if type(head) is Head:
        head.loss = types.MethodType(  # type: ignore[method-assign]
            _OneShape(Head.loss, fullgraph=True), head)
    if blocks:
        CompileClock().watch(blocks[0])
    line = _describe(len(blocks), eager_core, head)
    if tensor_parallel:  # tensor.step_context: dynamo compiles nothing in a dispatch mode
        line += "; DTensor's collectives are not counted in the logged bytes"
    return line


def _configure() -> None:
    """Process-wide inductor settings for exactness against eager."""
    # dropout through torch's own generator, as eager draws it: the same masks, and
    # checkpoints restore that generator for recomputation
    torch._inductor.config.fallback_random = True
    # 16-bit roundings where eager rounds (a fused kernel would keep fp32 in between)
    torch._inductor.config.emulate_precision_casts = True


def _eager_core(block: Block, masked: bool) -> Optional[str]:
    """Why the block's attention core cannot compile yet, or None: dynamo traces it."""
    attn = block.attn
    if attn.core not in TRACED_CORES:
        name = getattr(attn.core, "__name__", type(attn.core).__name__)
        return EAGER_CORES.get(name, f"the {name} core")
    if attn.dropout:
        return "attention dropout: its key is drawn on the host"
    if masked:
        return "a mask other than plain causal: the kernel picks blocks on the host"
    return None


def _describe(n: int, eager_core: Optional[str], head: Optional[nn.Module]) -> str:
    if n == 0:
        parts = "no transformer block on this rank"
    elif eager_core is None:
        parts = f"{n} transformer blocks compiled whole (one graph shared by all)"
    else:
        parts = (f"{n} transformer blocks compiled around the attention core, which runs "
                 f"eagerly ({eager_core}: cannot compile yet), as does the first norm; "
                 "three graphs shared by all")
    if type(head) is Head:
        parts += "; the loss compiled"
    elif head is not None:
        parts += ("; the loss eager (the vocab-parallel loss's all-reduces: cannot compile "
                  "yet)")
    return "--torch-compile: " + parts


class _OneShape:
    """`fn` compiled for the shape of its first call's input (the run's micro-batch) and
    run eagerly for any other: a function `(module, x, *args)`, `x` a tensor."""

    def __init__(self, fn: Callable, fullgraph: bool):
        self.eager = fn
        self.shape: Optional[torch.Size] = None  # the first call's input shape
        self.compiled = torch.compile(fn, dynamic=False, fullgraph=fullgraph)

    def __call__(self, module: nn.Module, x: torch.Tensor, *args, **kwargs):
        if self.shape is None:
            self.shape = x.shape
        fn = self.compiled if x.shape == self.shape else self.eager
        return fn(module, x, *args, **kwargs)


class CompileClock:
    """Seconds spent compiling (dynamo's graphs, and the backward graphs the first
    backward compiles), logged once: at the first block's first forward after a backward
    compiled, i.e. once the first forward and backward have run."""

    def __init__(self):
        self.seconds, self.count, self.backward, self._start = 0.0, 0, False, None
        self.handler = torch._dynamo.callback.callback_handler
        self.handler.register_start_callback(self._started)
        self.handler.register_end_callback(self._ended)

    def _started(self, args) -> None:
        self._start = time.perf_counter()

    def _ended(self, args) -> None:
        if self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self.count, self._start = self.count + 1, None
        self.backward |= args.callback_trigger.name == "LAZY_BACKWARD"

    def watch(self, block: nn.Module) -> None:
        calls = []

        def before(module, args):
            calls.append(1)
            if not self.backward and (self.count or len(calls) < 3):
                return  # still compiling; or, nothing compiled twice: cached in-process
            if self.count:
                log.info("--torch-compile: %d compilations in %.1f s (the first forward "
                         "and backward)", self.count, self.seconds)
            handle.remove()
            self.handler.remove_start_callback(self._started)
            self.handler.remove_end_callback(self._ended)
        handle = block.register_forward_pre_hook(before)
