"""Sharded initialization: no rank ever holds the whole model.

The model is built on the meta device, split, sharded and only then materialized; each
parameter's initial value is made whole once (a function of seed, name and shape) and
each rank keeps its own piece. On 8 gloo ranks at ZeRO-3 the tensor bytes a rank
allocates while the Trainer starts (counted by LiveBytes, not RSS) stay within the issue's
bound: 1.1 x (the whole model's parameter bytes) / 8 + the largest single parameter.
Plus what the data loader and the process group allocate (small tensors); there are no
buffers (RoPE's angles are computed from the positions in each forward).

The model is chosen so that its blocks outweigh the embedding (the bound would be met
by any model whose largest parameter is most of it): 4 layers of hidden 256 against a
4096 x 256 embedding; the whole model is 2.6x the bound.
"""

from dist import run_ranks
from helpers import TINY, with_vocab

MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
         "--num-query-groups", "8", "--global-batch-size", "16"]


def start(rank, world, args):
    from megaulysses.config import parse_args
    from megaulysses.training.live_bytes import LiveBytes
    from megaulysses.training.trainer import Trainer
    with LiveBytes(count_meta=False) as live:  # the meta model is shapes only
        trainer = Trainer(parse_args(args))
    return live.peak, sum(b.numel() for b in trainer.model.buffers())


def test_zero3_start_up_holds_shards_only(tmp_path):
    from megaulysses.config import parse_args
    from megaulysses.model.gpt import GPT
    import torch
    args = TINY + MODEL + ["--zero-stage", "3", "--data-cache-path", str(tmp_path / "c")]
    cfg = parse_args(args)
    cfg = with_vocab(cfg, 4096)  # the bundled tokenizer's
    with torch.device("meta"):
        sizes = [p.numel() * 4 for p in GPT(cfg.model).parameters()]
    total, largest = sum(sizes), max(sizes)
    bound = 1.1 * total / 8 + largest
    assert total > 2.5 * bound  # a whole model on a rank would fail by far
    for peak, buffers in run_ranks(start, 8, args):
        assert buffers == 0
        assert peak <= bound + 64 * 1024, (peak, bound)
