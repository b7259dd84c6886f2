"""The attention cores, `core(q, k, v, dropout_p=0.0, mask=None) -> out` on `[b, s, h, d]`
(package doc): `math_attention` (the reference), `sdpa_attention` (torch SDPA, causal only),
`block_attention` (the block kernel of block.py, any mask, attention dropout by dropout.py's
positional mask), `cpu_attention` (`auto` on CPU: block_causal.py's kernel up to
`CPU_BLOCK_MAX_SEQ`, else SDPA; the block kernel for masks and attention dropout),
`flash_attention` (the flash_attn package, with its varlen arguments for packed documents)
and `flex_attention` (torch flex_attention, with its block masks, `flex_block_mask`).

What a kernel derives from a mask once per batch (flex's block mask, flash's cu_seqlens)
is kept on the mask (`AttentionMask.prepared`): the GPT makes one mask per forward and
hands that same object to every layer and to recomputation, so the first layer builds it
and the others, and backward's recomputation, reuse it (no per-layer host syncs).
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Optional, Union

import torch
import torch.nn.functional as F

from megaulysses.model.attention.block import masked_block_attention
from megaulysses.model.attention.block_causal import block_causal_attention
from megaulysses.model.attention.dropout import DropoutArg, as_dropout, dropout_prob, kernel_rng
from megaulysses.model.attention.mask import FULL, PARTIAL, SKIP, AttentionMask, SparseLayout

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

AttentionCore = Callable[..., torch.Tensor]  # (q, k, v, dropout_p=0.0, mask=None) -> out


def math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   dropout_p: DropoutArg = 0.0,
                   mask: Optional[AttentionMask] = None) -> torch.Tensor:
    """The plain reference: explicit scores, dense mask and softmax in fp32; dropout by
    dropout.py's positional mask (the one every other kernel with it draws)."""
    b, s, hq, d = q.shape
    rep = hq // k.shape[2]
    k = k.repeat_interleave(rep, dim=2)  # [b, s, hq, d]: kv head j serves q heads j*rep..
    v = v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) / math.sqrt(d)
    pos = torch.arange(s, device=q.device)
    allowed = (mask or AttentionMask()).allows(pos, pos).unsqueeze(1)  # [b|1, 1, s, s]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    probs = probs.nan_to_num(0.0)  # a row with nothing allowed (never in a causal mask)
    drop = as_dropout(dropout_p)
    if drop is not None:  # [b, hq, s, s]: sample, head, query, key
        rows = drop.rows(torch.arange(b, device=q.device), torch.arange(hq, device=q.device),
                         pos)
        probs = probs.masked_fill(drop.dropped(rows, pos), 0.0) * drop.scale
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v.float())
    return out.to(q.dtype)  # [b, s, hq, d]


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   dropout_p: DropoutArg = 0.0,
                   mask: Optional[AttentionMask] = None) -> torch.Tensor:
    """torch SDPA: flash-style kernels on CPU and CUDA (no s x s matrix for causal).
    Dropout from SDPA's own RNG (the device's generator, its element order; seeded per
    call and first head, `kernel_rng`): not the positional mask, so no grid equals one
    process with it."""
    _require_causal(mask, "sdpa")
    hq, d = q.shape[2:]
    hkv = k.shape[2]
    gqa = hq != hkv
    if gqa and sdpa_repeats_kv(q.device.type, q.dtype, hq, hkv, d):
        # kv head j serves q heads j*rep..(j+1)*rep-1, as enable_gqa would
        k, v = (t.repeat_interleave(hq // hkv, dim=2) for t in (k, v))  # [b, s, hq, d]
        gqa = False
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, h, s, d]
    with kernel_rng(dropout_p, q.device):
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_prob(dropout_p),
                                             is_causal=True, enable_gqa=gqa)
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


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    dropout_p: DropoutArg = 0.0,
                    mask: Optional[AttentionMask] = None) -> torch.Tensor:
    """Blocks of queries x keys, only those the mask reaches (block.py); dropout by the
    positional mask (dropout.py)."""
    return masked_block_attention(q, k, v, mask or AttentionMask(), as_dropout(dropout_p))


# Up to this length, on CPU in fp32, explicit attention by query blocks beats SDPA's CPU flash
# kernel (forward + backward, b=4, h=8, d=64, 2 threads: 1.1x at s=256, 1.2-1.4x at 512,
# 1.1x at 1024, ~1x at 2048); beyond it the probabilities it keeps for backward
# (b * h * s^2 / 2 per layer) cost more memory than they save time, and SDPA is used.
CPU_BLOCK_MAX_SEQ = 1024


def cpu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  dropout_p: DropoutArg = 0.0,
                  mask: Optional[AttentionMask] = None) -> torch.Tensor:
    """`auto` on CPU. Plain causal without dropout: block_causal_attention for fp32 and
    moderate s, else SDPA. Any other mask, and any attention dropout: the block backend
    (skips the blocks the mask excludes; dropout by the positional mask, so a grid equals
    one process, where CPU SDPA's own dropout would run its math path and draw from the
    CPU generator in its own order)."""
    if (mask is not None and not mask.is_causal) or dropout_p:
        return block_attention(q, k, v, dropout_p, mask)
    if (q.device.type == "cpu" and q.dtype == torch.float32
            and q.shape[1] <= CPU_BLOCK_MAX_SEQ):
        return block_causal_attention(q, k, v)
    return sdpa_attention(q, k, v)


def _flash_attn_funcs():
    try:
        from flash_attn import flash_attn_func, flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_func, flash_attn_varlen_func


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    dropout_p: DropoutArg = 0.0,
                    mask: Optional[AttentionMask] = None) -> torch.Tensor:
    """The flash_attn package (CUDA, fp16/bf16): [b, s, h, d], GQA, causal, window; packed
    documents through its varlen kernel (the batch flattened, one sequence per document),
    with cu_seqlens made once per batch (`flash_varlen_args`): no host sync per layer.
    Dropout from flash-attn's own RNG (the CUDA generator, seeded per call and first head,
    `kernel_rng`): no grid equals one process."""
    with kernel_rng(dropout_p, q.device):
        return _flash(q, k, v, dropout_prob(dropout_p), mask)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
           mask: Optional[AttentionMask]) -> torch.Tensor:
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
    documents = mask.documents
    if documents is None:
        raise ValueError("flash_varlen_args: the mask has no documents (only a "
                         "--reset-attention-mask batch cuts the sequence into them)")
    return mask.prepared(("flash-varlen", torch.device(device)),
                         lambda: _cu_seqlens_on(documents, device))


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


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   dropout_p: DropoutArg = 0.0,
                   mask: Optional[AttentionMask] = None) -> torch.Tensor:
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


def flex_block_mask(mask: AttentionMask, s: int,
                    device: Union[torch.device, str]) -> BlockMask:
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
