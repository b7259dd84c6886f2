"""Attention cores: one callable per backend, `core(q, k, v, dropout_p) -> out`.

q `[b, s, hq, d]`, k and v `[b, s, hkv, d]` with hq % hkv == 0 (GQA), out `[b, s, hq, d]`,
always causal. The layout is `[b, s, h, d]` on purpose: Ulysses re-shards exactly these
tensors (sequence <-> heads) around any core without the core knowing.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import torch
import torch.nn.functional as F

from megaulysses.model.fused import block_causal_attention

log = logging.getLogger(__name__)

AttentionCore = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def math_attention(q, k, v, dropout_p: float = 0.0):
    """The plain reference: explicit scores, mask and softmax in fp32."""
    b, s, hq, d = q.shape
    rep = hq // k.shape[2]
    k = k.repeat_interleave(rep, dim=2)  # [b, s, hq, d]: kv head j serves q heads j*rep..
    v = v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) / math.sqrt(d)
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
    probs = F.dropout(probs, p=dropout_p, training=dropout_p > 0)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v.float())
    return out.to(q.dtype)  # [b, s, hq, d]


def sdpa_attention(q, k, v, dropout_p: float = 0.0):
    """torch SDPA: flash-style kernels on CPU and CUDA (no s x s matrix for causal)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, h, s, d]
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)  # [b, s, hq, d]


# Up to this length, on CPU in fp32, explicit attention by query blocks beats SDPA's CPU flash
# kernel (forward + backward, b=4, h=8, d=64, 2 threads: 1.1x at s=256, 1.2-1.4x at 512,
# 1.1x at 1024, ~1x at 2048); beyond it the probabilities it keeps for backward
# (b * h * s^2 / 2 per layer) cost more memory than they save time, and SDPA is used.
CPU_BLOCK_MAX_SEQ = 1024


def cpu_attention(q, k, v, dropout_p: float = 0.0):
    """`auto` on CPU: block_causal_attention for fp32, no dropout, moderate s; else SDPA."""
    if (q.device.type == "cpu" and q.dtype == torch.float32 and dropout_p == 0.0
            and q.shape[1] <= CPU_BLOCK_MAX_SEQ):
        return block_causal_attention(q, k, v)
    return sdpa_attention(q, k, v, dropout_p)


def _flash_attn_func():
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return None
    return flash_attn_func


def flash_attention(q, k, v, dropout_p: float = 0.0):
    """The flash_attn package (CUDA, fp16/bf16); takes [b, s, h, d] and GQA natively."""
    return _flash_attn_func()(q, k, v, dropout_p=dropout_p, causal=True)


BACKENDS = {"math": math_attention, "sdpa": sdpa_attention, "flash": flash_attention}


def flash_available(device: torch.device) -> bool:
    return device.type == "cuda" and _flash_attn_func() is not None


def select_backend(name: str, device: torch.device,
                   dtype: torch.dtype = torch.float32) -> tuple[str, AttentionCore]:
    """Resolve --attention-backend; `auto` prefers flash_attn (CUDA, 16-bit), else SDPA.

    On CPU `auto` returns name "sdpa" with `cpu_attention`, which uses explicit attention by
    query blocks where that is faster (fp32, no dropout, s <= CPU_BLOCK_MAX_SEQ) and SDPA
    otherwise; `sdpa` always means torch SDPA itself.
    """
    half = dtype in (torch.float16, torch.bfloat16)
    if name == "auto":
        name = "flash" if flash_available(device) and half else "sdpa"
        if device.type == "cpu":
            log.info("attention backend: auto -> sdpa (CPU: query-block explicit attention "
                     "for fp32 without dropout up to seq %d, torch SDPA otherwise)",
                     CPU_BLOCK_MAX_SEQ)
            return name, cpu_attention
        log.info("attention backend: auto -> %s", name)
    elif name == "flash" and not (flash_available(device) and half):
        raise ValueError("--attention-backend: flash needs CUDA, the flash_attn package "
                         "and --bf16 or --fp16")
    else:
        log.info("attention backend: %s", name)
    return name, BACKENDS[name]
