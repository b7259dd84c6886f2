"""Global batches -> this rank's micro-batches, by consumed-sample position.

Sample order is a pure function of the number of consumed samples, so resuming from a
checkpoint (which stores that number) reads exactly the batches an uninterrupted run
would. Global batch g holds samples [g*G, (g+1)*G) on every grid; only its split into
micro-batches per data-parallel rank depends on the grid (as in Megatron's sampler).

Packed documents (Megatron-LM's --reset-position-ids, --reset-attention-mask,
--eod-mask-loss): a document ends with its EOD token, and the next token starts the next
one. Positions and document ids are computed from the whole sample, before any rank takes
its slice, so every rank's positions and its attention mask are the whole-sequence ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence, Union

import numpy as np
import torch

if TYPE_CHECKING:
    from megaulysses.data.gpt_dataset import BlendedDataset, GPTDataset, MockGPTDataset

    Samples = Union[GPTDataset, BlendedDataset, MockGPTDataset, Sequence[np.ndarray]]


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """`[b, s]` int32: the document of each token, counted from 0 in each sample (an EOD
    token belongs to the document it ends). Non-decreasing along the sequence."""
    ends = (tokens == eod).to(torch.int32)
    return (ends.cumsum(1) - ends).to(torch.int32)


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """`[b, s]` int64: each token's position within its document."""
    b, s = documents.shape
    idx = torch.arange(s).expand(b, s)
    start = torch.ones_like(documents, dtype=torch.bool)
    start[:, 1:] = documents[:, 1:] != documents[:, :-1]
    first = torch.where(start, idx, torch.zeros_like(idx)).cummax(1).values  # doc's start
    return idx - first


class BatchBuilder:
    """`positions`: the positions of a sample this rank keeps (its sequence-parallel
    slice: parallel.ring.local_positions); None keeps the whole sample."""

    def __init__(self, dataset: Samples, micro_batch_size: int, global_batch_size: int,
                 dp_rank: int = 0, dp_size: int = 1, positions: Optional[torch.Tensor] = None,
                 eod: Optional[int] = None, eod_mask_loss: bool = False,
                 reset_position_ids: bool = False, reset_attention_mask: bool = False):
        per_rank = global_batch_size // dp_size
        assert per_rank * dp_size == global_batch_size and per_rank % micro_batch_size == 0
        self.dataset = dataset
        self.mbs, self.gbs = micro_batch_size, global_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.positions = positions
        self.num_micro = per_rank // micro_batch_size
        self.eod, self.eod_mask_loss = eod, eod_mask_loss
        self.reset_position_ids, self.reset_attention_mask = (reset_position_ids,
                                                              reset_attention_mask)

    def micro_batches(self, consumed_samples: int,
                      global_batch: Optional[int] = None) -> list[dict]:
        """This rank's micro-batches of the global batch starting at `consumed_samples`, of
        `global_batch` samples (a batch ramp-up's; default: the builder's)."""
        gbs = global_batch or self.gbs
        idx = np.arange(consumed_samples, consumed_samples + gbs) % len(self.dataset)
        idx = idx.reshape(gbs // (self.dp_size * self.mbs), self.dp_size, self.mbs)
        idx = idx[:, self.dp_rank]
        return [self.collate([self.dataset[int(i)] for i in row]) for row in idx]

    def close(self) -> None:
        """Nothing to stop: batches are built when asked for (workers.WorkerBatches has
        processes to stop)."""

    def collate(self, samples: Sequence[np.ndarray]) -> dict:
        data = torch.from_numpy(np.stack(samples).astype(np.int64))  # [b, s+1]
        tokens, labels = data[:, :-1], data[:, 1:]  # shift first; sp slices later
        loss_mask = torch.ones(tokens.shape, dtype=torch.float32)
        if self.eod_mask_loss and self.eod is not None:
            loss_mask[tokens == self.eod] = 0.0  # Megatron masks where the input is EOD
        b, s = tokens.shape
        position_ids = torch.arange(s).expand(b, s)
        documents = None
        if self.reset_position_ids or self.reset_attention_mask:
            documents = document_ids(tokens, self.eod)
            if self.reset_position_ids:
                position_ids = document_positions(documents)
        # Sequence parallel: every sp/cp rank of a dp rank read the same samples; each keeps
        # its slice, with whole-sample positions (rotary needs them). Indexing copies: no
        # view keeps the whole sample's storage alive on every rank.
        keep = self.positions if self.positions is not None else slice(None)
        batch = {"tokens": tokens[:, keep].clone(), "labels": labels[:, keep].clone(),
                 "loss_mask": loss_mask[:, keep].clone(),
                 "position_ids": position_ids[:, keep].clone()}
        if self.reset_attention_mask:
            batch["documents"] = documents  # [b, s]: the whole sample's, for the mask
        return batch
