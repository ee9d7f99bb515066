"""Durations of device work for step statistics (pipeline compute and bubble, ring time, time
blocked on messages), measured where the work runs.

On a CPU the work runs as it is issued, so the host clock around a block is its duration. On a GPU
the host only queues kernels: `perf_counter` around a forward measures its launches, and around a
NCCL wait measures nothing (the wait is queued too). There, a pair of CUDA events on the current
stream brackets the block, and the elapsed time between them is what the stream spent on it,
waiting included. Reading an event's time needs the event to have run, a host sync, so the pairs
are kept and `DeviceTimes.settle()` adds them up when the statistics are read (benchmarks, log
steps), never inside a step.

This module imports nothing else from depthscale.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class DeviceTimes:
    """Base of a statistics dataclass whose float `*_s` fields are durations of device work:
    `timing(name, device)` adds a block's duration to field `name` (at once on CPU, at the next
    `settle()` on CUDA)."""

    _unsettled: list[tuple[str, Any, Any]] = field(
        default_factory=list, init=False, repr=False, compare=False
    )

    @contextlib.contextmanager
    def timing(self, name: str, device: torch.device) -> Iterator[None]:
        if device.type != "cuda":
            t0 = time.perf_counter()
            try:
                yield
            finally:
                setattr(self, name, getattr(self, name) + time.perf_counter() - t0)
            return
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            yield
        finally:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._unsettled.append((name, start, end))

    def settle(self):
        """Add the CUDA intervals recorded so far to their fields (waits for the last of them to
        run on the device); returns self. A no-op on CPU."""
        pending, self._unsettled = self._unsettled, []
        for name, start, end in pending:
            end.synchronize()
            setattr(self, name, getattr(self, name) + start.elapsed_time(end) / 1e3)
        return self

    def unsettled(self) -> int:
        """CUDA intervals not yet added to their fields."""
        return len(self._unsettled)
