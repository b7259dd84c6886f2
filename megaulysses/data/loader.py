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


class CyclicOrder:
    """Megatron-LM's --dataloader-type cyclic (its MegatronPretrainingRandomSampler): the
    dataset is read in epochs of `active` samples (whole steps of mbs x dp), each epoch in
    a new order, a torch.randperm seeded with the epoch number. With data sharding (its
    default) rank r owns samples [r*bucket, (r+1)*bucket) and reads them in the epoch's
    permutation of the bucket; without, all ranks share one permutation of the samples,
    rank r taking every dp-th. A pure function of the consumed-sample count: a resume
    mid-epoch reads what the uninterrupted run reads."""

    def __init__(self, total: int, micro_batch_size: int, dp_size: int, sharding: bool = True):
        step = micro_batch_size * dp_size  # samples one micro-step consumes on all ranks
        if total < step:
            raise ValueError(f"--dataloader-type cyclic: the split has {total} samples, fewer "
                             f"than one micro-step needs ({micro_batch_size} x {dp_size} dp)")
        self.mbs, self.dp, self.step, self.sharding = micro_batch_size, dp_size, step, sharding
        self.active = total - total % step  # the partial last step is never read
        # the permuted range: a rank's bucket, or every whole micro-batch
        self.span = total // step * micro_batch_size if sharding else \
            total // micro_batch_size * micro_batch_size
        self._perm: Optional[tuple[int, np.ndarray]] = None  # (epoch, its order)

    def permutation(self, epoch: int) -> np.ndarray:
        """The epoch's order of the span (one cached: epochs are read in turn)."""
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(epoch)
            self._perm = (epoch, torch.randperm(self.span, generator=g).numpy())
        return self._perm[1]

    def micro_batch(self, consumed: int, dp_rank: int) -> np.ndarray:
        """`[mbs]` sample indices of `dp_rank`'s micro-batch in the micro-step that starts
        after `consumed` samples (a multiple of mbs x dp)."""
        assert consumed % self.step == 0, (consumed, self.step)
        epoch, within = divmod(consumed, self.active)
        perm = self.permutation(epoch)
        if self.sharding:  # this rank's bucket, read from its share of the epoch so far
            start = within // self.dp
            return dp_rank * self.span + perm[start:start + self.mbs]
        return perm[within + dp_rank:within + self.step:self.dp]

    def __getstate__(self) -> dict:  # worker processes rebuild the cached permutation
        return {**self.__dict__, "_perm": (-1, None)}


class BatchBuilder:
    """`positions`: the positions of a sample this rank keeps (its sequence-parallel
    slice: parallel.ring.local_positions); None keeps the whole sample. `cyclic`:
    Megatron-LM's --dataloader-type cyclic (CyclicOrder; `data_sharding` its
    --no-data-sharding); otherwise samples are read in order (its single)."""

    def __init__(self, dataset: Samples, micro_batch_size: int, global_batch_size: int,
                 dp_rank: int = 0, dp_size: int = 1, positions: Optional[torch.Tensor] = None,
                 eod: Optional[int] = None, eod_mask_loss: bool = False,
                 reset_position_ids: bool = False, reset_attention_mask: bool = False,
                 cyclic: bool = False, data_sharding: bool = True):
        per_rank = global_batch_size // dp_size
        assert per_rank * dp_size == global_batch_size and per_rank % micro_batch_size == 0
        if (reset_position_ids or reset_attention_mask) and eod is None:
            raise ValueError("reset_position_ids and reset_attention_mask cut documents at "
                             "the eod token: give eod")
        self.order = CyclicOrder(len(dataset), micro_batch_size, dp_size,
                                 data_sharding) if cyclic else None
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
        return [self.collate([self.dataset[int(i)] for i in row])
                for row in self.indices(consumed_samples, global_batch)]

    def indices(self, consumed_samples: int, global_batch: Optional[int] = None) -> np.ndarray:
        """`[micro-batches, mbs]` the sample indices micro_batches reads."""
        gbs = global_batch or self.gbs
        step = self.dp_size * self.mbs
        if self.order is not None:
            return np.stack([self.order.micro_batch(c, self.dp_rank)
                             for c in range(consumed_samples, consumed_samples + gbs, step)])
        idx = np.arange(consumed_samples, consumed_samples + gbs) % len(self.dataset)
        return idx.reshape(gbs // step, self.dp_size, self.mbs)[:, self.dp_rank]

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
        documents: Optional[torch.Tensor] = None
        if self.reset_position_ids or self.reset_attention_mask:
            assert self.eod is not None  # __init__ refuses the resets without it
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
        if self.reset_attention_mask and documents is not None:  # documents: set above
            batch["documents"] = documents  # [b, s]: the whole sample's, for the mask
        return batch
