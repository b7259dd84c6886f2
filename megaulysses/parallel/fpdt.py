"""Sequence-chunked Ulysses attention (the idea of FPDT / Ulysses-Offload, arXiv 2408.16978):
under Ulysses the whole-sequence q, k, v, out and their gradients of the rank's heads never
all exist on the device at once; they live in C chunks, on the host with `offload`.

Layout. Rank r of the P ranks of the `dim` group holds global positions [r n, (r+1) n),
n = S/P, cut into C chunks of L = n/C tokens. Local chunk c `[b, L, h, d]` goes through
Ulysses' all-to-all (heads scattered, sequence gathered) to `[b, P*L, h/P, d]`, whose rows
are the global positions {r n + c L + t : r = 0..P-1 (rank-major), t = 0..L-1}: P runs of
L consecutive positions. The block kernel (model/attention/block.py) is given these
positions, so every mask (causal, window, documents, sparse layout) is exact and the
blocks nothing attends are skipped; the kernel block divides L. Under the causal mask
query chunk i sees keys of every key chunk j (those of lower ranks), so each query chunk
runs against all C key chunks, merged by log-sum-exp into an fp32 running out.
A plain causal (or full) mask runs on the fused kernel instead (model/attention/fused.py,
as the ring's fused steps): P calls a pair, the P diagonal run pairs (query run r, key
run r: whole if j < i, causal if j == i) batched in one, then per query run r > 0 one
full rectangle against the key runs before it; from Python integers, no host sync (and
so it also runs on fake tensors, benchmarks/fake_rank.py).

Forward: every k and v chunk is exchanged first and kept; then per query chunk i: q_i is
exchanged, attended against every key chunk, out_i exchanged back into its slice of the
output. Kept for backward: each k_j, v_j, q_i, out_i (in the inputs' dtypes) and lse_i
(fp32): as many bytes as the whole-sequence q, k, v, out and lse of the rank's heads,
on the host with `offload` (only the chunks in use come to the device), else on the device
(then what chunking saves is the kernel's working set, not what is kept).
Backward: fp32 accumulators dk_j, dv_j per key chunk (host with `offload`); per query
chunk i: dout_i is exchanged, q_i, out_i, lse_i fetched, every k_j, v_j fetched for
`partial_backward`, whose shares add into dq_i (fp32, on the device) and dk_j, dv_j;
dq_i goes back into its slice of dq; last, every dk_j, dv_j goes back.

Bytes sent per rank per layer: every q, k, v and out element crosses once forward, and
dout, dq, dk, dv once backward (in the inputs' dtype), in C pieces each: exactly plain
Ulysses' bytes (parallel/ulysses.py, `ulysses_bytes_per_layer`). GQA with fewer kv heads
than ranks (P a multiple of hkv): each kv head is repeated P/hkv times before the
exchange, as UlyssesAttention does, so each rank gets the one its q heads read; backward
sums the repeats' gradients after the exchange back (in the inputs' dtype, as autograd
sums plain Ulysses' repeats).
Host traffic with `offload`: each kept chunk goes out once; forward and backward each
bring every k_j, v_j back C times, backward q_i, out_i, lse_i once, and each fp32
accumulator C times each way.

Attention dropout: the block kernel (not the fused one) with the positional mask of
model/attention/dropout.py over the rows' global positions and heads, so each (query,
key) pair is dropped as in one process, in whichever chunk pair it is met.

Overlap (parallel/a2a_overlap.py; `overlap` off: the same results bit for bit, blocking):
forward, each k or v chunk is exchanged while the one before is kept; q_{i+1} while chunk
i attends, and out_i while chunk i+1 does (written into the output then). Backward,
dout_{i+1} while chunk i runs backward, dq_i while chunk i+1 does; each dk or dv chunk
while the one before has its repeats summed. Not hidden: the k, v exchanges (before any
attention) and the dk, dv ones (after). One chunk's exchange more is live (sent and
received): planner/memory/chunked.py counts q_{i+1} and dout_{i+1}.

One rank (P = 1: sp = 1, alone or beside dp / tp): the all-to-all is the identity, so no
collective is issued (parallel/fpdt_chunks.py) and the same chunk loop runs on the whole
sequence: the kernels' working set is a chunk pair's and, with `offload`, what attention
keeps for backward is on the host. The core's inputs, output and their gradients are
whole-sequence tensors here (at P > 1 they are a rank's 1/P of it), so they stay.

Limits: no ring (contiguous slices, no zigzag); hq % P == 0, and
hkv and P divide one another; n % C == 0. The host copies are synchronous (pinned
memory on CUDA): simple, not overlapped with compute (fpdt_chunks.py holds the exchanges
and the host copies).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Optional

import torch

from megaulysses.model.attention import AttentionMask
from megaulysses.model.attention.block import merge, partial_backward, partial_forward
from megaulysses.model.attention.dropout import AttentionDropout, DropoutArg, as_dropout
from megaulysses.parallel.blocks import blocks
from megaulysses.parallel.comm import Comm
from megaulysses.parallel.dims import SP
from megaulysses.parallel.fpdt_chunks import ChunkPlan
from megaulysses.parallel.ulysses import repeat_kv_heads

if TYPE_CHECKING:
    from megaulysses.model.gpt import GPT


class ChunkedUlyssesAttention:
    """A drop-in attention core `(q, k, v, dropout_p, mask) -> out` on sequence shards
    (q `[b, S/P, hq, d]`, k and v `[b, S/P, hkv, d]`), run in `chunks` sequence chunks;
    `offload` keeps what backward needs on the host. `take([q, k, v], ...)` empties the
    list, as UlyssesAttention.take does."""

    takes_qkv = True  # SelfAttention passes q, k, v in a list it keeps no reference to

    def __init__(self, comm: Comm, chunks: int, offload: bool, dim: str = SP,
                 overlap: bool = True):
        if chunks < 1:
            raise ValueError(f"chunked Ulysses attention needs chunks >= 1, got {chunks}")
        self.comm, self.chunks, self.offload, self.dim = comm, chunks, offload, dim
        self.P = comm.size(dim)
        self.overlap = overlap  # one chunk ahead (a2a_overlap.py); off: the same, blocking

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 dropout_p: float = 0.0, mask: Optional[AttentionMask] = None) -> torch.Tensor:
        return self.take([q, k, v], dropout_p, mask)

    def take(self, qkv: list, dropout_p: DropoutArg = 0.0,
             mask: Optional[AttentionMask] = None) -> torch.Tensor:
        """`qkv` = [q, k, v], emptied: the caller's last references. -> `[b, S/P, hq, d]`."""
        q, k, v = qkv.pop(0), qkv.pop(0), qkv.pop(0)
        self._check(q, k)
        drop = as_dropout(dropout_p)
        if drop is not None:  # this rank attends with the r-th of P chunks of the heads
            drop = drop.shifted(self.comm.rank(self.dim) * (q.shape[2] // self.P))
        return _Chunked.apply(q, k, v, mask or AttentionMask(), self, drop)

    def _check(self, q: torch.Tensor, k: torch.Tensor) -> None:
        hq, hkv, n, P, C = q.shape[2], k.shape[2], q.shape[1], self.P, self.chunks
        if hq % P or (hkv % P and P % hkv):
            raise ValueError(f"chunked Ulysses attention needs query heads ({hq}) divisible "
                             f"by the sequence parallel size ({P}), and kv heads ({hkv}) and "
                             "it dividing one another")
        if n % C:
            raise ValueError(f"chunked Ulysses attention: {n} local tokens do not split "
                             f"into {C} chunks")


def _attend(plan: ChunkPlan, q_i: torch.Tensor, kv: list, mask: AttentionMask,
            i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Query chunk i `[b, P*L, hq/P, d]` against every key chunk: (out_i in q's dtype,
    lse_i `[b, hq/P, P*L]` fp32)."""
    acc: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (out, lse) so far
    for j, (k_j, v_j) in enumerate(kv):
        k_j, v_j = plan.fetch(k_j), plan.fetch(v_j)
        if plan.kernel is None:
            # [b, P*L, hq/P, d] fp32, [b, hq/P, P*L]
            o, l = partial_forward(q_i, k_j, v_j, mask, plan.pos[i], plan.pos[j],
                                   plan.block, dropout=plan.dropout)
        else:
            o, l = _fused_forward(plan, q_i, k_j, v_j, i, j)
        acc = (o, l) if acc is None else merge(*acc, o, l)  # in place, fp32
        del o, l, k_j, v_j
    assert acc is not None, "a plan has at least one key chunk"
    out, lse = acc
    return out.to(q_i.dtype), lse


def _fused_pieces(plan: ChunkPlan) -> list:
    """(query rows, key rows) of every pair's full rectangles beside its diagonal
    (`_diagonal`): run r of the query chunk sees key runs r' < r whole."""
    L = plan.L
    return [(slice(r * L, (r + 1) * L), slice(0, r * L)) for r in range(1, plan.P)]


def _diagonal(plan: ChunkPlan, i: int, j: int) -> Optional[bool]:
    """Query run r against key run r, for every r at once (the P runs as a batch): whole
    if j < i, causal if j == i (returns whether causal), None if j > i (nothing)."""
    return None if j > i else j == i


def _runs(t: torch.Tensor, P: int) -> torch.Tensor:  # [b, P*L, h, d] -> [b*P, L, h, d]
    b, n, h, d = t.shape
    return t.reshape(b * P, n // P, h, d)


def _lse_runs(lse: torch.Tensor, P: int) -> torch.Tensor:  # [b, h, P*L] -> [b*P, h, L]
    b, h, n = lse.shape
    return lse.view(b, h, P, n // P).transpose(1, 2).reshape(b * P, h, n // P)


def _lse_chunk(lse: torch.Tensor, b: int) -> torch.Tensor:  # [b*P, h, L] -> [b, h, P*L]
    bP, h, L = lse.shape
    return lse.view(b, bP // b, h, L).transpose(1, 2).reshape(b, h, bP // b * L)


def _fused_forward(plan: ChunkPlan, q_i, k_j, v_j, i: int, j: int):
    """Pair (i, j) on the fused kernel: (out fp32 `[b, P*L, hq/P, d]`, lse `[b, hq/P, P*L]`),
    rows no key reaches out 0, lse -inf. P calls: the diagonal runs batched, then the
    rectangle of each run r > 0."""
    b, n, h, d = q_i.shape
    k = plan.kernel
    assert k is not None, "called where plan.kernel is set"
    if not plan.causal:  # a full mask: the whole pair, one call
        o, l = k.forward(q_i, k_j, v_j, False, plan.scale)
        return o.float(), l
    causal = _diagonal(plan, i, j)
    if causal is None:
        out = torch.zeros(q_i.shape, dtype=torch.float32, device=q_i.device)
        lse = torch.full((b, h, n), float("-inf"), dtype=torch.float32, device=q_i.device)
    else:
        o, l = k.forward(_runs(q_i, plan.P), _runs(k_j, plan.P), _runs(v_j, plan.P), causal,
                         plan.scale)  # [b*P, L, hq/P, d], [b*P, hq/P, L]
        out, lse = o.float().view(q_i.shape), _lse_chunk(l, b)
        del o, l
    for rows, keys in _fused_pieces(plan):
        o, l = k.forward(q_i[:, rows], k_j[:, keys], v_j[:, keys], False,
                         plan.scale)  # [b, L, hq/P, d] q's dtype, [b, hq/P, L]
        lse[:, :, rows] = merge(out[:, rows], lse[:, :, rows], o.float(), l)[1]
        del o, l
    return out, lse


def _fused_backward(plan: ChunkPlan, q_i, k_j, v_j, out_i, lse_i, do_i, i: int, j: int):
    """Pair (i, j)'s (dq, dk, dv) on the fused kernel, fp32, whole chunks."""
    k, P = plan.kernel, plan.P
    assert k is not None, "called where plan.kernel is set"
    if not plan.causal:
        return tuple(g.float() for g in k.backward(do_i, q_i, k_j, v_j, out_i, lse_i, False,
                                                   plan.scale))
    dq = torch.zeros(q_i.shape, dtype=torch.float32, device=q_i.device)
    dk = torch.zeros(k_j.shape, dtype=torch.float32, device=k_j.device)
    dv = torch.zeros(v_j.shape, dtype=torch.float32, device=v_j.device)
    causal = _diagonal(plan, i, j)
    if causal is not None:
        g = k.backward(_runs(do_i, P), _runs(q_i, P), _runs(k_j, P), _runs(v_j, P),
                       _runs(out_i, P), _lse_runs(lse_i, P), causal, plan.scale)
        for acc, part in zip((dq, dk, dv), g, strict=True):
            acc.add_(part.view(acc.shape))
        del g
    for rows, keys in _fused_pieces(plan):
        g = k.backward(do_i[:, rows], q_i[:, rows], k_j[:, keys], v_j[:, keys],
                       out_i[:, rows], lse_i[:, :, rows], False, plan.scale)
        dq[:, rows].add_(g[0])
        dk[:, keys].add_(g[1])
        dv[:, keys].add_(g[2])
        del g
    return dq, dk, dv


def _sum_repeats(t: torch.Tensor, hkv: int) -> torch.Tensor:
    """The gradient `[b, L, max(hkv, P), d]` of `repeat_kv_heads`' output -> `[b, L, hkv, d]`."""
    b, L, h, d = t.shape
    return t if h == hkv else t.view(b, L, hkv, h // hkv, d).sum(3)


def _rows(t: torch.Tensor, rows: slice) -> torch.Tensor:  # [b, S/P, ...] -> [b, L, ...]
    return t[:, rows]


def _kv_rows(t: torch.Tensor, rows: slice, P: int) -> torch.Tensor:
    """A key or value chunk `[b, L, max(hkv, P), d]`: its heads repeated up to P."""
    return repeat_kv_heads(t[:, rows], P)


class _Chunked(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, mask: AttentionMask, core: ChunkedUlyssesAttention,
                dropout: Optional[AttentionDropout]):
        plan = ChunkPlan(core, q, k, mask, dropout)  # backward reuses it: the same masks
        P, rows = plan.P, plan.rows
        flat = [plan.keep(t) for t in plan.exchanged(  # k_0, v_0, k_1, ...: one ahead
            [plan.heads(functools.partial(_kv_rows, t, rows(j), P))
             for j in range(plan.C) for t in (k, v)])]  # [b, P*L, hkv/P, d]
        kv = list(zip(flat[0::2], flat[1::2], strict=True))  # C x (k_j, v_j)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [b, S/P, hq, d]
        saved, pending = [], []
        # q_{i+1} in flight while chunk i attends; out_{i-1} too (`land` one behind)
        q_chunks = plan.exchanged([plan.heads(functools.partial(_rows, q, rows(i)))
                                   for i in range(plan.C)])
        for i, q_i in enumerate(q_chunks):  # [b, P*L, hq/P, d]
            out_i, lse_i = _attend(plan, q_i, kv, mask, i)
            pending.append((rows(i), plan.back(out_i)))  # -> [b, L, hq, d]
            plan.land(out, pending)
            saved += [plan.keep(t) for t in (q_i, out_i, lse_i)]
            del q_i, out_i, lse_i
        plan.land(out, pending, keep=0)
        # Through save_for_backward, not ctx attributes: under recomputation the
        # checkpoint's saved-tensor hooks then drop them after forward and recompute them
        # for backward, as for any op.
        ctx.save_for_backward(*(t for pair in kv for t in pair), *saved)
        ctx.plan, ctx.mask = plan, mask
        ctx.dtypes, ctx.kv_shape = (k.dtype, v.dtype), k.shape
        return out

    @staticmethod
    def backward(ctx, dout):  # dout [b, S/P, hq, d]
        plan, mask, kept = ctx.plan, ctx.mask, ctx.saved_tensors
        C = plan.C
        kv = [kept[2 * j:2 * j + 2] for j in range(C)]  # (k_j, v_j)
        saved = [kept[2 * C + 3 * i:2 * C + 3 * i + 3] for i in range(C)]  # (q_i, out_i, lse_i)
        del kept
        dq = torch.empty(dout.shape, dtype=dout.dtype, device=dout.device)  # [b, S/P, hq, d]
        acc: list = [[None, None] for _ in range(plan.C)]  # dk_j, dv_j fp32 [b, P*L, hkv/P, d]
        pending = []  # dout_{i+1} in flight while chunk i runs backward, dq_{i-1} too
        do_chunks = plan.exchanged([plan.heads(lambda i=i: dout[:, plan.rows(i)])
                                    for i in range(C)])
        for i, do_i in enumerate(do_chunks):  # [b, P*L, hq/P, d]
            q_i, out_i, lse_i = (plan.fetch(t) for t in saved[i])
            saved[i] = None
            dq_i = _backward_chunk(plan, q_i, out_i, lse_i, do_i.contiguous(), kv, acc,
                                   mask, i)
            pending.append((plan.rows(i), plan.back(dq_i.to(dout.dtype))))  # [b, L, hq, d]
            plan.land(dq, pending)
            del q_i, out_i, lse_i, dq_i, do_i
        plan.land(dq, pending, keep=0)
        del kv
        return (dq, *_kv_grads(plan, acc, ctx.dtypes, ctx.kv_shape), None, None, None)


def _kv_grads(plan: ChunkPlan, acc: list, dtypes: tuple, shape) -> list:
    """[dk, dv] `[b, S/P, hkv, d]` from the fp32 sums `acc` (emptied), chunk by chunk,
    each chunk's exchange issued while the one before has its repeats summed."""
    grads = [torch.empty(shape, dtype=dtype, device=plan.device) for dtype in dtypes]

    def part(j: int, w: int) -> torch.Tensor:  # [b, P*L, max(hkv, P)/P, d], its sum dropped
        t, acc[j][w] = plan.fetch(acc[j][w]).to(dtypes[w]), None
        return t

    starts = [lambda j=j, w=w: plan.back(part(j, w)) for w in range(2) for j in range(plan.C)]
    for n, t in enumerate(plan.exchanged(starts)):  # [b, L, max(hkv, P), d]
        w, j = divmod(n, plan.C)
        grads[w][:, plan.rows(j)] = _sum_repeats(t, shape[2])
        del t
    return grads


def _backward_chunk(plan: ChunkPlan, q_i, out_i, lse_i, do_i, kv: list, acc: list,
                    mask: AttentionMask, i: int) -> torch.Tensor:
    """Query chunk i's share of backward, `do_i` its exchanged output gradient `[b, P*L,
    hq/P, d]`: its dq_i (fp32 `[b, P*L, hq/P, d]`); every key chunk's shares added into
    `acc`."""
    delta = None if plan.kernel else (do_i.float() * out_i).sum(-1).transpose(1, 2)  # fp32
    dq_i = None
    for j, (k_j, v_j) in enumerate(kv):
        k_j, v_j = plan.fetch(k_j), plan.fetch(v_j)
        if plan.kernel is None:
            dq_ij, dk, dv = partial_backward(q_i, k_j, v_j, out_i, lse_i, do_i, delta, mask,
                                             plan.pos[i], plan.pos[j], plan.block,
                                             plan.dropout)  # fp32
        else:
            dq_ij, dk, dv = _fused_backward(plan, q_i, k_j, v_j, out_i, lse_i, do_i, i, j)
        del k_j, v_j
        dq_i = dq_ij if dq_i is None else dq_i.add_(dq_ij)
        acc[j][0] = plan.add(acc[j][0], dk)
        acc[j][1] = plan.add(acc[j][1], dv)
        del dq_ij, dk, dv
    assert dq_i is not None, "a plan has at least one key chunk"
    return dq_i


def apply_fpdt(model: GPT, comm: Comm, chunks: int, offload: bool, dim: str = SP) -> GPT:
    """Swap every block's attention core for the chunked one (in place;
    --ds-sequence-parallel-fpdt: `chunks`, --ds-sequence-parallel-fpdt-offloading:
    `offload`), under Ulysses or at sp = 1 (no exchange: the chunks alone). It picks its
    own kernels, so the model's core is not wrapped."""
    if not chunks:
        return model
    for layer in blocks(model):
        layer.attn.core = ChunkedUlyssesAttention(comm, chunks, offload, dim)
    return model
