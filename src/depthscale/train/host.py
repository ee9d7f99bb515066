"""Settings of the training process itself (not of the model or the parallel layout)."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

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
