"""Pinned host memory for activation offload: slabs of exact size, pinned once, reused every step.

One `torch.empty(..., pin_memory=True)` per saved tensor goes through torch's host caching
allocator, which rounds every block up to a power of two and reuses a freed block only for a
request of its size class: a 1.1 GiB activation takes a 2 GiB block, so offload could pin up to
twice the host memory the activations need, per rank, on hosts whose memory eight ranks share.

Here host memory comes in slabs of exact size (`SLAB_BYTES`, or one tensor's bytes if larger),
pinned once with `cudaHostRegister` on plain host memory (no rounding), and each saved tensor
takes its exact bytes from a slab (to `ALIGN`). A slab is reused once every region taken from it
has been released, which a step's backward does for the tensors its forward offloaded; the slabs
stay for the next step, so a run pins about what its largest step keeps on the host, once.

Order on CUDA without waiting on the host: a region is released when its offload entry dies, after
backward queued the copy back to the device on the copy-in stream; the pool records `fence()`
(an event on that stream) then, and the first copy into the slab once it is reused waits for the
latest fence (`wait(fence)`, a stream wait on the copy-out stream). Copies into one slab are all
on the copy-out stream, so they are ordered among themselves.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

SLAB_BYTES = 64 << 20
"""A slab's size unless one tensor needs more: large enough that a step's activations take a few
tens of slabs, small enough that the tail left unused in each is negligible."""
ALIGN = 512
"""Each region starts this many bytes (a multiple) into its slab, which starts on a page: DMA-
friendly, and any dtype's alignment."""


def pin_host_bytes(nbytes: int) -> torch.Tensor:
    """`nbytes` of page-locked host memory, exactly: plain host memory registered with CUDA (and
    unregistered when the tensor dies), falling back to torch's pinned allocator where
    registration is refused."""
    page = 4096  # registration pins whole pages: start on one, so no neighbour shares them
    raw = torch.empty(nbytes + page - 1, dtype=torch.uint8)
    start = -raw.data_ptr() % page
    buffer = raw[start : start + nbytes]
    cudart = torch.cuda.cudart()
    ptr = buffer.data_ptr()
    code = cudart.cudaHostRegister(ptr, nbytes, 0)  # a cudaError enum: `.value` 0 is success
    if getattr(code, "value", code) != 0:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    weakref.finalize(buffer, cudart.cudaHostUnregister, ptr)
    return buffer


class _Slab:
    __slots__ = ("buffer", "size", "offset", "live", "fence")

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer, self.size = buffer, buffer.numel()
        self.offset = self.live = 0
        self.fence: object | None = None


class PinnedPool:
    """Host buffers for offloaded tensors, carved from pinned slabs (see the module docstring).

    `pin(nbytes)` makes a slab (default `pin_host_bytes`; tests pass a stand-in), `fence()` is
    called when a region is released and returns what the next copy into its slab must wait for
    (None: nothing), given to `take(..., wait=)` when the slab is reused."""

    def __init__(
        self,
        pin: Callable[[int], torch.Tensor] = pin_host_bytes,
        fence: Callable[[], object | None] = lambda: None,
        slab_bytes: int = SLAB_BYTES,
    ) -> None:
        self._pin, self._fence, self.slab_bytes = pin, fence, slab_bytes
        self.slabs: list[_Slab] = []

    @property
    def pinned_bytes(self) -> int:
        """Host memory pinned so far (never given back while the pool lives)."""
        return sum(s.size for s in self.slabs)

    @property
    def live_regions(self) -> int:
        return sum(s.live for s in self.slabs)

    def take(
        self,
        shape: torch.Size | tuple[int, ...],
        dtype: torch.dtype,
        wait: Callable[[object], None] | None = None,
    ) -> torch.Tensor:
        """An uninitialised host tensor of `shape` and `dtype` in pinned memory, released back to
        the pool when it dies. `wait(fence)` is called first if its slab was released since its
        last use and a fence was recorded then."""
        nbytes = max(1, torch.Size(shape).numel()) * dtype.itemsize
        size = -(-nbytes // ALIGN) * ALIGN
        slab = self._slab_for(size)
        if slab.fence is not None and slab.offset == 0:
            if wait is not None:
                wait(slab.fence)
            slab.fence = None
        start = slab.offset
        slab.offset += size
        slab.live += 1
        numel = torch.Size(shape).numel()
        view = slab.buffer[start : start + numel * dtype.itemsize].view(dtype).view(shape)
        weakref.finalize(view, self._release, slab)
        return view

    def _slab_for(self, size: int) -> _Slab:
        """The first slab with `size` bytes free after its last region, else a new one."""
        for slab in self.slabs:
            if slab.offset + size <= slab.size:
                return slab
        slab = _Slab(self._pin(max(self.slab_bytes, size)))
        self.slabs.append(slab)
        return slab

    def _release(self, slab: _Slab) -> None:
        slab.live -= 1
        slab.fence = self._fence()  # the latest: it follows every earlier copy on its stream
        if slab.live == 0:
            slab.offset = 0  # the whole slab is free again
