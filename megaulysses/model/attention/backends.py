"""The attention backends, one list (`BACKENDS`, `--attention-backend`): what each core
runs (mask features, dropout, CUDA, 16-bit), and `select_backend`, which resolves the flag
(`auto` included) for a device, dtype and mask, or says in one line why it cannot.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from megaulysses.model.attention import kernels
from megaulysses.model.attention.kernels import (CPU_BLOCK_MAX_SEQ, AttentionCore,
                                                 block_attention, cpu_attention,
                                                 flash_attention, flex_attention,
                                                 math_attention, sdpa_attention)
from megaulysses.model.attention.mask import AttentionMask

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Backend:
    core: AttentionCore
    masks: tuple  # which of "window", "documents", "sparse" it runs
    dropout: bool
    cuda_only: bool = False
    half_only: bool = False


BACKENDS = {
    "math": Backend(math_attention, ("window", "documents", "sparse"), dropout=True),
    "block": Backend(block_attention, ("window", "documents", "sparse"), dropout=True),
    "sdpa": Backend(sdpa_attention, (), dropout=True),
    "flash": Backend(flash_attention, ("window", "documents"), dropout=True, cuda_only=True,
                     half_only=True),
    "flex": Backend(flex_attention, ("window", "documents", "sparse"), dropout=False,
                    cuda_only=True),
}
BACKEND_CHOICES = ("auto",) + tuple(BACKENDS)


def flash_available(device: torch.device) -> bool:
    # read through the module: a test's stand-in for flash_attn serves both places
    return device.type == "cuda" and kernels._flash_attn_funcs() is not None


def mask_features(mask: AttentionMask, documents: bool) -> list[tuple[str, str]]:
    """[(feature, the flag that asks for it)] of a model's mask."""
    wanted = []
    if mask.window is not None:
        wanted.append(("window", "--window-size"))
    if documents:
        wanted.append(("documents", "--reset-attention-mask"))
    if mask.layout is not None:
        wanted.append(("sparse", "--attention-sparsity"))
    return wanted


def select_backend(name: str, device: torch.device, dtype: torch.dtype = torch.float32,
                   mask: Optional[AttentionMask] = None, documents: bool = False,
                   dropout: float = 0.0) -> tuple[str, AttentionCore]:
    """Resolve --attention-backend for this mask; ValueError (one line naming the flag and
    the backend) where the backend cannot run it.

    `auto`: CUDA: flash_attn (16-bit, where installed and the mask allows), else flex for
    masks (the block backend with attention dropout: flex has none), else SDPA. CPU:
    `cpu_attention`, named "sdpa", which uses explicit attention by query blocks where
    that is faster (fp32, s <= CPU_BLOCK_MAX_SEQ), torch SDPA otherwise; named "block"
    for any mask but plain causal, and for attention dropout (dropout.py's positional
    mask: every grid draws what one process draws).
    Attention dropout on flash or SDPA comes from their own RNG: logged, as no grid then
    equals one process.
    """
    mask = mask or AttentionMask()
    wanted = mask_features(mask, documents)
    half = dtype in (torch.float16, torch.bfloat16)
    if name == "auto":
        name = _auto(device, half, [f for f, _ in wanted], dropout)
        if name == "cpu":
            name = "block" if wanted or dropout else "sdpa"
            _check(name, BACKENDS[name], device, half, wanted, dropout)
            if dropout:
                log.info("attention backend: auto -> block (CPU, attention dropout %g by a "
                         "positional hash: the same masks on every grid)", dropout)
            elif wanted:
                log.info("attention backend: auto -> block (CPU, the mask's blocks only)")
            else:
                log.info("attention backend: auto -> sdpa (CPU: query-block explicit "
                         "attention for fp32 without dropout up to seq %d, torch SDPA "
                         "otherwise)", CPU_BLOCK_MAX_SEQ)
            return name, cpu_attention
        log.info("attention backend: auto -> %s", name)
    else:
        log.info("attention backend: %s", name)
    backend = BACKENDS[name]
    _check(name, backend, device, half, wanted, dropout)
    if dropout and name in ("sdpa", "flash"):
        log.info("attention dropout %g from the %s kernel's own RNG: no grid equals one "
                 "process (--attention-backend block or math: a positional mask that does)",
                 dropout, name)
    elif dropout:
        log.info("attention dropout %g by a positional hash (model/attention/dropout.py)",
                 dropout)
    return name, backend.core


def _auto(device: torch.device, half: bool, wanted: list[str], dropout: float = 0.0) -> str:
    if device.type != "cuda":
        return "cpu"
    if half and flash_available(device) and set(wanted) <= set(BACKENDS["flash"].masks):
        return "flash"
    if wanted:
        return "block" if dropout else "flex"
    return "sdpa"


def _check(name: str, backend: Backend, device, half: bool, wanted, dropout: float):
    flag = "--attention-backend"
    if backend.cuda_only and device.type != "cuda":
        raise ValueError(f"{flag}: {name} needs CUDA")
    if name == "flash" and not (flash_available(device) and half):
        raise ValueError(f"{flag}: flash needs CUDA, the flash_attn package and --bf16 or "
                         "--fp16")
    for feature, feature_flag in wanted:
        if feature not in backend.masks:
            raise ValueError(f"{feature_flag}: the {name} attention backend cannot run it "
                             f"(backends that can: "
                             f"{', '.join(n for n, b in BACKENDS.items() if feature in b.masks)})")
    if dropout and not backend.dropout:
        raise ValueError(f"--attention-dropout: the {name} attention backend has no dropout")
