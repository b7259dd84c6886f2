"""Global batches -> this rank's micro-batches, by consumed-sample position.

Sample order is a pure function of the number of consumed samples, so resuming from a
checkpoint (which stores that number) reads exactly the batches an uninterrupted run
would. Global batch g holds samples [g*G, (g+1)*G) on every grid; only its split into
micro-batches per data-parallel rank depends on the grid (as in Megatron's sampler).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch


class BatchBuilder:
    def __init__(self, dataset, micro_batch_size: int, global_batch_size: int,
                 dp_rank: int = 0, dp_size: int = 1, sp_rank: int = 0, sp_size: int = 1,
                 eod: Optional[int] = None, eod_mask_loss: bool = False):
        per_rank = global_batch_size // dp_size
        assert per_rank * dp_size == global_batch_size and per_rank % micro_batch_size == 0
        self.dataset = dataset
        self.mbs, self.gbs = micro_batch_size, global_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.sp_rank, self.sp_size = sp_rank, sp_size
        self.num_micro = per_rank // micro_batch_size
        self.eod, self.eod_mask_loss = eod, eod_mask_loss

    def micro_batches(self, consumed_samples: int) -> list[dict]:
        """This rank's micro-batches of the global batch starting at `consumed_samples`."""
        idx = np.arange(consumed_samples, consumed_samples + self.gbs) % len(self.dataset)
        idx = idx.reshape(self.num_micro, self.dp_size, self.mbs)[:, self.dp_rank]
        return [self.collate([self.dataset[int(i)] for i in row]) for row in idx]

    def collate(self, samples) -> dict:
        data = torch.from_numpy(np.stack(samples).astype(np.int64))  # [b, s+1]
        tokens, labels = data[:, :-1], data[:, 1:]  # shift first; sp slices later
        loss_mask = torch.ones(tokens.shape, dtype=torch.float32)
        if self.eod_mask_loss and self.eod is not None:
            loss_mask[tokens == self.eod] = 0.0  # Megatron masks where the input is EOD
        b, s = tokens.shape
        position_ids = torch.arange(s).expand(b, s)
        # Sequence parallel: every sp rank of a dp rank read the same samples; each keeps
        # its contiguous slice, with global positions (rotary needs them).
        n = s // self.sp_size
        keep = slice(self.sp_rank * n, (self.sp_rank + 1) * n)
        # clone, not contiguous: with one sample a slice is already contiguous, and the view
        # would keep the whole sample's storage alive on every sp rank.
        return {"tokens": tokens[:, keep].clone(), "labels": labels[:, keep].clone(),
                "loss_mask": loss_mask[:, keep].clone(),
                "position_ids": position_ids[:, keep].clone()}
