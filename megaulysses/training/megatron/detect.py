"""Is a --load directory Megatron-LM's? Its layout says (no file is read but the tracker):

    <save>/latest_checkpointed_iteration.txt  "10" or "release" (ours has the same name,
                                              but our iter_* directories hold
                                              trainer_state.json and COMMITTED)
    <save>/iter_0000010/ or release/          metadata.json (torch_dist) or mp_rank_*
                                              directories (the legacy torch format)
"""

from __future__ import annotations

import os
import re
from typing import Optional

TRACKER = "latest_checkpointed_iteration.txt"
CONFIG_FILE = "metadata.json"
RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")


def checkpoint_format(path: str) -> Optional[str]:
    """The format of a Megatron-LM iter_*/release directory, or None."""
    if os.path.exists(os.path.join(path, CONFIG_FILE)) and not os.path.exists(
            os.path.join(path, "trainer_state.json")):
        return "torch_dist"
    try:
        if any(RANK_DIR.match(n) for n in os.listdir(path)):
            return "torch"
    except OSError:
        return None
    return None


def find_iteration_dir(load: str) -> Optional[str]:
    """The iter_*/release directory `load` names (itself, or its tracker's), when it is a
    Megatron-LM checkpoint; None when it is not one (ours, or nothing)."""
    if not os.path.isdir(load):
        return None
    if checkpoint_format(load):
        return load
    tracker = os.path.join(load, TRACKER)
    if not os.path.isfile(tracker):
        return None
    text = open(tracker).read().strip()
    name = "release" if text == "release" else (
        f"iter_{int(text):07d}" if text.isdigit() else None)
    if name is None:
        return None  # checkpoint.py names the unreadable tracker
    path = os.path.join(load, name)
    if not os.path.isdir(path) or checkpoint_format(path) is None:
        return None  # ours (same tracker name, our files), or nothing: checkpoint.py says
    return path
