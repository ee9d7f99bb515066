"""The span recorder on CUDA, against stand-ins for torch.cuda: its writer thread makes the rank's
GPU current before it resolves any event (CUDA's current device is per thread, 0 in a new one: a
writer that synchronised an event without choosing opened a context on GPU 0 for every rank)."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from depthscale.observe import spans
from depthscale.observe.spans import SpanRecorder, trace_path


class FakeCuda:
    """Records, per thread, the device set and every event call, in order."""

    def __init__(self, current: int) -> None:
        self.current = current  # the creating (training) thread's device
        self.calls: list[tuple[str, str, object]] = []  # (thread name, call, argument)
        self.lock = threading.Lock()

    def log(self, call: str, arg: object = None) -> None:
        with self.lock:
            self.calls.append((threading.current_thread().name, call, arg))

    def set_device(self, index: int) -> None:
        self.log("set_device", index)

    def current_device(self) -> int:
        return self.current

    def event(self, enable_timing: bool = False) -> FakeEvent:
        assert enable_timing
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda

    def record(self) -> None:
        self.cuda.log("record")

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.cuda.log("synchronize")

    def elapsed_time(self, end: FakeEvent) -> float:
        return 2.5


@pytest.fixture
def fake_cuda(monkeypatch):
    cuda = FakeCuda(current=5)
    monkeypatch.setattr(torch.cuda, "set_device", cuda.set_device)
    monkeypatch.setattr(torch.cuda, "current_device", cuda.current_device)
    monkeypatch.setattr(torch.cuda, "Event", cuda.event)
    return cuda


@pytest.mark.parametrize("given", [None, 2])
def test_the_writer_sets_the_ranks_device_before_its_first_event_sync(tmp_path, fake_cuda, given):
    """Default: the device current where the recorder was made (start-up's `set_device`)."""
    r = SpanRecorder(
        trace_path(tmp_path, 1), {"rank": 1}, device_type="cuda", device_index=given, flush_s=0.01
    )
    old = spans.activate(r)
    try:
        with spans.span("forward"):
            pass
        r.close()
    finally:
        spans.activate(old)
    writer = [(call, arg) for thread, call, arg in fake_cuda.calls if thread == "depthscale-spans"]
    syncs = [i for i, (call, _) in enumerate(writer) if call == "synchronize"]
    assert syncs, fake_cuda.calls  # the writer resolved the span's events...
    assert writer[0] == ("set_device", 2 if given is not None else 5)  # ...on the rank's GPU
    assert all(call != "set_device" for call, _ in writer[1:])  # once, not per flush
    records = [json.loads(x) for x in trace_path(tmp_path, 1).read_text().splitlines()[1:]]
    assert [(x["name"], x["dur"]) for x in records] == [("forward", 2_500_000)]


def test_a_cpu_recorder_never_touches_cuda(tmp_path, fake_cuda):
    r = SpanRecorder(trace_path(tmp_path, 0), {"rank": 0}, flush_s=0.01)
    old = spans.activate(r)
    try:
        with spans.span("forward"):
            pass
        r.close()
    finally:
        spans.activate(old)
    assert r.device_index is None and fake_cuda.calls == []
