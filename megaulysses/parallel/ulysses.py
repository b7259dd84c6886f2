"""Ulysses sequence parallelism (arXiv 2309.14509) around any attention core.

Each of the P ranks of the "sp" mesh dim holds a slice of the sequence. Before attention
an all-to-all trades the sequence slice for a slice of the heads, so each rank attends
over the whole sequence for h/P heads with the unchanged core; a second all-to-all trades
back. Rotary embedding was applied before, with global positions, so nothing here knows
about positions; the attention mask (model/attention/) is stated over the whole sequence,
which is what each rank holds after the first all-to-all, so it passes through unchanged.
Under Ulysses x Ring (parallel/ring.py) the core is the ring, and "the whole sequence" is
the ring rank's two zigzag chunks, which the ring knows the positions of.

GQA: kv heads divisible by P are split like q. When P is a multiple of the kv heads,
each kv head is repeated P/hkv times (not hq/hkv times) before the exchange, so each rank
receives exactly the one kv head its q heads read.

Bytes sent per rank per layer (forward; backward sends the same again):
    (q + out)  2 * b*S*hq*d * bytes * (P-1)/P^2
    (k + v)    2 * b*S*max(hkv, P)*d * bytes * (P-1)/P^2
MHA (hq = hkv = h/d heads): 4 * b*S*h * bytes * (P-1)/P^2, the paper's 4Nh/P per layer
up to the (P-1)/P a rank keeps for itself.

Overlap (a2a_overlap.py): q, k and v's exchanges are issued together and waited for in
order, their gradients' likewise; nothing else computes meanwhile (the core needs all
three), and the output's exchange waits (the out-projection needs it). Hiding them behind
attention takes pieces: --attention-head-groups (one group ahead) or FPDT (one chunk).

Memory: SelfAttention hands q, k and v over (`take`), so each sequence-sharded tensor is
freed once issued (its packed send copy once waited for); the whole-sequence q, k, v and
out of all the rank's heads exist at once (one layer's core). --attention-head-groups runs them one group of heads at a time
(parallel/head_groups.py, around this wrapper's three exchanges).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megaulysses.model.attention import AttentionCore
from megaulysses.model.attention.dropout import DropoutArg, as_dropout
from megaulysses.parallel.a2a_overlap import Exchange, start
from megaulysses.parallel.blocks import blocks
from megaulysses.parallel.comm import Comm
from megaulysses.parallel.dims import SP

if TYPE_CHECKING:
    from megaulysses.model.gpt import GPT


class UlyssesAttention:
    """A drop-in attention core: `(q, k, v, dropout_p, mask) -> out` on sequence shards.

    `take([q, k, v], ...)` is the same with q, k and v handed over (SelfAttention does):
    each is popped from the list as it is exchanged, so with no other reference left the
    sequence-sharded tensor is freed once its all-to-all is issued (the packed copy it
    sends, once received) and never coexists with the core's working set."""

    takes_qkv = True  # SelfAttention passes q, k, v in a list it keeps no reference to

    def __init__(self, core: AttentionCore, comm: Comm, dim: str = SP, overlap: bool = True):
        self.core, self.comm, self.dim = core, comm, dim
        self.P = comm.size(dim)
        # q, k, v's exchanges in flight together (a2a_overlap.py); off: one at a time,
        # the same results bit for bit (the tests' and benchmarks' reference)
        self.overlap = overlap

    def __call__(self, q, k, v, dropout_p: float = 0.0, mask=None):
        # q [b, S/P, hq, d], k/v [b, S/P, hkv, d] -> [b, S/P, hq, d]
        return self.take([q, k, v], dropout_p, mask)

    def take(self, qkv: list, dropout_p: DropoutArg = 0.0, mask=None) -> torch.Tensor:
        """`qkv` = [q, k, v], emptied: the caller's last references."""
        # this rank attends with the r-th of P chunks of the heads: its dropout's head 0 is
        # the chunk's first (dropout.py: the mask is that of the same global head)
        drop = as_dropout(dropout_p)
        if drop is not None:
            drop = drop.shifted(self.comm.rank(self.dim) * (qkv[0].shape[2] // self.P))
        if self.overlap:  # issued together, waited for in order
            pending = [self.start_heads(qkv.pop(0))] + self.kv_start_heads(qkv)
            q, k, v = (pending.pop(0).wait() for _ in range(3))
        else:
            q = self.to_heads(qkv.pop(0))  # [b, S, hq/P, d]
            k, v = self.kv_to_heads(qkv)  # [b, S, max(hkv, P)/P, d]
        out = self.core(q, k, v, drop or 0.0, mask)  # [b, S, hq/P, d]
        del q, k, v  # what the core saved for backward stays; no_grad: freed here
        return self.to_sequence(out)  # [b, S/P, hq, d]

    def to_heads(self, t: torch.Tensor) -> torch.Tensor:
        """Dim 2 (heads) cut in P chunks, rank i gets chunk i of every rank, the sequence
        (dim 1) gathered: [b, S/P, P*n, d] -> [b, S, n, d] (or [b, S/P, P, n, d] ->
        [b, S, 1, n, d]: head_groups.py's shares)."""
        return self.comm.all_to_all(t, self.dim, scatter_dim=2, gather_dim=1)

    def to_sequence(self, t: torch.Tensor) -> torch.Tensor:
        """[b, S, n, d] -> [b, S/P, P*n, d]: the inverse of `to_heads`."""
        return self.comm.all_to_all(t, self.dim, scatter_dim=1, gather_dim=2)

    def kv_to_heads(self, kv: list) -> list:
        """[k, v] `[b, S/P, hkv, d]`, emptied -> [k, v] `[b, S, max(hkv, P)/P, d]`."""
        out = []
        while kv:
            out.append(self.to_heads(repeat_kv_heads(kv.pop(0), self.P)))
        return out

    def start_heads(self, t: torch.Tensor) -> Exchange:
        """`to_heads` issued; `.wait()` returns its result (a2a_overlap.py)."""
        return start(self.comm, t, self.dim, scatter_dim=2, gather_dim=1)

    def start_sequence(self, t: torch.Tensor) -> Exchange:
        """`to_sequence` issued; `.wait()` returns its result."""
        return start(self.comm, t, self.dim, scatter_dim=1, gather_dim=2)

    def kv_start_heads(self, kv: list) -> list:
        """`kv_to_heads` issued: [k, v], emptied -> their two exchanges."""
        out = []
        while kv:
            out.append(self.start_heads(repeat_kv_heads(kv.pop(0), self.P)))
        return out


def repeat_kv_heads(t: torch.Tensor, P: int) -> torch.Tensor:
    """k or v `[b, s, hkv, d]`, each head repeated P/hkv times when P is a multiple of hkv
    (`[b, s, P, d]`: after the exchange one kv head per rank), else itself. (P % hkv == 0
    is checked at start-up.)"""
    hkv = t.shape[2]
    return t.repeat_interleave(P // hkv, dim=2) if hkv % P else t


def ulysses_bytes_per_layer(b: int, S: int, hq: int, hkv: int, d: int, P: int,
                            element_size: int) -> int:
    """Forward all-to-all bytes one rank sends per attention layer (see module doc)."""
    heads = 2 * hq + 2 * max(hkv, P)
    return heads * b * S * d * element_size * (P - 1) // (P * P)


def apply_ulysses(model: GPT, comm: Comm, dim: str = SP) -> GPT:
    """Swap every block's attention core for the Ulysses wrapper (in place)."""
    if comm.size(dim) == 1:
        return model
    for layer in blocks(model):
        layer.attn.core = UlyssesAttention(layer.attn.core, comm, dim)
    return model


def slice_sequence(t: torch.Tensor, comm: Comm, dim: str = SP) -> torch.Tensor:
    """This rank's contiguous slice of dim 1 (the sequence) of a `[b, S, ...]` tensor."""
    P, r = comm.size(dim), comm.rank(dim)
    if P == 1:
        return t
    n = t.shape[1] // P
    return t[:, r * n:(r + 1) * n]
