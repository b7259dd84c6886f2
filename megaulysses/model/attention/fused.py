"""One attention step on a fused kernel that returns the log-sum-exp: a set of query rows
against one set of keys, plain causal or full, forward and the matching backward.

    kernel = fused_kernel(q)        # the entry point: None where no fused kernel runs q
    out, lse = kernel.forward(q, k, v, causal, scale)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal, scale)

This is what ring attention (parallel/ring.py) runs for every step whose mask is plain
causal or full, and the block backend (block.py) for plain causal masks: one kernel launch
per step instead of a Python loop over 64-position blocks, and no host synchronisation.

Layouts are the framework's: q, dout, out `[b, sq, hq, d]`, k, v `[b, sk, hkv, d]`
(hq % hkv == 0: GQA, query head j reads kv head j // (hq/hkv)), lse `[b, hq, sq]` fp32,
dq `[b, sq, hq, d]`, dk, dv `[b, sk, hkv, d]`, all in q's dtype but lse (the kernels'
own). Views with a unit last stride are fine (q[:, n:], k[:, :n]); outputs are contiguous.
`causal` needs sq == sk: query i sees keys j <= i (the kernels align a rectangular causal
mask differently, top-left on CPU, bottom-right in flash-attn, so only squares are asked).

Backward is the flash decomposition, and its `out` and `lse` need not be this step's: given
the final out and lse of attention over a union of key sets (the ring's merge), it returns
this key set's share of the gradients, P = exp(S * scale - lse), dV = P^T dO,
dS = P (dO V^T - rowsum(dO * O)), as the block kernel's `partial_backward` does. The
kernels compute rowsum(dO * O) from `dout` and `out` themselves (no dlse term).

Kernels, picked per device, dtype and head dim (`fused_kernel`; the pick is logged once):
    flash_attn       CUDA, fp16/bf16, d % 8 == 0, d <= 256, the flash_attn package
                     importable: `_flash_attn_forward/_flash_attn_backward` (GQA native)
    torch-flash      CUDA, fp16/bf16, same head dims, no flash_attn: torch's own copy of
                     it, `aten._scaled_dot_product_flash_attention(_backward)` (GQA native)
    torch-efficient  CUDA, fp32: `aten._scaled_dot_product_efficient_attention(_backward)`
                     (kv repeated to hq heads: this kernel has no GQA)
    cpu-flash        CPU, fp32/bf16/fp16: `aten._scaled_dot_product_flash_attention_for_cpu`
                     (+ `_backward`; GQA native)
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

HALF = (torch.float16, torch.bfloat16)
# Calls per (kernel name, "forward" | "backward") in this process: tests check that the
# fused path is the one taken.
CALLS: Counter = Counter()

Pair = tuple[torch.Tensor, torch.Tensor]
Triple = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class FusedKernel:
    """A fused attention kernel with log-sum-exp (module doc for the layouts)."""
    name: str
    _forward: Callable[..., Pair]
    _backward: Callable[..., Triple]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float) -> Pair:
        """(out `[b, sq, hq, d]` q's dtype, lse `[b, hq, sq]` fp32)."""
        _check_causal(q, k, causal)
        CALLS[(self.name, "forward")] += 1
        return self._forward(q, k, v, causal, scale)

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float) -> Triple:
        """This key set's (dq, dk, dv) in q's dtype, given the final out and lse."""
        _check_causal(q, k, causal)
        CALLS[(self.name, "backward")] += 1
        return self._backward(dout, q, k, v, out.to(q.dtype), lse, causal, scale)


def _check_causal(q: torch.Tensor, k: torch.Tensor, causal: bool) -> None:
    if causal and q.shape[1] != k.shape[1]:  # shapes are Python ints: no host sync
        raise ValueError(f"a causal fused step needs as many queries as keys, "
                         f"got {q.shape[1]} and {k.shape[1]}")


def fused_kernel(q: torch.Tensor) -> Optional[FusedKernel]:
    """The fused kernel for q's device, dtype and head dim, or None (then the caller uses
    the block kernel)."""
    return _pick(q.device.type, q.dtype, q.shape[-1])


@functools.cache
def _pick(device: str, dtype: torch.dtype, d: int) -> Optional[FusedKernel]:
    kernel = _choose(device, dtype, d)
    if kernel is None:
        log.info("fused attention step: none for %s %s head dim %d (block kernel)", device,
                 dtype, d)
    else:
        log.info("fused attention step: %s (%s, %s, head dim %d)", kernel.name, device,
                 dtype, d)
    return kernel


def _choose(device: str, dtype: torch.dtype, d: int) -> Optional[FusedKernel]:
    if device == "cpu":
        if dtype in (torch.float32, *HALF):
            return FusedKernel("cpu-flash", _cpu_forward, _cpu_backward)
        return None
    if device != "cuda" or d % 8 or d > 256:
        return None
    if dtype in HALF:
        if _flash_attn_ops() is not None:
            return FusedKernel("flash_attn", _fa_forward, _fa_backward)
        return FusedKernel("torch-flash", _torch_flash_forward, _torch_flash_backward)
    if dtype == torch.float32:
        return FusedKernel("torch-efficient", _efficient_forward, _efficient_backward)
    return None


def _heads_first(*xs: torch.Tensor) -> list[torch.Tensor]:
    """[b, s, h, d] -> views [b, h, s, d], the aten ops' layout."""
    return [x.transpose(1, 2) for x in xs]


def _seq_first(*xs: torch.Tensor) -> list[torch.Tensor]:
    """[b, h, s, d] -> [b, s, h, d], contiguous (the ops allocate this memory order
    already, so this is a view)."""
    return [x.transpose(1, 2).contiguous() for x in xs]


# ---- CPU: torch's flash kernel ------------------------------------------------------------


def _cpu_forward(q, k, v, causal: bool, scale: float) -> Pair:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        *_heads_first(q, k, v), 0.0, causal, scale=scale)  # [b, hq, sq, d], [b, hq, sq]
    return _seq_first(out)[0], lse


def _cpu_backward(dout, q, k, v, out, lse, causal: bool, scale: float) -> Triple:
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        *_heads_first(dout, q, k, v, out), lse, 0.0, causal, scale=scale)
    dq, dk, dv = _seq_first(dq, dk, dv)
    return dq, dk, dv


# ---- CUDA: the flash_attn package -----------------------------------------------------------


@functools.cache
def _flash_attn_ops():
    try:
        from flash_attn.flash_attn_interface import _flash_attn_backward, _flash_attn_forward
    except ImportError:
        return None
    return _flash_attn_forward, _flash_attn_backward


@functools.cache
def _fa_params(fn) -> frozenset:
    """`fn`'s parameter names (2.7+ wraps the functions in torch custom ops: the plain
    function is `_init_fn`); once per function, not per call."""
    return frozenset(inspect.signature(getattr(fn, "_init_fn", fn)).parameters)


def _fa_args(fn, **given) -> dict:
    """`given` by `fn`'s parameter names, across flash_attn versions: 2.5 takes
    window_size=(l, r), 2.6+ window_size_left/right and softcap."""
    names = _fa_params(fn)
    args = {n: a for n, a in given.items() if n in names}
    if "window_size" in names:
        args["window_size"] = (-1, -1)
    if "window_size_left" in names:
        args.update(window_size_left=-1, window_size_right=-1)
    if "softcap" in names:
        args["softcap"] = 0.0
    return args


def _fa_forward(q, k, v, causal: bool, scale: float) -> Pair:
    fwd = _flash_attn_ops()[0]
    res = fwd(**_fa_args(fwd, q=q, k=k, v=v, dropout_p=0.0, softmax_scale=scale,
                         causal=causal, alibi_slopes=None, return_softmax=False))
    # 2.6+: (out, lse, S, rng_state); 2.5: (out, q, k, v, out_padded, lse, S, rng_state)
    lse = res[1] if len(res) == 4 else res[5]
    return res[0], lse  # [b, sq, hq, d], [b, hq, sq]


def _fa_backward(dout, q, k, v, out, lse, causal: bool, scale: float) -> Triple:
    bwd = _flash_attn_ops()[1]
    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    bwd(**_fa_args(bwd, dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse.contiguous(),
                   dq=dq, dk=dk, dv=dv, dropout_p=0.0, softmax_scale=scale, causal=causal,
                   alibi_slopes=None,
                   deterministic=torch.are_deterministic_algorithms_enabled(),
                   rng_state=None))
    return dq, dk, dv


# ---- CUDA: torch's own kernels -------------------------------------------------------------


def _torch_flash_forward(q, k, v, causal: bool, scale: float) -> Pair:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
        *_heads_first(q, k, v), 0.0, causal, False, scale=scale)[:2]
    return _seq_first(out)[0], lse


def _torch_flash_backward(dout, q, k, v, out, lse, causal: bool, scale: float) -> Triple:
    # No dropout: the rng state is never read; None: dense inputs (no cumulative lengths)
    rng = torch.empty(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty((), dtype=torch.uint64, device=q.device)
    grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        *_heads_first(dout, q, k, v, out), lse.contiguous(), None, None, q.shape[1],
        k.shape[1], 0.0, causal, rng, unused, scale=scale)
    dq, dk, dv = _seq_first(*grads)
    return dq, dk, dv


def _repeat_kv(q, k, v) -> Pair:
    """k, v `[b, sk, hkv, d]` -> `[b, sk, hq, d]`, kv head j serving q heads j*rep..."""
    b, sk, hkv, d = k.shape
    rep = q.shape[2] // hkv
    if rep == 1:
        return k, v
    return tuple(x[:, :, :, None].expand(b, sk, hkv, rep, d).reshape(b, sk, hkv * rep, d)
                 for x in (k, v))


def _efficient_forward(q, k, v, causal: bool, scale: float) -> Pair:
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        *_heads_first(q, *_repeat_kv(q, k, v)), None, True, 0.0, causal, scale=scale)[:2]
    return _seq_first(out)[0], lse[:, :, :q.shape[1]]  # its lse rows are padded to 32


def _efficient_backward(dout, q, k, v, out, lse, causal: bool, scale: float) -> Triple:
    sq, hkv = q.shape[1], k.shape[2]
    lse = F.pad(lse, (0, -sq % 32)).contiguous()  # the padded rows its forward returns
    seed = offset = torch.empty((), dtype=torch.long)  # no dropout: never read
    kr, vr = _repeat_kv(q, k, v)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        *_heads_first(dout, q, kr, vr), None, out.transpose(1, 2), lse, seed, offset, 0.0,
        [True, True, True, False], causal, scale=scale)[:3]
    dq, dk, dv = _seq_first(dq, dk, dv)
    if dk.shape[2] != hkv:  # the repeated heads' gradients summed per kv head
        b, sk, hq, d = dk.shape
        dk, dv = (x.view(b, sk, hkv, hq // hkv, d).sum(3) for x in (dk, dv))
    return dq, dk, dv
