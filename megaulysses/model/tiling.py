"""Tiled MLP (the idea of ALST's TiledMLP, arXiv 2506.13996; our own code): each block's
norm + MLP runs over the local sequence in N chunks, each under a non-reentrant checkpoint,
so its `[tokens, ffn]` intermediates exist for one chunk at a time in forward and are
recomputed, again one chunk at a time, in backward. Backward keeps only each chunk's input
(views of the block's `[b, s, h]` residual stream: what the norm alone would keep).

The MLP is per token, so chunking the sequence changes no result (up to the order of the
weight-gradient sums over tokens) and needs nothing of the parallel layout: under tensor
parallelism each chunk's fc2 all-reduce (or Megatron-SP's all-gather / reduce-scatter)
moves 1/N of the bytes, and under Ulysses the MLP sees this rank's tokens as usual. The
recompute in backward repeats the chunk's forward only up to its last saved tensor (fc2's
input): under plain tensor parallelism it sends nothing (fc2's all-reduce comes after),
under Megatron-SP it repeats the all-gather of the MLP input (per layer, b*s*h*(tp-1)/tp
elements more in backward; measured on 2 gloo ranks).

Imports nothing distributed.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from megaulysses.model.gpt import Block


def apply_tiled_mlp(model: nn.Module, chunks: int) -> nn.Module:
    """Run every block's `mlp_part` in `chunks` pieces of the sequence (dim 1), recomputed
    in backward. In place; `chunks == 1` changes nothing. Every `Block` among the model's
    modules is tiled: a pipeline rank's model holds only its own, and a block FSDP has
    sharded is still a `Block`."""
    if chunks == 1:
        return model
    for module in model.modules():
        if isinstance(module, Block):
            # An instance attribute shadows the method; Block.forward calls self.mlp_part.
            module.mlp_part = TiledMLP(module, chunks)  # type: ignore[method-assign]  # on purpose
    return model


class TiledMLP:
    """`block.mlp_part` by chunks of the sequence: `[b, s, h] -> [b, s, h]`."""

    def __init__(self, block: Block, chunks: int):
        self.block, self.chunks = block, chunks

    def _one(self, x):  # [b, s/N, h] -> [b, s/N, h]: the block's own norm + MLP
        return Block.mlp_part(self.block, x)

    def __call__(self, x):  # [b, s, h]
        pieces = x.chunk(self.chunks, dim=1)  # views: [b, s/N, h] each
        if not torch.is_grad_enabled():  # nothing is kept for backward: just the chunks
            return torch.cat([self._one(p) for p in pieces], dim=1)
        # Non-reentrant: parameters get their gradients as usual, the RNG state and autocast
        # are restored for the recompute, and it nests inside full recomputation (which
        # turns early stopping off around it: recompute.py). A chunk's own recomputation
        # does stop early, at fc2's input: its output collective is never issued again.
        # Compiled (--torch-compile), each checkpoint marks its chunk for recomputation in
        # the block's graph, which recomputes what backward needs, no more: no early stop.
        stop = (contextlib.nullcontext() if torch.compiler.is_compiling()
                else set_checkpoint_early_stop(True))
        with stop:
            return torch.cat([checkpoint(self._one, p, use_reentrant=False)
                              for p in pieces], dim=1)
