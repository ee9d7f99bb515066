"""Durations of device work for step statistics (pipeline compute and bubble, ring time, time
blocked on messages), measured where the work runs.

On a CPU the work runs as it is issued, so the host clock around a block is its duration. On a GPU
the host only queues kernels: `perf_counter` around a forward measures its launches, and around a
NCCL wait measures nothing (the wait is queued too). There, a pair of CUDA events on the current
stream brackets the block, and the elapsed time between them is what the stream spent on it,
waiting included.

Reading an event's time needs the event to have run. Waiting for it (`settle()`) is a host sync,
so that happens only where statistics are read (benchmarks, log steps), never inside a step. But
nothing guarantees a reader: ring attention times every call and every wait, two events each —
about 10⁴ pairs a step at cp=8 over 32 layers — and the trainer never reads those statistics, so
the pairs (and the driver's events behind them) piled up for the whole run. The pending pairs are
therefore a bounded queue: once it holds `SWEEP_AT` pairs, each new pair first adds up the oldest
ones the device has already passed (`query()`, which never waits), so in steady state the queue
holds only what the device has not reached yet. Should the device fall `MAX_PENDING` pairs behind
(it cannot for long: the launch queue blocks the host first), the oldest pair is dropped unread
and counted in `dropped_timings` rather than waited for.

This module imports nothing else from depthscale.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


def cuda_timing_event() -> Any:
    """A CUDA event that records time (`DeviceTimes.event_factory`'s default)."""
    return torch.cuda.Event(enable_timing=True)


@dataclass
class DeviceTimes:
    """Base of a statistics dataclass whose float `*_s` fields are durations of device work:
    `timing(name, device)` adds a block's duration to field `name` (at once on CPU; on CUDA once the
    device has run it — swept while timing later blocks, or at the next `settle()`)."""

    # class attributes, not annotated: no dataclass field (`RingStats.reset` walks the fields)
    SWEEP_AT = 64
    """Pending pairs before new ones start adding up the oldest finished ones."""
    MAX_PENDING = 4096
    """Pending pairs never exceed this: beyond it the oldest is dropped unread."""
    event_factory = staticmethod(cuda_timing_event)
    """Makes one timing event (tests set a stand-in on an instance, or a staticmethod here)."""

    dropped_timings: int = field(default=0, init=False, repr=False, compare=False)
    """CUDA intervals given up because the device was `MAX_PENDING` pairs behind."""
    _unsettled: deque[tuple[str, Any, Any]] = field(
        default_factory=deque, init=False, repr=False, compare=False
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
        start = self.event_factory()
        start.record()
        try:
            yield
        finally:
            end = self.event_factory()
            end.record()
            self._pend(name, start, end)

    def _pend(self, name: str, start: Any, end: Any) -> None:
        pending = self._unsettled
        if len(pending) >= self.SWEEP_AT:
            # pairs end in the order they were recorded: stop at the first the device has not
            # passed (one query per call in steady state)
            while pending and pending[0][2].query():
                self._add(*pending.popleft())
            while len(pending) >= self.MAX_PENDING:
                pending.popleft()
                self.dropped_timings += 1
        pending.append((name, start, end))

    def _add(self, name: str, start: Any, end: Any) -> None:
        setattr(self, name, getattr(self, name) + start.elapsed_time(end) / 1e3)

    def settle(self):
        """Add the CUDA intervals recorded so far to their fields (waits for the last of them to
        run on the device); returns self. A no-op on CPU."""
        pending, self._unsettled = self._unsettled, deque()
        for name, start, end in pending:
            end.synchronize()
            self._add(name, start, end)
        return self

    def unsettled(self) -> int:
        """CUDA intervals not yet added to their fields."""
        return len(self._unsettled)
