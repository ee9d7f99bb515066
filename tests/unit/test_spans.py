"""The span recorder: what it writes, that it never makes training wait, and the hang dump."""

from __future__ import annotations

import json
import threading
import time

import pytest

from depthscale.observe import spans
from depthscale.observe.spans import SpanRecorder, clock_skew_ns, trace_path
from depthscale.observe.watchdog import Watchdog, hang_path, write_hang_dump


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def recorder(tmp_path):
    r = SpanRecorder(trace_path(tmp_path, 3), {"rank": 3, "world": 4, "coords": {"pp": 1}})
    old = spans.activate(r)
    yield r
    spans.activate(old)
    r.close()


def test_spans_nest_and_are_written_after_the_meta_line(recorder, tmp_path):
    spans.set_step(7)
    with spans.span("step", "step"):
        with spans.span("forward", mb=2):
            sum(range(10_000))
        op = spans.begin("send", "pp", peer=1, label="step 7: F2 0>1", bytes=64)
        spans.end(op)
    recorder.close()
    meta, *records = _lines(trace_path(tmp_path, 3))
    assert meta == {"kind": "meta", "rank": 3, "world": 4, "coords": {"pp": 1}}
    by_name = {r["name"]: r for r in records}
    assert set(by_name) == {"step", "forward", "send"}
    fwd, step, send = by_name["forward"], by_name["step"], by_name["send"]
    assert fwd["args"] == {"mb": 2} and fwd["step"] == 7 and fwd["cat"] == "compute"
    assert send["args"] == {"peer": 1, "label": "step 7: F2 0>1", "bytes": 64}
    assert step["ts"] <= fwd["ts"] and fwd["ts"] + fwd["dur"] <= step["ts"] + step["dur"]
    assert all(r["dur"] >= 0 for r in records)


def test_nothing_is_recorded_without_a_recorder(tmp_path):
    assert spans.active() is None
    with spans.span("forward") as s:  # a shared no-op object: no allocation per call
        pass
    assert spans.span("backward") is s
    assert spans.begin("send", "pp") is None
    spans.end(None)


def test_busy_counts_cpu_time_not_waiting(recorder):
    """A rank blocked on a peer (here: sleeping) is not busy; a rank computing is."""
    with spans.span("forward"):
        time.sleep(0.05)
    with spans.span("backward"):  # 40 ms of this thread's CPU, however long a loaded machine takes
        t = time.thread_time()
        while time.thread_time() - t < 0.04:
            pass
    with spans.span("data"):  # waiting for a batch is the rank's own time: wall clock
        time.sleep(0.02)
    busy = recorder.take_busy()
    assert busy["forward"] < 10e6  # < 10 ms of the 50 ms sleep
    assert busy["backward"] >= 40e6
    assert busy["data"] >= 20e6
    assert recorder.take_busy() == dict.fromkeys(spans.BUSY_PHASES, 0)


def test_a_stalled_writer_drops_and_counts_never_blocks(tmp_path):
    r = SpanRecorder(trace_path(tmp_path, 0), {"rank": 0}, queue_size=8)
    gate = threading.Event()
    r._write = lambda text, write=r._write: (gate.wait(), write(text))  # a disk that stalls
    t0 = time.perf_counter()
    for i in range(1000):
        r.put({"kind": "span", "name": "x", "i": i})
    assert time.perf_counter() - t0 < 0.5  # 1000 puts never waited for the stalled writer
    assert r.dropped >= 1000 - 8 - 1
    gate.set()
    r.close()
    records = _lines(trace_path(tmp_path, 0))
    assert records[-1] == {"kind": "dropped", "n": r.dropped}
    assert len(records) - 2 == 1000 - r.dropped  # meta and the drop count besides the kept ones


def test_clock_skew_spec(monkeypatch):
    monkeypatch.setenv(spans.SKEW_ENV, "1:50, 2:-50.5")
    assert (clock_skew_ns(1), clock_skew_ns(2), clock_skew_ns(0)) == (50_000_000, -50_500_000, 0)
    monkeypatch.setenv(spans.SKEW_ENV, "1=50")
    with pytest.raises(ValueError, match="RANK:MS"):
        clock_skew_ns(1)


def test_hang_dump_names_the_in_flight_op_and_stacks(recorder, tmp_path):
    spans.set_step(4)
    outer = spans.begin("backward")
    op = spans.begin("all_reduce", "collective", group="0,1,2,3", seq=9, bytes=16)
    path = write_hang_dump(tmp_path, recorder, "timeout", "RuntimeError('timed out')")
    dump = json.loads(path.read_text())
    assert path == hang_path(tmp_path, 3)
    assert [o["name"] for o in dump["in_flight"]] == ["backward", "all_reduce"]
    assert dump["in_flight"][1]["args"] == {"group": "0,1,2,3", "seq": 9, "bytes": 16}
    assert dump["rank"] == 3 and dump["step"] == 4 and dump["reason"] == "timeout"
    assert "test_hang_dump_names_the_in_flight_op_and_stacks" in dump["stacks"]
    spans.end(op)
    spans.end(outer)


def test_watchdog_dumps_a_stalled_rank_once(recorder, tmp_path):
    dog = Watchdog(tmp_path, recorder, timeout_s=0.2)
    try:
        spans.end(spans.begin("forward"))  # progress
        stuck = spans.begin("recv", "pp", peer=0, label="step 1: B0 1>0")
        deadline = time.monotonic() + 10
        while dog.dumped is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert dog.dumped == hang_path(tmp_path, 3)
        dump = json.loads(dog.dumped.read_text())
        assert dump["reason"] == "watchdog"
        assert dump["in_flight"][-1]["args"]["label"] == "step 1: B0 1>0"
        spans.end(stuck)
    finally:
        dog.close()


def test_an_error_dump_keeps_the_watchdogs_flight_recorder_state(recorder, tmp_path, monkeypatch):
    """The collective that timed out is retired by the time the error is handled: the dump written
    then keeps what the recorder showed pending while the rank was still blocked."""
    from depthscale.observe import flight_recorder

    pending = {"groups": {"3": {"ranks": [0, 1], "desc": "d", "enqueued": 5}},
               "in_flight": [{"group": "3", "seq": 5, "op": "all_reduce"}]}  # fmt: skip
    monkeypatch.setattr(flight_recorder, "snapshot", lambda: pending)
    write_hang_dump(tmp_path, recorder, "watchdog")
    monkeypatch.setattr(flight_recorder, "snapshot", lambda: {**pending, "in_flight": []})
    path = write_hang_dump(tmp_path, recorder, "error", "DistBackendError('timed out')")
    dump = json.loads(path.read_text())
    assert dump["reason"] == "error" and dump["flight_recorder"] == {**pending, "taken": "watchdog"}
