"""Start-up and heartbeat limits that scale: a start is hung when it stops advancing, not when it is
long (16 compilations of 100 s each pass under a 300 s limit); heartbeats slow down as the world
grows, and the watch's limits follow the period each record carries."""

from __future__ import annotations

import json

import pytest
from watch_fakes import FakeGroup, FakeStore

from depthscale.config.schema import ResilienceConfig
from depthscale.resilience import compile_watch
from depthscale.resilience.heartbeat import BEATS_PER_S, beat_period
from depthscale.resilience.startup_watch import StartupProgress, start_phases
from depthscale.resilience.watch import SILENT_FLOOR_S, Watch


class _Ranks:
    """Two ranks' heartbeats, written as their workers would."""

    def __init__(self, store: FakeStore, period: float = 0.25) -> None:
        self.store, self.seq, self.period = store, 0, period
        self.hb = {
            r: {"marks": {}, "progress": 0, "compiles": 0, "compiling": False} for r in (0, 1)
        }

    def beat(self, changes: dict | None = None) -> None:
        self.seq += 1
        for rank, hb in self.hb.items():
            hb.update((changes or {}).get(rank, {}))
            record = {**hb, "seq": self.seq, "period": self.period}
            self.store.kv[f"hb/0/{rank}"] = json.dumps(record)


def _watch(startup_timeout_s: float = 300.0, heartbeat_s: float = 0.25) -> tuple[Watch, FakeStore]:
    store = FakeStore()
    r = ResilienceConfig(startup_timeout_s=startup_timeout_s, heartbeat_s=heartbeat_s)
    watch = Watch(FakeGroup(2), store, 0, r, ["n0", "n0"])
    for rank in watch.ranks:
        rank.exit = None
    return watch, store


def test_a_cold_start_that_compiles_for_half_an_hour_is_not_hung():
    """Data, mesh, model, then 16 compilations of 100 s each inside the first step: 1,700 s in all
    under a 300 s limit. The old rule (first step within startup_timeout_s of the launch) called
    it hung at 300 s, restarted it three times and gave up."""
    watch, store = _watch()
    ranks = _Ranks(store)
    t0 = watch.launched
    now = t0
    ranks.beat()
    for mark in ("imports", "process_group", "mesh", "data", "model", "checkpoint_load"):
        now += 20.0
        ranks.beat({r: {"marks": {**ranks.hb[r]["marks"], mark: now}} for r in (0, 1)})
        assert watch._read_and_judge(now, None) is None, mark
    for compile_ in range(16):  # each block's compilation: begins, 100 s, ends
        ranks.beat({r: {"compiling": True} for r in (0, 1)})
        assert watch._read_and_judge(now, None) is None
        now += 100.0
        ranks.beat({r: {"compiling": False, "compiles": compile_ + 1} for r in (0, 1)})
        assert watch._read_and_judge(now, None) is None, compile_
    assert now - t0 > 5 * watch.r.startup_timeout_s


def test_a_start_that_stops_advancing_is_hung_and_the_laggard_named():
    """Rank 1 stops after its data; rank 0 goes on to build its model, then waits in the first
    step's collective. Alive (heartbeats go on) but no start-up progress anywhere: hung once the
    limit has passed since the group's last advance, and the culprit is rank 1."""
    watch, store = _watch(startup_timeout_s=60.0)
    ranks = _Ranks(store)
    now = watch.launched + 1.0
    ranks.beat({r: {"marks": {"imports": now, "data": now}} for r in (0, 1)})
    watch._read_and_judge(now, None)
    now += 5.0
    ranks.beat({0: {"marks": {"imports": 1.0, "data": 1.0, "model": now}, "progress": 3}})
    assert watch._read_and_judge(now, None) is None
    last_advance = now
    while now - last_advance < 100.0:  # both keep beating, neither advances
        now += 10.0
        ranks.beat()
        fault = watch._read_and_judge(now, None)
        if fault is not None:
            break
    assert now - last_advance == 70.0  # the first poll past the 60 s limit
    assert fault is not None and fault.kind == "hung" and fault.ranks == [1], fault
    assert "start-up made no progress for 70.00 s (limit 60 s" in fault.detail
    assert fault.detail.endswith("its last phase done: data")


def test_startup_progress_waits_for_every_starting_rank():
    """A rank waiting for its node's leader (who trains the tokenizer) does not advance; the
    group is not stalled while the leader does."""
    progress = StartupProgress(2, launched=0.0)
    progress.observe(0, {"marks": {"data": 1.0}}, 250.0)  # the leader, still advancing
    progress.observe(1, {"marks": {}}, 1.0)
    assert progress.stalled([0, 1], 400.0, 300.0) is None
    assert progress.stalled([0, 1], 551.0, 300.0) == (1, 250.0)
    assert progress.stalled([], 10_000.0, 300.0) is None


def test_start_phases_are_the_slowest_ranks():
    marks = [{"imports": 3.0, "data": 5.0}, {"imports": 4.0, "data": 4.5}]
    phases, at = start_phases(marks, [1.0, None], launched=0.5)
    assert phases == {"launch": 0.5, "imports": 3.0, "data": 1.0} and at["data"] == 5.0


@pytest.mark.parametrize("world", [1, 8, 64, 512, 4096])
def test_heartbeats_slow_down_as_the_world_grows(world):
    """Beats into the one store stay under BEATS_PER_S whatever the world; a small group beats at
    the configured period."""
    period = beat_period(0.25, world)
    assert world / period <= BEATS_PER_S
    assert period == (0.25 if world <= 64 else world / BEATS_PER_S)
    assert beat_period(5.0, world) >= 5.0  # never faster than configured


def test_the_silent_limit_and_the_reads_follow_the_records_period():
    """At 512 ranks a worker beats every 2 s: 5 s without a new beat is not silence (the old
    limit, 4 × heartbeat_s, called it dead after 1.5 s); 9 s is. The heartbeats are read every
    quarter period, not at every 50 ms poll."""
    watch, store = _watch()
    period = beat_period(0.25, 512)
    ranks = _Ranks(store, period=period)
    now = watch.launched
    ranks.beat({r: {"marks": {"first_step": 1.0}} for r in (0, 1)})
    watch._read_and_judge(now, None)
    gets = store.gets
    for dt in (0.05, 0.1, 0.15):  # polls within a quarter period: no reads
        watch._read_and_judge(now + dt, None)
    assert store.gets == gets
    assert max(4 * period, SILENT_FLOOR_S) == 8.0
    assert watch._read_and_judge(now + 5.0, None) is None
    fault = watch._read_and_judge(now + 9.0, None)
    assert fault is not None and "heartbeat silent for 9.00 s (limit 8.00 s" in fault.detail


def test_compilations_are_counted_from_dynamos_callbacks():
    """The heartbeat's `compiles`/`compiling` come from dynamo's callbacks, registered once dynamo
    is loaded (never loaded by the counter itself); a compiled function's first call is one
    compilation, under way while it runs. Pins the private `torch._dynamo.callback_handler`
    (torch 2.11-2.13)."""
    import torch
    import torch._dynamo

    counter = compile_watch.CompileCounter()
    assert counter.install() and counter.install()  # once
    handler = torch._dynamo.callback_handler
    during = []
    handler.register_start_callback(lambda *args: during.append(counter.snapshot()))
    try:
        fn = torch.compile(lambda x: x * 2 + 1, backend="eager")
        assert counter.snapshot() == {"compiles": 0, "compiling": False}
        fn(torch.ones(3))
        fn(torch.ones(3))  # cached: no compilation
        assert during == [{"compiles": 0, "compiling": True}]
        assert counter.snapshot() == {"compiles": 1, "compiling": False}
    finally:
        handler.remove_start_callback(handler.start_callbacks[-1])
        handler.remove_start_callback(counter._start)
        handler.remove_end_callback(counter._end)
