"""Activation recomputation, Megatron-LM's flags, as a transform of the GPT.

    --recompute-granularity selective   (= --recompute-activations) the attention core
        alone is recomputed in backward. Under Ulysses it is the core *between* the two
        all-to-alls, so nothing is sent again: backward keeps q, k, v and the output of
        each core instead of what the core itself saves (the softmax probabilities on
        the CPU block kernel, b*h/P*S^2/2 values; flash-style kernels save only O(S)).
    --recompute-granularity full        whole blocks are recomputed: backward keeps only
        the input of each checkpointed group of blocks, and reruns their forward,
        collectives included: Ulysses' two forward all-to-alls per layer (q, k, v and the
        output: half of the layer's all-to-all bytes, so a step sends 1.5x), and under
        tensor parallelism the forward all-reduces (or Megatron-SP's all-gathers and
        reduce-scatters). `comm.stats` counts these repeats like any other bytes.
        --recompute-method uniform: the layers of each pipeline stage in groups of
            --recompute-num-layers, each group one checkpoint (only its input kept);
        --recompute-method block: the first --recompute-num-layers layers of each stage
            checkpointed one by one, the rest keep their activations.

torch.utils.checkpoint (non-reentrant) restores the RNG before recomputing, so dropout
draws the same masks and the results are identical to a run without recomputation.
ZeRO-3 (FSDP2) composes: a recomputed block's parameters are already gathered for its
backward, and FSDP's hooks skip themselves during the recomputation (no extra all-gather;
with groups of several blocks, the earlier blocks of a group are gathered once more).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Optional

import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from megaulysses.parallel.activation_offload import Held, HostStash
from megaulysses.parallel.blocks import blocks
from megaulysses.parallel.ulysses import UlyssesAttention

if TYPE_CHECKING:
    from megaulysses.model.attention import AttentionCore
    from megaulysses.model.gpt import GPT


def apply_recompute(model: GPT, granularity: Optional[str], method: Optional[str] = None,
                    num_layers: Optional[int] = None, early_stop: bool = True,
                    offload_layers: int = 0) -> GPT:
    """Make backward recompute what `granularity` says (None: nothing). In place.

    `early_stop`: a group's recomputation may stop once it has made every tensor backward
    needs (torch's default: the group's last fc2 and its collective are not rerun). Pass
    False when the blocks hold checkpoints of their own (the tiled MLP): under tensor
    parallelism, a recomputation stopped inside the nested checkpoints leaves DTensor's
    pending collectives un-waited, whose buffers then keep every layer's recomputed
    attention alive until the step ends (measured: 1.3-1.7x the peak; fake process groups
    do not show it, their collectives finish at once).

    `offload_layers` (--cpu-offloading-num-layers, full only): the inputs kept by the groups
    that start in the first `offload_layers` layers of a stage wait in host memory
    (parallel/activation_offload.py)."""
    if granularity == "selective":
        for block in blocks(model):
            holder = block.attn.core if isinstance(block.attn.core, UlyssesAttention) \
                else block.attn
            holder.core = RecomputedCore(holder.core)
    elif granularity == "full":
        # The GPT's own loop over layers, replaced on this instance (pipeline stages call it
        # with their layers): the groups are cut from whatever layers one call runs.
        model.run_layers = partial(  # type: ignore[method-assign]  # on this instance only
            _run_layers, model, method or "uniform", num_layers or 1, early_stop,
            offload_layers)
    return model


class RecomputedCore:
    """An attention core `(q, k, v, dropout_p, mask) -> out` whose internals backward
    recomputes: only its inputs are kept."""

    def __init__(self, core: AttentionCore):
        self.core = core

    def __call__(self, q, k, v, dropout_p: float = 0.0, mask=None):  # [b, S, h/P, d] each
        if not torch.is_grad_enabled():
            return self.core(q, k, v, dropout_p, mask)
        return checkpoint(self.core, q, k, v, dropout_p, mask, use_reentrant=False)


def layer_groups(n: int, method: str, num_layers: int) -> list[tuple[int, int, bool]]:
    """[(first, end, recomputed)] covering layers 0..n-1 of one stage, in order."""
    if method == "uniform":
        return [(a, min(a + num_layers, n), True) for a in range(0, n, num_layers)]
    k = min(num_layers, n)  # block: the first k one by one, the rest as they are
    return [(a, a + 1, True) for a in range(k)] + ([(k, n, False)] if k < n else [])


def _run_layers(model, method: str, num_layers: int, early_stop: bool, offload_layers: int,
                x, position_ids, layers, documents=None):
    layers = list(layers)
    rotary = model.rotary(position_ids)  # shared by every group, kept once
    mask = model.attention_mask(documents)
    stash = HostStash(x.device) if offload_layers else None  # this forward's host copies

    def run(first: int, end: int, h):  # [b, s, h] -> [b, s, h]
        for layer in layers[first:end]:
            h = layer(h, rotary, mask)
        return h

    def run_held(first: int, end: int, held: Held):  # the input from wherever it is now
        if held.recomputing:
            return run(first, end, held.get())
        x = held.get()
        # the forward: mark when backward will reach the group's first attention
        hook = layers[first].attn.register_forward_hook(
            lambda module, args, out: held.prefetch_on_grad(out))
        try:
            return run(first, end, x)
        finally:
            hook.remove()

    for first, end, recomputed in layer_groups(len(layers), method, num_layers):
        if not (recomputed and torch.is_grad_enabled()):
            x = run(first, end, x)
            continue
        with set_checkpoint_early_stop(early_stop):
            if first < offload_layers:  # the checkpoint keeps `held`, not the tensor
                assert stash is not None, "made where offload_layers > 0"
                held = stash.hold(x)
                x = checkpoint(run_held, first, end, held, use_reentrant=False)
                held.offload()
            else:
                x = checkpoint(run, first, end, x, use_reentrant=False)
    return x
