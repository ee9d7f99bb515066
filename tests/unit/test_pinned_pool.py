"""train/pinned_pool.py: offloaded activations' host copies come from pinned slabs of exact size,
reused every step, instead of one pinned allocation per tensor (which torch's host caching
allocator rounds up to a power of two: up to twice the host memory). Pinning itself needs CUDA, so
a stand-in records what would be pinned; the carving, reuse and ordering are the pool's own."""

from __future__ import annotations

import gc

import torch

from depthscale.train.pinned_pool import ALIGN, PinnedPool

MIB = 1 << 20


class _Pins:
    """A stand-in for pinning: plain host memory, each request recorded."""

    def __init__(self):
        self.sizes: list[int] = []

    def __call__(self, nbytes: int) -> torch.Tensor:
        self.sizes.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)


def _step(pool: PinnedPool, shapes, wait=None) -> list[torch.Tensor]:
    """A forward's host copies: each filled with its own value, then all read back unchanged."""
    tensors = []
    for i, shape in enumerate(shapes):
        t = pool.take(shape, torch.bfloat16, wait=wait)
        t.fill_(float(i + 1))
        tensors.append(t)
    for i, t in enumerate(tensors):  # no region overlaps another live one
        assert t.shape == torch.Size(shape := shapes[i]) and bool((t == i + 1).all()), shape
    return tensors


def test_host_copies_take_exact_bytes_and_are_reused_every_step():
    """Activation-like sizes (9 MiB and 1.1× 8 MiB per layer): the slabs pinned cover the step's
    bytes to within one slab's tail each, where per-tensor pinning rounded each to a power of two
    (16 MiB); later steps pin nothing more, and releasing a step frees every region."""
    shapes = [(4, 1152, 1024), (4, 1024, 1127)] * 6  # 9 MiB and ~8.8 MiB, bf16
    pins = _Pins()
    pool = PinnedPool(pin=pins, slab_bytes=32 * MIB)
    need = sum(torch.Size(s).numel() * 2 for s in shapes)
    rounded = sum(1 << (torch.Size(s).numel() * 2 - 1).bit_length() for s in shapes)
    for _ in range(3):
        tensors = _step(pool, shapes)
        assert pool.live_regions == len(shapes)
        del tensors, _  # backward is done with them
        gc.collect()
        assert pool.live_regions == 0
    assert pool.pinned_bytes == sum(pins.sizes) and len(pins.sizes) == 4  # the first step's
    assert need <= pool.pinned_bytes < need + len(pins.sizes) * 9 * MIB  # a tail per slab
    assert rounded == 12 * 16 * MIB and pool.pinned_bytes < 0.75 * rounded


def test_a_tensor_larger_than_a_slab_gets_a_slab_of_its_exact_size():
    pins = _Pins()
    pool = PinnedPool(pin=pins, slab_bytes=MIB)
    small = pool.take((3,), torch.bfloat16)
    t = pool.take((3 * MIB + 1,), torch.uint8)
    assert pins.sizes == [MIB, -(-(3 * MIB + 1) // ALIGN) * ALIGN]
    assert t.numel() == 3 * MIB + 1 and t.data_ptr() == pool.slabs[1].buffer.data_ptr()
    again = pool.take((5,), torch.float32)  # after `small`'s region, rounded up to ALIGN
    assert again.data_ptr() - small.data_ptr() == ALIGN


def test_a_reused_slab_waits_for_the_fence_of_its_last_release():
    """On CUDA the fence is an event on the copy-in stream recorded when backward releases a
    region: the first copy into the slab after it is reused must wait for it (the copy back to
    the device may still be reading it); a fresh slab, or one not yet reset, waits for nothing."""
    fences, waits = iter(range(100)), []
    pool = PinnedPool(pin=_Pins(), fence=lambda: next(fences), slab_bytes=MIB)
    first = _step(pool, [(256, 256)] * 3, wait=waits.append)  # 3 × 128 KiB: one slab
    assert waits == []
    del first[0]
    gc.collect()
    _step(pool, [(256, 256)], wait=waits.append)  # not reset (2 regions live): bump on, no wait
    assert waits == [] and pool.live_regions == 2  # the step's own region is released already
    del first
    gc.collect()
    second = _step(pool, [(256, 256)] * 2, wait=waits.append)
    assert waits == [3]  # reset: the latest of the four releases' fences (0..3), waited once
    assert second[0].data_ptr() == pool.slabs[0].buffer.data_ptr()  # the slab from its start
