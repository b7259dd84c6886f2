"""--optimizer-cpu-offload: the distributed optimizer's fp32 state on the host.

For `fraction` of its parameters (by element count, in the optimizer's order) the
distributed optimizer (dist_opt.py) keeps the fp32 main
rows, Adam's moments and a copy of the reduced gradient rows in host memory (pinned when
beside a GPU). torch's AdamW steps host and device rows in one call (it groups tensors by
device; fused on both). A step: each bucket's gradient rows go to the host as soon as its
reduce-scatter ends (D2H), AdamW steps, and the updated rows come back into the 16-bit
gather (H2D). With `overlap` (--overlap-cpu-optimizer-d2h-h2d) the copies are
asynchronous, from and into pinned memory, and the host waits for them once, before it
reads the gradients (their norm, then the step): a bucket's copy overlaps the reductions
still in flight.

Every host tensor is marked (`live_bytes.mark_host`): trackers and `storage_bytes` count
it apart from device memory, which on a CPU-only machine is the same memory.
"""

from __future__ import annotations

from typing import Optional

import torch

from megaulysses.parallel.grad_reduce import _storage_bytes
from megaulysses.parallel.host_memory import mark_host


def offloaded(params: list, fraction: Optional[float]) -> list:
    """Parameters in order, each taken while the elements taken stay within `fraction` of
    the whole (one too large is passed over, not the end of the walk)."""
    if not fraction:
        return []
    budget, out = fraction * sum(p.numel() for p in params), []
    for p in params:
        if p.numel() <= budget + 0.5:
            budget -= p.numel()
            out.append(p)
    return out


class HostState:
    """Which parameters' optimizer state is on the host, and their copies there and back."""

    def __init__(self, params: list, fraction: Optional[float], overlap: bool,
                 device: torch.device):
        self.device, self.pin = device, device.type == "cuda"
        self.params = set(offloaded(params, fraction))
        self.overlap = overlap and bool(self.params)
        self.grads: dict = {}  # param -> host fp32 rows of its reduced gradient

    def _empty(self, shape) -> torch.Tensor:
        return mark_host(torch.empty(shape, dtype=torch.float32, pin_memory=self.pin))

    def main(self, p, rows: torch.Tensor) -> torch.Tensor:
        """`p`'s fp32 main rows (a copy of `rows`): on the device, or on the host."""
        if p not in self.params:
            return rows.float().clone()
        self.grads[p] = self._empty(rows.shape)
        return self._empty(rows.shape).copy_(rows)

    def grad(self, p, rows: torch.Tensor) -> torch.Tensor:
        """`p`'s main gradient from its reduced `rows`: fp32, on the host if offloaded."""
        if p not in self.params:
            return rows if rows.dtype == torch.float32 else rows.float()
        return self.grads[p].copy_(rows, non_blocking=self.overlap)

    def arrived(self) -> None:
        """The host waits for the asynchronous gradient copies before reading them."""
        if self.overlap and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def mark_states(self, state: dict, views: dict) -> None:
        """Adam's states of the offloaded rows (made on the host with them) marked."""
        for p in self.params:
            for v in state[views[p]].values():
                if isinstance(v, torch.Tensor):
                    mark_host(v)

    def held_bytes(self, seen: set, state: dict, views: dict) -> int:
        """Host bytes: main rows, gradient rows and Adam's states of the offloaded."""
        tensors = [t for p in self.params for t in (views[p], self.grads[p])]
        tensors += [v for p in self.params for v in state.get(views[p], {}).values()
                    if isinstance(v, torch.Tensor)]
        return sum(_storage_bytes(t, seen) for t in tensors)
