"""Settings of the training process itself (not of the model or the parallel layout)."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

import torch

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_KEEP_BYTES = 1 << 30
"""mmap threshold: blocks up to this size come from the heap and are reused after free."""


def keep_freed_host_memory() -> bool:
    """Make glibc malloc keep freed memory for reuse instead of handing it back to the OS.

    A training step frees and re-allocates the same activations every step. With glibc's defaults,
    large blocks are fresh mmaps and a freed heap top is trimmed, so every step page-faults its
    activations in again (on CPU at d=256, ~3k faults per step for the standard residual and ~8k
    with Block AttnRes, whose reads allocate more fresh [B, T, d] buffers: 5-10 ms per step).
    Raising the mmap and trim thresholds makes freed blocks reused, as jemalloc or tcmalloc would;
    resident memory then stays at the step's peak. Returns False where libc is not glibc (no-op).
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1) == 1 and ok
    if not ok:
        log.warning("mallopt refused the host-memory settings; page faults per step remain")
    return ok


ALLOC_ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
"""Where a user sets torch's device-allocator options (the first is the newer, generic name)."""
EXPANDABLE = "expandable_segments:True"


def expandable_segments(device_type: str) -> bool:
    """Make torch's CUDA caching allocator grow segments in place (`expandable_segments`), unless
    the user configured the allocator (either environment variable, or the settings already set
    in this process). Call before the first CUDA allocation. True when it was applied.

    Without it, blocks of many sizes — the ring's fp32 merge temporaries, FSDP2's all-gather and
    reduce-scatter buffers, whose sizes change per layer — fragment device memory: reserved
    memory grows well past what is allocated, and a long run dies out of memory at a step it had
    passed a thousand times. Expandable segments map more physical memory into one virtual range
    instead of cutting fixed segments (torchtitan and Megatron set it for the same reason). The
    variable is set too, so that processes this one starts (checkpoint writers, tools) inherit it;
    the setting itself is applied now because torch read the variable when it was imported."""
    if device_type != "cuda":
        return False
    if any(os.environ.get(name) for name in ALLOC_ENV):
        return False  # the user's choice, whatever it is
    if torch._C._accelerator_getAllocatorSettings():
        return False  # set in this process already (torch.cuda.memory._set_allocator_settings)
    os.environ[ALLOC_ENV[0]] = EXPANDABLE
    torch._C._accelerator_setAllocatorSettings(EXPANDABLE)
    return True
