"""Where a run trains: CUDA when there is one, else the CPU.

`pick_device()` is the one place the trainer asks; tests make it answer another device
(`training/fake_device.py`'s fake accelerator) with `use`, so a whole Trainer runs there.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

_forced: Optional[torch.device] = None


def pick_device() -> torch.device:
    if _forced is not None:
        return _forced
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@contextlib.contextmanager
def use(device: torch.device) -> Iterator[None]:
    """`pick_device()` answers `device` inside (tests only)."""
    global _forced
    before, _forced = _forced, torch.device(device)
    try:
        yield
    finally:
        _forced = before
