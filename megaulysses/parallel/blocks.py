"""The GPT's transformer blocks as the parallel transforms walk them (tensor, ring, Ulysses,
FPDT, recompute, head groups): typed as `Block`, so what they swap in (a block's attention
core, its attention's head offset) type-checks. Nothing here changes the model."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from megaulysses.model.gpt import GPT, Block


def blocks(model: GPT) -> list[Block]:
    """This rank's blocks, in order (under pp only its stages' ones: `keep_stages`).
    `model.layers` is an `nn.ModuleDict` the GPT fills with Blocks only; a None entry (a
    slot emptied in place) is skipped."""
    return cast("list[Block]", [b for b in model.layers.values() if b is not None])
