"""The output layer and per-token cross entropy in one op, by chunks of tokens:
`linear_cross_entropy` (`_LinearCrossEntropy`, an explicit `torch.autograd.Function`)
recomputes the logits in backward, so never more than one chunk of [tokens, vocab] logits
or gradient exists, in any dtype; its results equal
`F.cross_entropy(F.linear(x, W).float(), labels)` up to fp32 rounding. It runs chunked
everywhere. `_rows_per_chunk` sizes the chunks (`rows_per_chunk`: the memory plan
calls it too).

The same math serves the vocab-parallel output layer: given a `VocabShard` (this rank's
vocabulary rows and hooks for the cross-rank reductions), the row maxima, sums and input
gradient are reduced over the shards through the hooks; parallel/tensor.py's
`vocab_parallel_linear_cross_entropy` supplies them as all-reduces.
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch

from megaulysses.model.ops.onednn import _matmul_t


# Logit elements of a chunk, by device type. CPU: a chunk of ~32 MiB of fp32 logits,
# recycled by malloc rather than faulted in afresh each step. The bundled default (2048
# tokens x 4096 vocab per micro-batch) is then one chunk, whose probabilities are kept
# instead of recomputed (see below). CUDA: the caching allocator makes size irrelevant;
# chunks only bound peak memory.
CHUNK_ELEMENTS = {"cpu": 2 ** 23, "cuda": 2 ** 28}


def rows_per_chunk(rows: int, vocab: int, device_type: str) -> int:
    """Rows (tokens) of a chunk of logits on `device_type` (any but "cpu": CUDA's budget)."""
    budget = CHUNK_ELEMENTS["cpu"] if device_type == "cpu" else CHUNK_ELEMENTS["cuda"]
    return max(1, min(rows, budget // vocab))


def _rows_per_chunk(rows: int, vocab: int, device: torch.device) -> int:
    return rows_per_chunk(rows, vocab, device.type)


class VocabShard(Protocol):
    """The output layer is split by vocabulary rows over P ranks: this rank holds rows
    [start, start + V/P). The hooks reduce over the P shards, in place; parallel/tensor.py's
    `_VocabShard` runs them as all-reduces over a `parallel.comm.Comm` group (not imported:
    this module imports nothing distributed)."""

    @property
    def start(self) -> int:
        """The first vocabulary row of this rank's shard (read only: a frozen one fits)."""

    def reduce_max(self, x: torch.Tensor) -> None:
        """x = the elementwise max of every shard's x (MAX)."""

    def reduce_sum(self, x: torch.Tensor) -> None:
        """x = the elementwise sum of every shard's x (SUM)."""

    def reduce_input_grad(self, dx: torch.Tensor) -> None:
        """dx = the sum of every shard's part of the input gradient; or nothing, when the
        caller's all-gather of the input reduces it in its own backward."""


class _LinearCrossEntropy(torch.autograd.Function):
    """losses[i] = logsumexp(x[i] @ W.T) - (x[i] @ W.T)[labels[i]], by chunks of rows.

    Nothing of size [T, V] is kept: forward saves x, W, the labels and each row's max and
    sum of exp(logit - max) (fp32 [T] each); backward recomputes a chunk's exps, turns them
    in place into d loss / d logits = (exps / sum - one_hot) * grad and feeds them to the two
    matmuls. So at most one chunk of logits (or of their gradient) exists at a time, and
    backward may run any number of times (the zero-bubble schedule runs it twice), each
    time with the same result. When all rows fit in one chunk, that chunk's exps are kept
    for the first backward instead: recomputing costs ~1/3 of the op (+35% measured on the
    default model's 2048 x 4096 logits, 2 cores).

    Vocab-parallel (`shard` given, a `VocabShard`, W this rank's vocabulary rows): per chunk
    the row max is all-reduced (MAX, `shard.reduce_max`), then the sums of exp and the target
    logits (only the rank holding a label picks it; the others add 0) in one all-reduce
    (SUM, `shard.reduce_sum`). Backward is local but for dx, a partial sum over the shards
    (`shard.reduce_input_grad`).
    """

    @staticmethod
    def forward(ctx, x, weight, labels, ignore_index: int, shard: Optional[VocabShard]):
        # x [T, h], weight [V, h] (V/P rows when vocab-parallel), labels [T]
        n = x.shape[0]
        rows = _rows_per_chunk(n, weight.shape[0], x.device)
        target, owned, valid = _targets(labels, ignore_index, weight.shape[0], shard)
        tops = torch.empty(n, dtype=torch.float32, device=x.device)  # [T] row maxima
        sums = torch.empty_like(tops)  # [T] sums of exp(logits - top)
        losses = torch.empty_like(tops)  # [T]
        # Outside saved_tensors: the first backward consumes it in place, later ones recompute.
        # Compiled (--torch-compile) it is a saved tensor instead: dynamo traces no state
        # kept on ctx, and the compiled backward is functional (nothing is consumed).
        saved: list[torch.Tensor] = []
        ctx.kept = []
        compiling = torch.compiler.is_compiling()
        for i in range(0, n, rows):
            c = slice(i, i + rows)
            logits = _matmul_t(x[c], weight).float()  # [c, V]
            top = logits.amax(dim=1)  # [c]
            picked = logits.gather(1, target[c]).squeeze(1).masked_fill_(~owned[c], 0.0)
            if shard is not None:
                shard.reduce_max(top)
            # exp in the logits' memory: torch.logsumexp would allocate a [c, V] temporary
            exps = logits.sub_(top.unsqueeze(1)).exp_()  # [c, V]
            stats = torch.stack((exps.sum(dim=1), picked))  # [2, c]: one collective for both
            if shard is not None:
                shard.reduce_sum(stats)
            if n <= rows and any(ctx.needs_input_grad[:2]):  # [T, V]: bitwise what
                (saved if compiling else ctx.kept).append(exps)  # backward would recompute
            tops[c], sums[c] = top, stats[0]
            torch.sub(stats[0].log().add_(top), stats[1], out=losses[c])  # lse - picked
        losses.masked_fill_(~valid, 0.0)
        ctx.save_for_backward(x, weight, target, owned, valid, tops, sums, *saved)
        ctx.rows, ctx.shard = rows, shard
        return losses

    @staticmethod
    def backward(ctx, grad):  # grad [T]
        x, weight, target, owned, valid, tops, sums, *saved = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[:2]
        shard = ctx.shard
        g = (grad.float() * valid).unsqueeze(1)  # [T, 1]; ignored rows get no gradient
        scale = g / sums.unsqueeze(1)  # [T, 1]: softmax = exps / sum, folded into the scaling
        minus_g = -g * owned.unsqueeze(1)  # [T, 1]: the one-hot term, where the label is held
        dx = torch.empty_like(x) if need_dx else None  # [T, h]
        # dW.T [h, V] summed over chunks, in fp32 whatever the matmul dtype. (dW.T because
        # then the operand to make contiguous is x.T, the small one; see _onednn_weight_grad.)
        dwt = x.new_zeros(weight.shape[::-1], dtype=torch.float32) if need_dw else None
        for i in range(0, x.shape[0], ctx.rows):
            c = slice(i, i + ctx.rows)
            if saved:  # compiled: the kept exps, left as they are for a later backward
                exps = saved.pop() * scale[c]  # [c, V]
            else:  # the kept exps consumed (the first backward), or recomputed; in place
                exps = ctx.kept.pop() if ctx.kept else _exps(x[c], weight, tops[c])
                exps = exps.mul_(scale[c])
            # (softmax - one_hot) * grad
            dlogits = exps.scatter_add_(1, target[c], minus_g[c]).to(x.dtype)
            if need_dx:
                dx[c] = _matmul_t(dlogits, weight.t())  # dlogits @ W: [c, h]
            if need_dw:
                dwt.add_(_matmul_t(x[c].t().contiguous(), dlogits.t()))  # x.T @ dlogits
        if need_dx and shard is not None:
            shard.reduce_input_grad(dx)  # every shard's part of dlogits @ W
        dw = dwt.t().to(weight.dtype).contiguous() if need_dw else None
        return dx, dw, None, None, None


def _exps(x, weight, top):  # x [c, h], weight [V, h], top [c] -> fp32 [c, V]
    """A chunk's exp(logits - row max), recomputed as forward computed it, in place."""
    return _matmul_t(x, weight).float().sub_(top.unsqueeze(1)).exp_()


def _targets(labels, ignore_index: int, vocab: int, shard: Optional[VocabShard]):
    """Per row `[T]`: the label's column in this rank's logits (`[T, 1]`, 0 where it holds
    none), whether this rank holds the label, whether the row counts at all."""
    valid = labels != ignore_index
    if shard is None:  # an out-of-range label fails in gather, as in F.cross_entropy
        owned, local = valid, labels
    else:
        local = labels - shard.start
        owned = valid & (local >= 0) & (local < vocab)
    return torch.where(owned, local, 0).unsqueeze(1), owned, valid


def autocast_operands(x: torch.Tensor,
                      weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x and weight in the autocast dtype if autocast is on (as F.linear would cast them)."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        return x.to(dtype), weight.to(dtype)
    return x, weight


def apply_linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               ignore_index: int, shard: Optional[VocabShard]) -> torch.Tensor:
    """The op on x `[..., h]` and labels `[...]` as given (operands already in their
    matmul dtype, see `autocast_operands`; W this rank's rows when `shard` is given):
    fp32 losses `[...]`."""
    with torch.autocast(x.device.type, enabled=False):  # the op picks its own dtypes
        losses = _LinearCrossEntropy.apply(x.reshape(-1, x.shape[-1]), weight,
                                           labels.reshape(-1), ignore_index, shard)
    return losses.view(labels.shape)


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         ignore_index: int = -100) -> torch.Tensor:
    """Per-token `F.cross_entropy(F.linear(x, weight).float(), labels, reduction="none")`.

    x `[..., h]`, weight `[V, h]`, labels `[...]` -> fp32 losses `[...]`; label
    `ignore_index` gives loss 0 and no gradient, as in F.cross_entropy. Under autocast the
    matmuls run in the autocast dtype (as F.linear would), the softmax always in fp32.
    """
    x, weight = autocast_operands(x, weight)
    return apply_linear_cross_entropy(x, weight, labels, ignore_index, None)

