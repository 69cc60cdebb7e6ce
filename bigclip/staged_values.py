"""State-dict values a checkpoint makes while it copies them to host memory, not when the state dict is taken.

A save takes the state dict in the loop's thread, all at once; the checkpoint's stager (DCP's DefaultStager) then
copies it into host memory in the background. A value that is a transformation of what the run holds rather than
a tensor it holds (8-bit AdamW's moments, saved dequantized to float32: optim/adamw8bit.py) would be made whole on
the device when the state dict is taken: for 8-bit AdamW, 8 bytes per parameter at once, twice what the leanest
setup's whole state takes. Inside `staging_into(pool)` such a value is a `MadeWhenStaged` placeholder instead: the
stager's deep copy of it makes that one tensor on the device, copies it into a host buffer the pool keeps from one
save to the next, and lets it go, so the device holds one such tensor at a time. Outside, it is made at once.

The copy runs on the stager's thread's current stream (the default stream on CUDA: ordered after the training
kernels queued so far and before any queued later, so it reads what the last optimizer step wrote; the loop waits
for the stager before the next step), and is synchronous, so the host buffer is complete when the copy returns.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


class HostPool:
    """Host buffers for placeholders, one per source (kept from one save to the next): pinned for fast copies from
    an accelerator, or in shared memory where another process writes the checkpoint (DCP's process writer)."""

    def __init__(self, pinned: bool = False, shared: bool = False):
        self.pinned, self.shared = pinned, shared
        self._buffers: dict[int, tuple[object, torch.Tensor]] = {}

    def buffer(self, source: object, like: torch.Tensor) -> torch.Tensor:
        """The host buffer for `source` (the tensor the value is made from; held here so its id stays its own),
        shaped and typed as `like`."""
        held = self._buffers.get(id(source))
        if held is None or held[0] is not source or held[1].shape != like.shape or held[1].dtype != like.dtype:
            host = torch.empty(like.shape, dtype=like.dtype, pin_memory=self.pinned and not self.shared)
            if self.shared:
                host.share_memory_()
            self._buffers[id(source)] = (source, host)
        return self._buffers[id(source)][1]

    def close(self) -> None:
        self._buffers.clear()


_POOL: contextvars.ContextVar[HostPool | None] = contextvars.ContextVar("bigclip_staging_pool", default=None)


@contextmanager
def staging_into(pool: HostPool) -> Iterator[None]:
    """State dicts taken inside hold placeholders for the values made with `made_when_staged`."""
    token = _POOL.set(pool)
    try:
        yield
    finally:
        _POOL.reset(token)


class MadeWhenStaged:
    """A value of a state dict being saved, made when the stager copies it (see the module docstring). It answers
    numel() and element_size() as the tensor will (the DCP layout splits DDP's writing between ranks by size)."""

    def __init__(self, pool: HostPool, source: object, make: Callable[[], torch.Tensor], wrap, shape, dtype):
        self.pool, self.source, self.make, self.wrap = pool, source, make, wrap
        self.shape, self.dtype = torch.Size(shape), dtype

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self.dtype.itemsize

    def __deepcopy__(self, memo) -> torch.Tensor:
        made = self.make()  # on the device: this one tensor
        host = self.pool.buffer(self.source, made)
        host.copy_(made)
        del made
        return self.wrap(host)


def made_when_staged(
    source: object, make: Callable[[], torch.Tensor], shape, dtype, wrap: Callable[[torch.Tensor], torch.Tensor]
):
    """wrap(make()) now, or inside `staging_into` a placeholder that makes it when the stager copies it. `make`
    gives the local tensor (shape `shape`, dtype `dtype`), `wrap` turns a local tensor into the state dict's value
    (a DTensor over the run's mesh, or itself)."""
    pool = _POOL.get()
    if pool is None:
        return wrap(make())
    return MadeWhenStaged(pool, source, make, wrap, shape, dtype)
