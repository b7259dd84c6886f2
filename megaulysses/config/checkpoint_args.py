"""--use-checkpoint-args (Megatron-LM's flag): the model flags come from the --load
checkpoint. What the checkpoint holds is read by the caller (training.checkpoint_args:
ours or Megatron-LM's, no import of it here); this module merges it into the parsed flags.
A model flag the command line gives must agree with the checkpoint: one that contradicts
it is an error naming both values (Megatron-LM lets the command line win silently)."""

from __future__ import annotations

import argparse
from typing import Any, Callable, Optional

from megaulysses.config.errors import ConfigError

# {dest: value} of the checkpoint's model, a word for where it came from, and the dests a
# command line may change (no weight depends on them: --seq-length, dropout, RoPE's
# positions for context extension, as --load allows; they are logged there).
# Called with (--load, --save): a run's own --save without a checkpoint yet (a first job
# that later ones resume) gives no fields, and the flags given build the model, as in
# Megatron-LM ("Checkpoint not found to provide arguments, using provided arguments").
CheckpointModel = Callable[[str, Optional[str]], tuple[dict[str, Any], str, set[str]]]


def _same(dest: str, ours: Any, theirs: Any, fields: dict) -> bool:
    if dest == "num_query_groups":  # None is one group per head
        heads = fields["num_attention_heads"]
        return (ours or heads) == (theirs or heads)
    if isinstance(ours, (int, float)) and isinstance(theirs, (int, float)) \
            and not isinstance(ours, bool):
        return float(ours) == float(theirs)
    return ours == theirs


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def apply_checkpoint_args(ns: argparse.Namespace, given: set[str],
                          read: Optional[CheckpointModel]) -> set[str]:
    """Set the checkpoint's model flags into `ns`; the dests now set (for the presets)."""
    if not ns.use_checkpoint_args:
        return given
    if not ns.load:
        raise ConfigError("--use-checkpoint-args", "needs --load (the checkpoint to read "
                                                   "the model flags from)")
    if read is None:
        raise ConfigError("--use-checkpoint-args", "not available to this command")
    fields, where, free = read(ns.load, ns.save)
    for dest, value in fields.items():
        if dest in given and dest not in free and not _same(dest, getattr(ns, dest), value,
                                                            fields):
            raise ConfigError(_flag(dest), f"is {getattr(ns, dest)} here but {value} in "
                                           f"{where} (--use-checkpoint-args): drop the flag "
                                           "or give the checkpoint's value")
        if dest not in given:
            setattr(ns, dest, value)
    return given | set(fields)
