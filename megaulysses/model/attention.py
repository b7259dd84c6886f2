"""Attention as data: `AttentionMask` says what each query may attend to; cores compute it.

Core protocol: `core(q, k, v, dropout_p=0.0, mask=None) -> out`, q `[b, s, hq, d]`, k and v
`[b, s, hkv, d]` with hq % hkv == 0 (GQA), out `[b, s, hq, d]`; `mask=None` is plain causal.
The layout is `[b, s, h, d]` on purpose: Ulysses re-shards exactly these tensors (sequence
<-> heads) around any core without the core knowing, and since each rank then holds the
whole sequence, the mask it passes on is the whole-sequence mask, unchanged.

A mask is stated in global token positions of the whole sample, so the ring of
`parallel/ring.py`, which holds other positions than 0..s-1, asks the same questions
(`allows`, `block_kinds`) with its own position lists.

Backends (`BACKENDS`, the one list; `--attention-backend`):
    math   explicit scores, dense [s, s] mask, fp32 softmax: the reference; any mask
    block  by blocks of queries and keys, skipping blocks the mask excludes (flash-style
           backward, nothing [s, s] kept): any mask, no dropout; `auto` on CPU
    sdpa   torch SDPA, causal only
    flash  the flash_attn package (CUDA, 16-bit): causal and window
    flex   torch flex_attention (CUDA): any mask, through a block mask
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megaulysses.config import ModelConfig

log = logging.getLogger(__name__)

SPARSITIES = ("dense", "fixed", "bigbird")

# Block kinds of `AttentionMask.block_kinds`: a (query block, key block) pair is skipped,
# computed with the element mask applied, or computed whole.
SKIP, PARTIAL, FULL = 0, 1, 2


@dataclass(frozen=True)
class SparseLayout:
    """Which key blocks each query block attends (before the causal rule), over blocks of
    `block` tokens of the whole sequence.

    fixed    (DeepSpeed's FixedSparsityConfig, unidirectional; Child et al. 2019): the
             sequence is cut into windows of `local` blocks; a block attends the blocks of
             its own window, and the last `global_` blocks of every window ("summary"
             blocks).
    bigbird  (Zaheer et al. 2020, causal): the `local` blocks ending at the query block, the
             first `global_` blocks, and `random` more earlier blocks drawn per query block
             from a generator seeded with `seed` (the same on every rank and step).
    """
    kind: str
    block: int
    local: int
    global_: int
    random: int = 0
    seed: int = 0

    def blocks(self, n: int) -> torch.Tensor:  # bool [n, n]: query block i, key block j
        """Cached: every layer and ring step asks for the same grid."""
        return _layout_blocks(self, n)

    def attended_fraction(self, n: int) -> float:
        """Attended blocks over those of dense causal attention (n (n + 1) / 2)."""
        return float(self.blocks(n).sum()) / (n * (n + 1) / 2)


@functools.lru_cache(maxsize=16)
def _layout_blocks(layout: SparseLayout, n: int) -> torch.Tensor:
    return _build_layout(layout.kind, layout.local, layout.global_, layout.random,
                         layout.seed, n)


def _build_layout(kind: str, local: int, global_: int, random: int, seed: int,
                  n: int) -> torch.Tensor:
    i = torch.arange(n).view(n, 1)
    j = torch.arange(n).view(1, n)
    if kind == "fixed":
        allowed = (j // local == i // local) | (j % local >= local - global_)
    elif kind == "bigbird":
        allowed = (i - j < local) | (j < global_)
        gen = torch.Generator().manual_seed(seed)
        for row in range(n):
            earlier = (~allowed[row, :row]).nonzero().flatten()  # not yet attended
            pick = torch.randperm(len(earlier), generator=gen)[:random]
            allowed[row, earlier[pick]] = True
    else:
        raise ValueError(f"unknown sparse layout {kind!r}")
    return allowed & (j <= i)


@dataclass(frozen=True, eq=False)
class AttentionMask:
    """Query i may attend key j (global positions in one sample) when every rule allows:
    causal j <= i; window i - window < j (the last `window` tokens, itself included);
    documents[b, i] == documents[b, j] (packed documents: ids non-decreasing along the
    sequence); the sparse layout's block of (i, j)."""
    causal: bool = True
    window: Optional[int] = None
    layout: Optional[SparseLayout] = None
    documents: Optional[torch.Tensor] = field(default=None, repr=False)  # [b, S] int

    def __post_init__(self):
        if self.window is not None and not self.causal:
            raise ValueError("a sliding window needs causal attention")

    @property
    def is_causal(self) -> bool:
        """Plain causal attention: every backend runs it."""
        return self.causal and self.window is None and self.layout is None \
            and self.documents is None

    def with_documents(self, documents: Optional[torch.Tensor]) -> "AttentionMask":
        return replace(self, documents=documents)

    def allows(self, qi: torch.Tensor, kj: torch.Tensor) -> torch.Tensor:
        """bool `[b or 1, len(qi), len(kj)]` for query positions qi and key positions kj."""
        i, j = qi.view(-1, 1), kj.view(1, -1)
        ok = torch.ones(len(qi), len(kj), dtype=torch.bool, device=qi.device)
        if self.causal:
            ok &= j <= i
        if self.window is not None:
            ok &= j > i - self.window
        if self.layout is not None:
            n = (int(max(qi.max(), kj.max())) // self.layout.block) + 1
            grid = self.layout.blocks(n).to(qi.device)
            ok &= grid[i // self.layout.block, j // self.layout.block]
        ok = ok.unsqueeze(0)
        if self.documents is not None:
            docs = self.documents
            ok = ok & (docs[:, qi].unsqueeze(2) == docs[:, kj].unsqueeze(1))
        return ok

    def block_kinds(self, qi: torch.Tensor, kj: torch.Tensor, block: int) -> torch.Tensor:
        """int8 `[b or 1, len(qi)/block, len(kj)/block]`: SKIP, PARTIAL or FULL for each
        pair of blocks of `block` consecutive entries of qi and kj. Every block must cover
        consecutive positions (checked): its range then decides without looking at pairs."""
        qlo, qhi = _block_ranges(qi, block)  # [nq] each
        klo, khi = _block_ranges(kj, block)
        qlo, qhi, klo, khi = qlo.view(-1, 1), qhi.view(-1, 1), klo.view(1, -1), khi.view(1, -1)
        kinds = torch.full((qlo.shape[0], klo.shape[1]), FULL, dtype=torch.int8,
                           device=qi.device)

        def rule(skip, full):  # the strictest of the rules wins
            kinds.copy_(torch.minimum(kinds, torch.where(
                skip, SKIP, torch.where(full, FULL, PARTIAL)).to(torch.int8)))

        if self.causal:
            rule(klo > qhi, khi <= qlo)
        if self.window is not None:
            rule(khi <= qlo - self.window, klo > qhi - self.window)
        if self.layout is not None:
            lb = self.layout.block
            if lb % block:
                raise ValueError(f"kernel block {block} must divide the layout block {lb}")
            grid = self.layout.blocks(int(max(qhi.max(), khi.max())) // lb + 1).to(qi.device)
            hit = grid[qlo // lb, klo // lb]
            rule(~hit, hit)
        kinds = kinds.unsqueeze(0)
        if self.documents is not None:  # ids are non-decreasing: compare ranges
            docs = self.documents
            dq_lo, dq_hi = docs[:, qlo.flatten()].unsqueeze(2), docs[:, qhi.flatten()].unsqueeze(2)
            dk_lo, dk_hi = docs[:, klo.flatten()].unsqueeze(1), docs[:, khi.flatten()].unsqueeze(1)
            skip = (dk_hi < dq_lo) | (dk_lo > dq_hi)
            full = (dq_lo == dq_hi) & (dk_lo == dk_hi) & (dq_lo == dk_lo)
            doc_kinds = torch.where(skip, SKIP, torch.where(full, FULL, PARTIAL)).to(torch.int8)
            kinds = torch.minimum(kinds, doc_kinds)
        return kinds

    def attended_fraction(self, seq_length: int) -> float:
        """Computed (query, key) blocks over dense causal attention's, for this static mask
        (documents excluded: they depend on the data). 1.0 for dense causal."""
        if self.window is None and self.layout is None:
            return 1.0
        block = self.layout.block if self.layout is not None else min(64, seq_length)
        while seq_length % block:
            block //= 2
        pos = torch.arange(seq_length)
        kinds = AttentionMask(self.causal, self.window, self.layout).block_kinds(pos, pos, block)
        n = seq_length // block
        return float((kinds > SKIP).sum()) / (n * (n + 1) / 2)


def _block_ranges(pos: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    if len(pos) % block:
        raise ValueError(f"{len(pos)} positions are not a whole number of blocks of {block}")
    blocks = pos.view(-1, block)
    lo, hi = blocks[:, 0], blocks[:, -1]
    if not bool(((hi - lo) == block - 1).all()):
        raise ValueError(f"blocks of {block} positions must be consecutive")
    return lo, hi


def mask_from_config(m: ModelConfig) -> AttentionMask:
    """The static part of a model's mask (documents come with each batch)."""
    layout = None
    if m.attention_sparsity != "dense":
        layout = SparseLayout(m.attention_sparsity, m.sparse_block_size, m.sparse_local_blocks,
                              m.sparse_global_blocks, m.sparse_random_blocks, m.sparse_seed)
    return AttentionMask(causal=True, window=m.window_size, layout=layout)


AttentionCore = Callable[..., torch.Tensor]  # (q, k, v, dropout_p=0.0, mask=None) -> out


def math_attention(q, k, v, dropout_p: float = 0.0, mask: Optional[AttentionMask] = None):
    """The plain reference: explicit scores, dense mask and softmax in fp32."""
    b, s, hq, d = q.shape
    rep = hq // k.shape[2]
    k = k.repeat_interleave(rep, dim=2)  # [b, s, hq, d]: kv head j serves q heads j*rep..
    v = v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) / math.sqrt(d)
    pos = torch.arange(s, device=q.device)
    allowed = (mask or AttentionMask()).allows(pos, pos).unsqueeze(1)  # [b|1, 1, s, s]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    probs = probs.nan_to_num(0.0)  # a row with nothing allowed (never in a causal mask)
    probs = F.dropout(probs, p=dropout_p, training=dropout_p > 0)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v.float())
    return out.to(q.dtype)  # [b, s, hq, d]


def sdpa_attention(q, k, v, dropout_p: float = 0.0, mask: Optional[AttentionMask] = None):
    """torch SDPA: flash-style kernels on CPU and CUDA (no s x s matrix for causal)."""
    _require_causal(mask, "sdpa")
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, h, s, d]
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)  # [b, s, hq, d]


def block_attention(q, k, v, dropout_p: float = 0.0, mask: Optional[AttentionMask] = None):
    """Blocks of queries x keys, only those the mask reaches (model/block_attention.py)."""
    from megaulysses.model.block_attention import masked_block_attention
    if dropout_p:
        raise ValueError("the block attention backend has no dropout")
    return masked_block_attention(q, k, v, mask or AttentionMask())


# Up to this length, on CPU in fp32, explicit attention by query blocks beats SDPA's CPU flash
# kernel (forward + backward, b=4, h=8, d=64, 2 threads: 1.1x at s=256, 1.2-1.4x at 512,
# 1.1x at 1024, ~1x at 2048); beyond it the probabilities it keeps for backward
# (b * h * s^2 / 2 per layer) cost more memory than they save time, and SDPA is used.
CPU_BLOCK_MAX_SEQ = 1024


def cpu_attention(q, k, v, dropout_p: float = 0.0, mask: Optional[AttentionMask] = None):
    """`auto` on CPU. Plain causal: block_causal_attention for fp32, no dropout, moderate
    s, else SDPA. Any other mask: the block backend (skips the blocks the mask excludes)."""
    from megaulysses.model.fused import block_causal_attention
    if mask is not None and not mask.is_causal:
        return block_attention(q, k, v, dropout_p, mask)
    if (q.device.type == "cpu" and q.dtype == torch.float32 and dropout_p == 0.0
            and q.shape[1] <= CPU_BLOCK_MAX_SEQ):
        return block_causal_attention(q, k, v)
    return sdpa_attention(q, k, v, dropout_p)


def _flash_attn_funcs():
    try:
        from flash_attn import flash_attn_func, flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_func, flash_attn_varlen_func


def flash_attention(q, k, v, dropout_p: float = 0.0, mask: Optional[AttentionMask] = None):
    """The flash_attn package (CUDA, fp16/bf16): [b, s, h, d], GQA, causal, window; packed
    documents through its varlen kernel (the batch flattened, one sequence per document)."""
    mask = mask or AttentionMask()
    if mask.layout is not None:
        raise ValueError("the flash backend has no block-sparse layouts")
    func, varlen = _flash_attn_funcs()
    window = (-1, -1) if mask.window is None else (mask.window - 1, 0)
    # its backward adds with atomics unless told not to (--deterministic)
    deterministic = torch.are_deterministic_algorithms_enabled()
    if mask.documents is None:
        return func(q, k, v, dropout_p=dropout_p, causal=True, window_size=window,
                    deterministic=deterministic)
    b, s = q.shape[:2]
    starts = _document_starts(mask.documents)  # cumulative, int32, over the flattened batch
    longest = int((starts[1:] - starts[:-1]).max())
    flat = [t.reshape(b * s, *t.shape[2:]) for t in (q, k, v)]
    out = varlen(*flat, starts, starts, longest, longest, dropout_p=dropout_p, causal=True,
                 window_size=window, deterministic=deterministic)
    return out.view(b, s, *out.shape[1:])


def _document_starts(documents: torch.Tensor) -> torch.Tensor:
    """cu_seqlens for the flattened batch: offsets where a document (or a sample) starts."""
    b, s = documents.shape
    new = torch.ones_like(documents, dtype=torch.bool)
    new[:, 1:] = documents[:, 1:] != documents[:, :-1]
    starts = new.flatten().nonzero().flatten()
    end = torch.tensor([b * s], device=documents.device)
    return torch.cat([starts, end]).to(torch.int32)


def flex_attention(q, k, v, dropout_p: float = 0.0, mask: Optional[AttentionMask] = None):
    """torch flex_attention (CUDA): the mask as a mask_mod, fully masked blocks skipped by
    its block mask. Compiled once per mask shape."""
    from torch.nn.attention.flex_attention import create_block_mask
    if dropout_p:
        raise ValueError("the flex backend has no dropout")
    mask = mask or AttentionMask()
    b, s, hq, d = q.shape
    grid = _layout_grid(mask.layout, s, q.device) if mask.layout is not None else None

    def mask_mod(bi, h, i, j):
        ok = j <= i
        if mask.window is not None:
            ok = ok & (j > i - mask.window)
        if mask.documents is not None:
            ok = ok & (mask.documents[bi, i] == mask.documents[bi, j])
        if grid is not None:
            ok = ok & grid[i // mask.layout.block, j // mask.layout.block]
        return ok

    block_mask = create_block_mask(mask_mod, b if mask.documents is not None else None, None,
                                   s, s, device=q.device)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, h, s, d]
    out = _compiled_flex()(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


@functools.cache
def _compiled_flex():
    """flex_attention runs its fused kernel only compiled (eager is a slow reference)."""
    from torch.nn.attention.flex_attention import flex_attention as flex
    return torch.compile(flex, dynamic=False)


def _layout_grid(layout: SparseLayout, s: int, device) -> torch.Tensor:
    return layout.blocks(-(-s // layout.block)).to(device)


def _require_causal(mask: Optional[AttentionMask], backend: str):
    if mask is not None and not mask.is_causal:
        raise ValueError(f"the {backend} backend runs plain causal attention only")


@dataclass(frozen=True)
class Backend:
    core: AttentionCore
    masks: tuple  # which of "window", "documents", "sparse" it runs
    dropout: bool
    cuda_only: bool = False
    half_only: bool = False


BACKENDS = {
    "math": Backend(math_attention, ("window", "documents", "sparse"), dropout=True),
    "block": Backend(block_attention, ("window", "documents", "sparse"), dropout=False),
    "sdpa": Backend(sdpa_attention, (), dropout=True),
    "flash": Backend(flash_attention, ("window", "documents"), dropout=True, cuda_only=True,
                     half_only=True),
    "flex": Backend(flex_attention, ("window", "documents", "sparse"), dropout=False,
                    cuda_only=True),
}
BACKEND_CHOICES = ("auto",) + tuple(BACKENDS)


def flash_available(device: torch.device) -> bool:
    return device.type == "cuda" and _flash_attn_funcs() is not None


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
    masks, else SDPA. CPU: name "sdpa" with `cpu_attention`, which uses explicit attention by
    query blocks where that is faster (fp32, no dropout, s <= CPU_BLOCK_MAX_SEQ), torch
    SDPA otherwise, and the block backend for any mask but plain causal.
    """
    mask = mask or AttentionMask()
    wanted = mask_features(mask, documents)
    half = dtype in (torch.float16, torch.bfloat16)
    if name == "auto":
        name = _auto(device, half, [f for f, _ in wanted])
        if name == "cpu":
            name = "block" if wanted else "sdpa"
            _check(name, BACKENDS[name], device, half, wanted, dropout)
            if wanted:
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
    return name, backend.core


def _auto(device: torch.device, half: bool, wanted: list[str]) -> str:
    if device.type != "cuda":
        return "cpu"
    if half and flash_available(device) and set(wanted) <= set(BACKENDS["flash"].masks):
        return "flash"
    return "flex" if wanted else "sdpa"


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
