"""Which tensors stand for host memory: what an offload puts on the host (pinned CPU memory
beside a GPU) is plain CPU memory on a CPU-only machine, where only this mark tells it from
device memory. The live-bytes tracker (training/live_bytes.py) counts marked storages
apart; `mark_host` tells the active trackers of each new mark."""

from __future__ import annotations

import functools
import weakref
from typing import Callable

import torch

_HOST: dict = {}  # id(untyped storage) -> weak reference, while the storage lives
_LISTENERS: list = []  # callables(storage id): the live-bytes trackers now active


def mark_host(t: torch.Tensor) -> torch.Tensor:
    """Count `t`'s storage as host memory from now on; returns `t`."""
    st = t.untyped_storage()
    key = id(st)
    if key not in _HOST:
        _HOST[key] = weakref.ref(st, functools.partial(_forget, key))
        for tell in list(_LISTENERS):
            tell(key)
    return t


def _forget(key: int, _ref: object) -> None:
    """The weak reference's callback: the storage `key` names is gone."""
    _HOST.pop(key, None)


def is_host(t: torch.Tensor) -> bool:
    return id(t.untyped_storage()) in _HOST


def is_host_storage(key: int) -> bool:
    """`key`: id() of an untyped storage."""
    return key in _HOST


def listen(tell: Callable[[int], None], on: bool) -> None:
    """Be told (on) or no longer (off) of every storage marked from now on."""
    if on:
        _LISTENERS.append(tell)
    elif tell in _LISTENERS:
        _LISTENERS.remove(tell)
