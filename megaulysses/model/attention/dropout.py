"""Attention dropout as a function of coordinates: whether the probability of query i for
key j, head h, sample n is dropped is a counter-based hash of (this call's key, n, h, i, j)
-- global head index and global positions -- so it does not depend on how the computation
is cut: the block kernel, a ring step, an FPDT chunk pair, a group of heads, a Ulysses or
tensor-parallel rank each compute the part they hold and draw exactly the elements one
process would draw for it.

The key. `AttentionDropout.draw` takes one 62-bit number from torch's default CPU generator
per attention call (SelfAttention calls it once per layer and micro-batch; --seed seeds the
generator): so it follows the seed, the layer (the draws come in layer order) and the step,
and a recomputation (torch.utils.checkpoint restores the CPU generator first; or the key is
drawn outside the checkpoint) gets the same key and so the same mask. The heads are
numbered globally: `head` is the global index of the core's first head, and every wrapper
that hands a core a slice of the heads (tensor parallelism, Ulysses, head groups) shifts it
(`shifted`).

Where a grid equals one process with dropout on: wherever the key is the same, i.e. every
rank's CPU generator has made the same draws before -- true for Ulysses, the ring, FPDT,
head groups and tensor parallelism with --hidden-dropout 0 (hidden dropout on CPU draws
from the same generator, per element of the rank's own slice: then the ranks of a grid
agree among themselves but not with one process; on CUDA hidden dropout uses the CUDA
generator and does not disturb the keys). Where it cannot: the fused kernels' own dropout
(torch SDPA, flash-attn: `--attention-backend sdpa|flash`, and `auto` on CUDA for plain
causal or flash's masks) draws from the device RNG by its own element order; no grid equals
one process there. `kernel_rng` seeds that generator per call from (key, first head) and
restores it after: each rank's heads draw their own masks (one seed on every tensor-parallel
or Ulysses rank would give their head 0 the same mask), a recomputation draws the same
masks, and the generator's stream (hidden dropout's) does not move.
Samples are numbered within the micro-batch, so data parallel ranks draw alike-shaped
but unrelated masks (their data differ anyway).

The hash: 32-bit words in int64 tensors (no overflow: see `_mix`); a row word from (key,
sample, head, query position) by four rounds of Wellons' lowbias32 mixer, then per element
two more rounds with the key position. Dropped where the word < t = round(p 2^32); kept
ones are scaled by 2^32 / (2^32 - t), the exact inverse of the keep probability, so the
expectation of every probability is exact (the scale differs from 1/(1-p) by < 2^-32).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Iterator, Optional, Union

import torch

_M32 = 0xFFFFFFFF
# lowbias32's multipliers (Wellons, hash-prospector); the second one minus 2^32: the same
# product mod 2^32, and |x * c| < 2^63 for x < 2^32, so int64 never overflows.
_C1 = 0x7FEB352D
_C2 = 0x846CA68B - (1 << 32)
_GOLDEN = 0x9E3779B9


def _mix_(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 `x` holding 32-bit words, in place: a bijection of 2^32."""
    x.bitwise_and_(_M32)
    x.bitwise_xor_(x >> 16)
    x.mul_(_C1).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 15)
    x.mul_(_C2).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 16)
    return x


def _mix_int(x: int) -> int:
    x &= _M32
    x ^= x >> 16
    x = (x * _C1) & _M32
    x ^= x >> 15
    x = (x * _C2) & _M32
    return x ^ (x >> 16)


@dataclass(frozen=True)
class AttentionDropout:
    """Dropout of the attention probabilities with probability `p`, the mask a function of
    (`key`, sample, global head, global query position, global key position); `head`: the
    global index of the core's head 0."""
    p: float
    key: int
    head: int = 0

    def __post_init__(self):
        if not 0.0 < self.p < 1.0:
            raise ValueError(f"attention dropout must be in (0, 1), got {self.p}")

    @staticmethod
    def draw(p: float, head: int = 0) -> "AttentionDropout":
        """A new call's dropout: its key from torch's default CPU generator."""
        key = int(torch.randint(0, 1 << 62, (), dtype=torch.int64))
        return AttentionDropout(float(p), key, head)

    def shifted(self, heads: int) -> "AttentionDropout":
        """The same dropout for a core whose head 0 is `heads` further on."""
        return replace(self, head=self.head + heads)

    @property
    def threshold(self) -> int:
        return min(int(round(self.p * (1 << 32))), (1 << 32) - 1)

    @property
    def scale(self) -> float:
        """1 / (keep probability), exactly: 2^32 / (2^32 - threshold)."""
        return float(1 << 32) / float((1 << 32) - self.threshold)

    def rows(self, samples: torch.Tensor, heads: torch.Tensor,
             qpos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two int64 words per (sample, head, query) row, `[n, H, Q]` each: samples `[n]`
        (index in the micro-batch), heads `[H]` (the core's own, 0-based), qpos `[Q]`
        (global positions)."""
        lo, hi = self.key & _M32, self.key >> 32
        base = _mix_int(lo ^ _mix_int(hi))
        r = _mix_(samples.to(torch.int64).view(-1, 1, 1) ^ base)  # [n, 1, 1]
        r = _mix_(r ^ (heads.to(torch.int64) + self.head).view(1, -1, 1))  # [n, H, 1]
        r = _mix_(r ^ qpos.to(torch.int64).view(1, 1, -1))  # [n, H, Q]
        return r, _mix_(r ^ _GOLDEN)

    def dropped(self, rows: tuple[torch.Tensor, torch.Tensor],
                kpos: torch.Tensor) -> torch.Tensor:
        """bool `[..., R, K]`: True where dropped, for row words `[..., R]` (`rows`) and
        global key positions `[K]`."""
        r1, r2 = rows
        x = _mix_(r1.unsqueeze(-1) ^ kpos.to(torch.int64))  # [..., R, K]
        x.bitwise_xor_(r2.unsqueeze(-1))
        return _mix_(x) < self.threshold

    def grouped_rows(self, samples: torch.Tensor, hkv: int, rep: int,
                     qpos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`rows` in the block kernel's grouped layout: `[n, hkv, Q * rep]`, rows ordered
        (position, head in group); q head g * rep + r is kv group g's r-th."""
        heads = torch.arange(hkv * rep, device=qpos.device)
        r1, r2 = (w.view(w.shape[0], hkv, rep, -1).transpose(2, 3).reshape(w.shape[0], hkv, -1)
                  for w in self.rows(samples, heads, qpos))
        return r1, r2

    def apply_(self, t: torch.Tensor, dropped: torch.Tensor) -> torch.Tensor:
        """t with the dropped entries zeroed and the kept ones scaled, in place."""
        return t.masked_fill_(dropped, 0.0).mul_(self.scale)

    @property
    def kernel_seed(self) -> int:
        """A seed for a fused kernel's own dropout RNG from (key, first head): 63 bits."""
        lo = _mix_int(self.key ^ _mix_int(self.head + _GOLDEN))
        hi = _mix_int(lo ^ (self.key >> 32) ^ _mix_int(self.head))
        return ((hi & 0x7FFFFFFF) << 32) | lo


@contextlib.contextmanager
def kernel_rng(dropout: "DropoutArg", device: torch.device) -> Iterator[None]:
    """Around a fused kernel with its own dropout (SDPA, flash-attn): with an
    AttentionDropout, the device's generator seeded from (key, first head) for the call and
    restored after. Each rank's heads (tensor parallel, Ulysses) then draw masks of their
    own (the same seed on every rank would give head 0 of every rank the same mask), the
    call is reproducible from --seed and its recomputation draws the same masks, and the
    generator's stream (the hidden dropout's) is not moved. The masks are the kernel's
    own, not the positional ones: no grid equals one process through them."""
    if not isinstance(dropout, AttentionDropout):
        yield
        return
    device = torch.device(device)
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else [],
                               device_type="cuda" if cuda else None):
        if cuda:
            index = device.index if device.index is not None else torch.cuda.current_device()
            torch.cuda.default_generators[index].manual_seed(dropout.kernel_seed)
        else:
            torch.default_generator.manual_seed(dropout.kernel_seed)
        yield


DropoutArg = Union[float, AttentionDropout, None]


def as_dropout(dropout: DropoutArg, head: int = 0) -> Optional[AttentionDropout]:
    """A core's `dropout_p` argument as an AttentionDropout (None: no dropout). A float > 0
    draws this call's key here (a caller that hands the same call to several cores, or to
    a recomputation, converts once and passes the object)."""
    if isinstance(dropout, AttentionDropout):
        return dropout
    if not dropout:
        return None
    return AttentionDropout.draw(dropout, head)


def dropout_prob(dropout: DropoutArg) -> float:
    """The probability alone, for kernels with their own dropout RNG (SDPA, flash-attn)."""
    if isinstance(dropout, AttentionDropout):
        return dropout.p
    return float(dropout or 0.0)
