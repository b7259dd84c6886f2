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

What a kernel derives from a mask once per batch (flex's block mask, flash's cu_seqlens)
is kept on the mask (`AttentionMask.prepared`): the GPT makes one mask per forward and
hands that same object to every layer and to recomputation, so the first layer builds it
and the others, and backward's recomputation, reuse it (no per-layer host syncs).
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
    # What kernels derive from this mask and batch, by key (`prepared`). Not an init field,
    # so `replace`/`with_documents` start a new one: the values belong to these documents.
    _prepared: dict = field(default_factory=dict, init=False, repr=False, compare=False)

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

    def prepared(self, key: tuple, build: Callable[[], object]):
        """`build()`'s value for `key`, built on the first call and then reused: every
        layer of a forward, and its recomputation, get this same mask object."""
        if key not in self._prepared:
            self._prepared[key] = build()
        return self._prepared[key]

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
    hq, d = q.shape[2:]
    hkv = k.shape[2]
    gqa = hq != hkv
    if gqa and sdpa_repeats_kv(q.device.type, q.dtype, hq, hkv, d):
        # kv head j serves q heads j*rep..(j+1)*rep-1, as enable_gqa would
        k, v = (t.repeat_interleave(hq // hkv, dim=2) for t in (k, v))  # [b, s, hq, d]
        gqa = False
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, h, s, d]
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                         enable_gqa=gqa)
    return out.transpose(1, 2)  # [b, s, hq, d]


def sdpa_repeats_kv(device_type: str, dtype: torch.dtype, hq: int, hkv: int,
                    head_dim: int) -> bool:
    """Whether SDPA gets k and v repeated to hq heads instead of `enable_gqa`.

    On CUDA only SDPA's flash kernel (fp16/bf16, head dim a multiple of 8 up to 256) runs
    GQA; anything else with enable_gqa falls to the math kernel, which forms the whole
    [b, h, s, s] scores. The memory-efficient kernel runs fp32 (and those head dims) in
    O(s) memory but has no GQA, so it gets repeated heads: (hq/hkv - 1) x the k/v size
    more, instead of s x s. On CPU SDPA's flash kernel runs GQA in every dtype."""
    if device_type != "cuda" or hq == hkv:
        return False
    flash_runs = dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0 \
        and head_dim <= 256
    return not flash_runs


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
    documents through its varlen kernel (the batch flattened, one sequence per document),
    with cu_seqlens made once per batch (`flash_varlen_args`): no host sync per layer."""
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
    cu_seqlens, longest = flash_varlen_args(mask, q.device)
    flat = [t.reshape(b * s, *t.shape[2:]) for t in (q, k, v)]  # [b * s, h, d]
    out = varlen(*flat, cu_seqlens, cu_seqlens, longest, longest, dropout_p=dropout_p,
                 causal=True, window_size=window, deterministic=deterministic)
    return out.view(b, s, *out.shape[1:])  # [b, s, hq, d]


def flash_varlen_args(mask: AttentionMask, device: torch.device) -> tuple[torch.Tensor, int]:
    """(cu_seqlens, max_seqlen) of the mask's documents on `device`, once per batch."""
    return mask.prepared(("flash-varlen", torch.device(device)),
                         lambda: _cu_seqlens_on(mask.documents, device))


def _cu_seqlens_on(documents: torch.Tensor, device) -> tuple[torch.Tensor, int]:
    cu_seqlens, longest = document_cu_seqlens(documents)
    return cu_seqlens.to(device), longest


def document_cu_seqlens(documents: torch.Tensor) -> tuple[torch.Tensor, int]:
    """flash-attn's varlen arguments for packed documents `[b, s]` (ids non-decreasing
    along each sample), the batch flattened to b * s tokens: cu_seqlens, int32
    `[n + 1]`, where each of the n sequences (a document, cut at sample ends) starts,
    then b * s; and max_seqlen, the longest one, a Python int (one host sync)."""
    b, s = documents.shape
    new = torch.ones_like(documents, dtype=torch.bool)  # [b, s]: a sequence starts here
    new[:, 1:] = documents[:, 1:] != documents[:, :-1]
    starts = new.flatten().nonzero().flatten()  # [n]
    end = torch.full((1,), b * s, dtype=starts.dtype, device=starts.device)
    cu_seqlens = torch.cat([starts, end]).to(torch.int32)  # [n + 1]
    return cu_seqlens, int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


def flex_attention(q, k, v, dropout_p: float = 0.0, mask: Optional[AttentionMask] = None):
    """torch flex_attention (CUDA): the mask as a mask_mod, fully masked blocks skipped by
    its block mask (`flex_block_mask`: made once per batch, never an s x s tensor).
    Compiled once per mask shape."""
    if dropout_p:
        raise ValueError("the flex backend has no dropout")
    mask = mask or AttentionMask()
    block_mask = flex_block_mask(mask, q.shape[1], q.device)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, h, s, d]
    out = _compiled_flex()(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)  # [b, s, hq, d]


@functools.cache
def _compiled_flex():
    """flex_attention runs its fused kernel only compiled (eager is a slow reference)."""
    from torch.nn.attention.flex_attention import flex_attention as flex
    return torch.compile(flex, dynamic=False)


# flex_attention's sparse block: its block mask has one entry per FLEX_BLOCK x FLEX_BLOCK
# tile (torch's default; its CUDA kernels' tiles divide it).
FLEX_BLOCK = 128


def flex_block_mask(mask: AttentionMask, s: int, device):
    """flex_attention's BlockMask of `mask` over s positions. With documents: built once
    per batch, kept on the mask (every layer and recomputation reuse it); without: once
    per (static mask, s, device) for the whole run.

    Built from `AttentionMask.block_kinds` (each tile's SKIP/PARTIAL/FULL from position
    ranges), so nothing s x s is made, eager and without compiling. torch's
    create_block_mask would evaluate the mask_mod on every (i, j): a dense
    [b, h, s, s] bool unless torch.compile fuses it away (its `_compile` flag is
    deprecated in torch 2.13 for torch.compile(create_block_mask), a compile per shape)."""
    device = torch.device(device)
    if mask.documents is None:
        return _static_flex_block_mask(mask.causal, mask.window, mask.layout, s, device)
    return mask.prepared(("flex", s, device), lambda: _build_flex_block_mask(mask, s, device))


@functools.lru_cache(maxsize=8)
def _static_flex_block_mask(causal: bool, window: Optional[int],
                            layout: Optional[SparseLayout], s: int, device: torch.device):
    return _build_flex_block_mask(AttentionMask(causal, window, layout), s, device)


@torch.no_grad()
def _build_flex_block_mask(mask: AttentionMask, s: int, device: torch.device):
    from torch.nn.attention.flex_attention import BlockMask
    n = -(-s // FLEX_BLOCK)  # tiles per side; the last one may reach past s
    padded = n * FLEX_BLOCK
    docs = None if mask.documents is None else _pad_documents(mask.documents.to(device),
                                                                padded)
    grid_mask = replace(mask, documents=docs)  # [b, padded] ids: in range for every tile
    kinds = _tile_kinds(grid_mask, padded, device)  # int8 [b or 1, n, n]
    if padded > s:  # as create_block_mask: a tile reaching past s is never FULL
        kinds[:, -1, :].clamp_(max=PARTIAL)
        kinds[:, :, -1].clamp_(max=PARTIAL)
    kinds = kinds.unsqueeze(1)  # [b or 1, 1, n, n]: the same for every head
    kv_num, kv_idx = _ordered_tiles(kinds == PARTIAL)
    full_num, full_idx = _ordered_tiles(kinds == FULL)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, FLEX_BLOCK,
                                    _flex_mask_mod(mask, docs, padded, device),
                                    seq_lengths=(s, s))


def _pad_documents(documents: torch.Tensor, length: int) -> torch.Tensor:
    """`[b, s]` -> `[b, length]`, the last id repeated: flex's kernels may evaluate the
    mask_mod on positions of the last tile past s (their scores are dropped)."""
    extra = length - documents.shape[1]
    return torch.cat([documents, documents[:, -1:].expand(-1, extra)], dim=1)


def _tile_kinds(mask: AttentionMask, padded: int, device) -> torch.Tensor:
    """int8 `[b or 1, n, n]`: SKIP, PARTIAL or FULL for each FLEX_BLOCK tile. A layout
    block smaller than the tile: its kinds by layout blocks, then a tile is SKIP (FULL)
    when all its parts are, else PARTIAL."""
    fine = FLEX_BLOCK if mask.layout is None else math.gcd(FLEX_BLOCK, mask.layout.block)
    pos = torch.arange(padded, device=device)
    kinds = mask.block_kinds(pos, pos, fine)  # [b or 1, padded/fine, padded/fine]
    if fine == FLEX_BLOCK:
        return kinds
    r, n = FLEX_BLOCK // fine, padded // FLEX_BLOCK
    parts = kinds.view(kinds.shape[0], n, r, n, r)
    lo, hi = parts.amin(dim=(2, 4)), parts.amax(dim=(2, 4))  # [b or 1, n, n]
    return torch.where(hi == SKIP, SKIP, torch.where(lo == FULL, FULL, PARTIAL)).to(torch.int8)


def _ordered_tiles(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool `[b, h, n, n]` -> BlockMask's (count `[b, h, n]`, key tile indices
    `[b, h, n, n]`, the selected ones first in ascending order), int32."""
    count = dense.sum(dim=-1, dtype=torch.int32)
    order = torch.sort(dense.to(torch.int8), dim=-1, descending=True, stable=True).indices
    return count, order.to(torch.int32)


def _flex_mask_mod(mask: AttentionMask, docs: Optional[torch.Tensor], padded: int, device):
    """The element rule, for the PARTIAL tiles: (b, h, i, j) -> bool, indexing only
    tensors that cover every position of the padded tiles."""
    causal, window, layout = mask.causal, mask.window, mask.layout
    grid = None if layout is None else layout.blocks(-(-padded // layout.block)).to(device)

    def mask_mod(bi, h, i, j):
        ok = j <= i if causal else j >= 0  # j >= 0: every key
        if window is not None:
            ok = ok & (j > i - window)
        if docs is not None:
            ok = ok & (docs[bi, i] == docs[bi, j])
        if grid is not None:
            ok = ok & grid[i // layout.block, j // layout.block]
        return ok

    return mask_mod


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
