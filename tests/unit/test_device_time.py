"""Step statistics time device work: the host clock on CPU, CUDA event pairs on a GPU, read only
when settled (the CUDA path runs here against a recording stand-in for `torch.cuda.Event`)."""

from __future__ import annotations

import gc
import time
import weakref
from dataclasses import dataclass

import pytest
import torch

from depthscale.observe.device_time import DeviceTimes
from depthscale.parallel.context_parallel import RingStats
from depthscale.parallel.pipeline.runtime import StepStats


@dataclass
class Stats(DeviceTimes):
    work_s: float = 0.0


def test_cpu_blocks_add_their_host_time_at_once():
    stats = Stats()
    with stats.timing("work_s", torch.device("cpu")):
        time.sleep(0.02)
    assert stats.work_s >= 0.02 and stats.unsettled() == 0
    assert stats.settle() is stats and stats.work_s >= 0.02


class FakeEvent:
    """Stands in for torch.cuda.Event: a clock the test advances, and whether it was waited on."""

    now_ms = 0.0
    synchronized = 0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at = None

    def record(self) -> None:
        self.at = FakeEvent.now_ms

    def synchronize(self) -> None:
        FakeEvent.synchronized += 1

    def elapsed_time(self, end: FakeEvent) -> float:
        return end.at - self.at


def test_cuda_blocks_are_event_pairs_added_only_when_settled(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    FakeEvent.now_ms, FakeEvent.synchronized = 0.0, 0
    stats, cuda = Stats(), torch.device("cuda", 0)
    for ms in (5.0, 7.0):
        with stats.timing("work_s", cuda):
            FakeEvent.now_ms += ms  # the device ran this long; the host returned at once
    assert stats.work_s == 0.0 and stats.unsettled() == 2 and FakeEvent.synchronized == 0
    stats.settle()
    assert stats.work_s == pytest.approx(0.012) and stats.unsettled() == 0
    assert FakeEvent.synchronized == 2
    stats.settle()  # nothing pending: unchanged
    assert stats.work_s == pytest.approx(0.012)


def test_the_step_statistics_are_device_times():
    """The pipeline's, the ring's and the messages' durations go through `timing`."""
    for cls in (StepStats, RingStats):
        assert issubclass(cls, DeviceTimes)
    ring = RingStats()
    with ring.timing("ring_s", torch.device("cpu")):
        pass
    ring.reset()
    assert ring.ring_s == 0.0 and ring.unsettled() == 0


class LaggingDevice:
    """A fake device that runs the events recorded on it `lag` records behind the host, and
    makes the events (`event()`), keeping only weak references to them: `live()` counts the ones
    something still holds."""

    def __init__(self, lag: int | None) -> None:
        self.lag, self.recorded = lag, 0
        self.events: weakref.WeakSet = weakref.WeakSet()

    def event(self) -> LaggingEvent:
        e = LaggingEvent(self)
        self.events.add(e)
        return e

    def live(self) -> int:
        gc.collect()
        return len(self.events)


class LaggingEvent:
    def __init__(self, device: LaggingDevice) -> None:
        self.device, self.at = device, None

    def record(self) -> None:
        self.device.recorded += 1
        self.at = self.device.recorded

    def query(self) -> bool:  # never waits: has the device run this far?
        lag = self.device.lag
        return lag is not None and self.at <= self.device.recorded - lag

    def synchronize(self) -> None:
        raise AssertionError("a host sync inside the step")

    def elapsed_time(self, end: LaggingEvent) -> float:
        return float(end.at - self.at)  # 1 ms per record in between


def _ring_call(stats: RingStats, cuda: torch.device) -> None:
    """What one ring-attention call times: the call, and a wait per hop."""
    with stats.timing("ring_s", cuda):
        for _ in range(3):
            with stats.timing("wait_s", cuda):
                pass


@pytest.mark.parametrize("lag", [8, 500])
def test_a_thousand_ring_calls_leave_a_bounded_number_of_live_events(lag):
    """Nothing reads ring statistics during training: before, every call's pairs stayed pending
    (and alive) for the whole run — 8,000 events here. Now the pairs the device has passed are
    added up as new ones come, without waiting for any (`synchronize` raises)."""
    device = LaggingDevice(lag)
    stats, cuda = RingStats(), torch.device("cuda", 0)
    stats.event_factory = device.event
    for _ in range(1000):
        _ring_call(stats, cuda)
    live = device.live()
    assert stats.unsettled() <= max(RingStats.SWEEP_AT, lag) + 1
    assert live <= 2 * (max(RingStats.SWEEP_AT, lag) + 1), live
    assert stats.dropped_timings == 0
    # what was added is exact: each call's 3 waits take 1 ms (two records apart: start, end)
    settled_calls = (4000 - stats.unsettled()) // 4
    assert stats.wait_s == pytest.approx(3 * 1e-3 * settled_calls, abs=4e-3)


def test_a_device_that_never_catches_up_costs_dropped_timings_not_memory():
    device = LaggingDevice(None)  # nothing ever completes
    stats, cuda = RingStats(), torch.device("cuda", 0)
    stats.event_factory = device.event
    for _ in range(1500):
        _ring_call(stats, cuda)
    assert stats.unsettled() == RingStats.MAX_PENDING
    assert stats.dropped_timings == 6000 - RingStats.MAX_PENDING
    assert device.live() <= 2 * RingStats.MAX_PENDING + 2
    assert stats.ring_s == stats.wait_s == 0.0  # dropped, never guessed
