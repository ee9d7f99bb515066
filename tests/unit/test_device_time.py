"""Step statistics time device work: the host clock on CPU, CUDA event pairs on a GPU, read only
when settled (the CUDA path runs here against a recording stand-in for `torch.cuda.Event`)."""

from __future__ import annotations

import time
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
