"""What each query may attend to: `AttentionMask` (causal, sliding window, packed documents,
a block-sparse layout) and `SparseLayout`, the block kinds (SKIP, PARTIAL, FULL) the kernels
plan with, and `mask_from_config`.

A mask is stated in global token positions of the whole sample, so the ring of
`parallel/ring.py`, which holds other positions than 0..s-1, asks the same questions
(`allows`, `block_kinds`) with its own position lists.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, TypeVar

import torch

from megaulysses.config import ModelConfig

_T = TypeVar("_T")

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

    def prepared(self, key: tuple, build: Callable[[], _T]) -> _T:
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

