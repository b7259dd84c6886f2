"""Activation offload to host (Megatron-LM's --cpu-offloading-num-layers N), for full
recomputation: what a recomputed group of layers keeps for backward is its input alone
(one `[b, s, h]` residual-stream tensor); under offload that input lives in (pinned) host
memory between the group's forward and its recomputation.

    stash = HostStash(x.device)            # one per forward of a stage's layers
    held = stash.hold(x)                   # the group's input; run the group on held.get()
    held.prefetch_on_grad(attn_out)        # in its forward: the group's first attention output
    ...                                    # after the group's forward:
    held.offload()                         # copy to the host, drop the device tensor
    # backward: the recomputation calls held.get() again, which brings the input back;
    # once the gradient of the group's first attention output exists (its MLPs' backward
    # done, its attention's to come), the previous group's input starts coming back

On CUDA both copies run on one side stream, so they overlap the default stream's compute:
the device-to-host copy of group i's input with group i+1's forward, the host-to-device
copy of group i-1's input with group i's attention backward (the longest part of a layer's
backward at long sequences). Starting it there, not at group i's recomputation, keeps it
out of the MLP backward, where a layer's working set peaks. On a CPU the copy is
real but lands in the same memory; `host_memory.mark_host` makes the live-bytes tracker
count the host copies apart from the device bytes, as they would be on a GPU.

The values are copied exactly, so losses are bit-identical with and without offload.
What it costs: 2 copies of the input per offloaded group and step over the host link
(b*s*h*4 bytes each way), hidden behind compute while a group's forward (or backward)
takes longer than its copy.
"""

from __future__ import annotations

from typing import Optional

import torch

from megaulysses.parallel.host_memory import mark_host


class HostStash:
    """The offloaded inputs of one forward of a stage's layers, in forward order."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.held: list[Held] = []

    def hold(self, x: torch.Tensor) -> Held:
        held = Held(self, len(self.held), x)
        self.held.append(held)
        return held


class Held:
    """One group's input: on the device for the group's forward, on the host until backward
    asks for it, then on the device again for its recomputation."""

    def __init__(self, stash: HostStash, index: int, x: torch.Tensor):
        self.stash, self.index, self.where = stash, index, x.device
        self.device: Optional[torch.Tensor] = x  # [b, s, h]
        self.host: Optional[torch.Tensor] = None
        self.ready: Optional[torch.cuda.Event] = None
        self.requires_grad = x.requires_grad

    def get(self) -> torch.Tensor:
        """The input: the original in forward; in the recomputation, the copy back (a leaf
        with the original's requires_grad, so the recomputation saves the same tensors)."""
        if self.host is None:  # not offloaded: the device tensor is still here
            assert self.device is not None, "an input neither on the device nor the host"
            return self.device
        if self.device is None:
            self.fetch()
        if self.ready is not None:
            torch.cuda.current_stream().wait_event(self.ready)
        x, self.device, self.ready, self.host = self.device, None, None, None
        assert x is not None, "fetch() gives the device copy of a host tensor"
        return x.requires_grad_(self.requires_grad)

    @property
    def recomputing(self) -> bool:
        """Offloaded (before `get`): the call to come is the recomputation."""
        return self.host is not None

    def prefetch_on_grad(self, t: torch.Tensor) -> None:
        """Once backward has made `t`'s gradient, start bringing back the previous group's
        input (its recomputation comes after this group's backward)."""
        if self.index > 0 and t.requires_grad:
            previous = self.stash.held[self.index - 1]
            t.register_hook(lambda grad: previous.fetch())

    def offload(self) -> None:
        """Copy the input to the host and drop the device tensor (the group's forward has
        used it; nothing else keeps it)."""
        if self.device is None:
            raise RuntimeError("offload(): this input was offloaded already")
        x, s = self.device.detach(), self.stash.stream
        self.host = mark_host(torch.empty(x.shape, dtype=x.dtype, device="cpu",
                                          pin_memory=self.stash.cuda))
        if s is None:
            self.host.copy_(x)
        else:
            s.wait_stream(torch.cuda.current_stream())  # x is complete
            with torch.cuda.stream(s):
                self.host.copy_(x, non_blocking=True)
            x.record_stream(s)  # its memory is not reused before the copy is done
        self.device = None

    def fetch(self) -> None:
        """Start the copy back to the device (on CUDA asynchronously; `get` waits for it)."""
        if self.device is not None or self.host is None:
            return
        host, s = self.host, self.stash.stream
        if s is None:  # on a CPU, a fresh storage (unmarked: device memory); else a copy
            self.device = host.clone() if self.where.type == "cpu" else host.to(self.where)
            return
        # Allocated on the default stream, which uses it; the side stream only writes it.
        self.device = torch.empty(host.shape, dtype=host.dtype, device=self.where)
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            self.device.copy_(host, non_blocking=True)
            self.ready = s.record_event()
