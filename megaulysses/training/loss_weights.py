"""How much each micro-batch's masked loss sum weighs in an iteration's gradient: the
two loss normalizations of Megatron-LM, exact on every grid.

Per-token (--calculate-per-token-loss): the gradient of
    sum over the global batch of (token loss * loss mask) / global loss-token count,
every loss token weighing alike. The weight of every micro-batch is 1 / that count.

Per micro-batch (Megatron-LM's default): each micro-batch's mean over its own loss tokens,
averaged over the global batch's micro-batches (all data-parallel ranks):
    mean over micro-batches m of ( sum_m(token loss * loss mask) / max(tokens_m, 1) ),
so micro-batch m weighs 1 / (max(tokens_m, 1) * micro-batches per global batch). A
micro-batch is the same --micro-batch-size samples on every grid (loader.BatchBuilder:
global batch g is cut into consecutive micro-batches), so the result is one number per
iteration whatever the grid. tokens_m counts the whole samples' loss tokens, summed over
the sequence-parallel ranks (Ulysses sp and ring cp) that each hold a slice of them.
Megatron-LM divides each cp rank's sum by that rank's own count and averages the cp
ranks' gradients: the same where the slices hold equal counts (always, but for
--eod-mask-loss), and dependent on the cp degree where they do not; the whole sample's
count keeps the run's gradient independent of the grid.

When every micro-batch holds the same number of loss tokens (no --eod-mask-loss) the two
agree bit for bit: 1 / (tokens_m * n) is 1 / tokens. The logged loss is the per-token
mean in both (as Megatron-LM logs it): only the gradient differs.
"""

from __future__ import annotations

import torch

from megaulysses.parallel.comm import Comm
from megaulysses.parallel.dims import CP, DP, DP_SP, SP


def micro_batch_weights(batches: list[dict], comm: Comm, device: torch.device,
                        per_token: bool) -> tuple[list[float], float]:
    """(the factor on each of this rank's micro-batches' masked loss sums, the global
    loss-token count). Known before any forward: they need only the loss masks."""
    local = torch.tensor([float(b["loss_mask"].sum()) for b in batches], dtype=torch.float64,
                         device=device)  # this rank's loss tokens per micro-batch
    total = local.sum()
    comm.all_reduce_sum(total, DP_SP)  # every loss token of the global batch, once
    tokens = float(total)
    if per_token:
        return [1.0 / max(tokens, 1.0)] * len(batches), tokens  # none: loss 0, not NaN
    for dim in (SP, CP):  # the whole samples' counts: each sequence rank holds a slice
        comm.all_reduce_sum(local, dim)
    n = len(batches) * comm.size(DP)  # the global batch's micro-batches
    return [1.0 / (max(float(t), 1.0) * n) for t in local.tolist()], tokens
