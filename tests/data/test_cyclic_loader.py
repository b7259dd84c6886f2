"""--dataloader-type cyclic (issue 39, item 6): Megatron-LM's random sampler. Its sample
order is checked against a reference written here the way Megatron-LM's sampler runs (a
stateful iterator per data-parallel rank, re-entered at each epoch's end, the epoch
number as the permutation's seed), across epoch ends, with and without data sharding;
a run stopped mid-epoch and resumed reads exactly the batches of the unbroken run. Every
comparison is exact: these are integer sample indices and bit-equal losses."""

import numpy as np
import pytest
import torch

from helpers import run_inprocess, train_losses

from megaulysses.data.loader import BatchBuilder, CyclicOrder


class Samples:
    """Sample i is the tokens [i, i, i]: a batch says which samples it holds."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.full(3, i, dtype=np.int64)


def megatron_rank_stream(total: int, mbs: int, dp: int, rank: int, sharding: bool,
                         consumed: int):
    """The micro-batches one rank reads from `consumed` on, as Megatron-LM's cyclic loader
    yields them: each pass over the sampler fixes its epoch at the start and runs to the
    end of the epoch's indices (a partial micro-batch dropped), then the next pass."""
    step = mbs * dp
    active = total - total % step
    while True:
        epoch, within = divmod(consumed, active)
        g = torch.Generator().manual_seed(epoch)
        if sharding:
            bucket = total // step * mbs
            order = [rank * bucket + x for x in torch.randperm(bucket, generator=g).tolist()
                     [within // dp:]]
        else:
            order = torch.randperm(total // mbs * mbs, generator=g).tolist()[within:][rank::dp]
        for first in range(0, len(order) - mbs + 1, mbs):
            consumed += step
            yield order[first:first + mbs]


def our_stream(builder: BatchBuilder, consumed: int, batches: int) -> list:
    """The micro-batches builder reads for `batches` global batches from `consumed`."""
    rows = []
    for _ in range(batches):
        rows += builder.indices(consumed).tolist()
        consumed += builder.gbs
    return rows


@pytest.mark.parametrize("sharding", [True, False], ids=["sharded", "unsharded"])
@pytest.mark.parametrize("total,mbs,dp,gbs", [(20, 2, 1, 4), (23, 2, 2, 8), (30, 1, 3, 6)])
def test_cyclic_reads_megatron_lms_order_across_epochs(sharding, total, mbs, dp, gbs):
    """Five epochs' worth, from the start and from a resume mid-epoch, on every rank; and
    the micro-batches the builder returns hold those samples."""
    batches = 5 * total // gbs
    for start in (0, gbs * (batches // 2 + 1)):  # the resume lands mid-epoch
        for rank in range(dp):
            builder = BatchBuilder(Samples(total), mbs, gbs, dp_rank=rank, dp_size=dp,
                                   cyclic=True, data_sharding=sharding)
            ours = our_stream(builder, start, batches)
            ref = megatron_rank_stream(total, mbs, dp, rank, sharding, start)
            assert ours == [next(ref) for _ in ours], (start, rank)
            micro = builder.micro_batches(start)
            assert [m["tokens"][:, 0].tolist() for m in micro] == builder.indices(start).tolist()
    assert (start // total) > 0  # the resumed stream began past the first epoch


def test_each_epoch_reads_every_sample_once_in_a_new_order():
    """dp 2, mbs 2, 22 samples: epochs of 20 (the partial step left out), each a
    permutation of 0..19 over the two ranks' shards, no two epochs in the same order."""
    builders = [BatchBuilder(Samples(22), 2, 4, dp_rank=r, dp_size=2, cyclic=True)
                for r in range(2)]
    epochs = []
    for epoch in range(3):
        rows = [np.concatenate([b.indices(c).ravel() for b in builders])
                for c in range(epoch * 20, (epoch + 1) * 20, 4)]
        epochs.append(np.concatenate(rows))
        assert sorted(epochs[-1].tolist()) == list(range(20))
        rank0 = np.concatenate([builders[0].indices(c).ravel()
                                for c in range(epoch * 20, (epoch + 1) * 20, 4)])
        assert sorted(rank0.tolist()) == list(range(10))  # rank 0's own shard, all of it
    assert len({tuple(e) for e in epochs}) == 3


def test_cyclic_needs_one_micro_step_of_samples():
    with pytest.raises(ValueError, match="fewer than one micro-step"):
        CyclicOrder(3, micro_batch_size=2, dp_size=2)


CYCLIC = ["--eval-iters", "0", "--train-iters", "4", "--dataloader-type", "cyclic"]


def test_a_cyclic_run_resumed_mid_epoch_trains_like_the_unbroken_one(tmp_path):
    """Stopped at 2 and resumed to 4: the unbroken run's losses bit for bit; and not the
    losses of --dataloader-type single (the order is another one)."""
    full = train_losses(run_inprocess(CYCLIC, tmp_path, "full"))
    ck = str(tmp_path / "ck")
    first = run_inprocess(CYCLIC + ["--save", ck, "--exit-interval", "2"], tmp_path, "first")
    second = run_inprocess(CYCLIC + ["--load", ck], tmp_path, "second")
    assert sorted(train_losses(second)) == [3, 4]
    assert {**train_losses(first), **train_losses(second)} == full
    single = train_losses(run_inprocess(CYCLIC[:-1] + ["single"], tmp_path, "single"))
    assert single[1] != full[1]
