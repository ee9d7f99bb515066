"""The supervisor's pure parts: the --faults grammar, which faults fire in which attempt, the
node pool and its exclusion list, the data positions a NaN guard skips, and the heartbeat's view of
a main thread blocked in torch.distributed."""

from __future__ import annotations

import json
import sys
import threading
import time

import numpy as np
import pytest
from watch_fakes import FakeGroup, FakeStore

from depthscale.config.schema import ResilienceConfig
from depthscale.data.loader import PackedBatches
from depthscale.errors import CheckpointError, ConfigError
from depthscale.resilience.faults import (
    Fault,
    FaultPlan,
    bad_diag_nodes,
    check_ranks,
    parse_faults,
)
from depthscale.resilience.heartbeat import main_thread_blocked_in
from depthscale.resilience.nodes import NodePool
from depthscale.resilience.watch import Watch
from depthscale.train.nan_guard import SKIPPED, read_skipped, record_skipped


def test_fault_grammar_round_trips():
    spec = "kill@1:5,stop@0:3,hang@2:4:7.5,crash@0:2,nan@1:6,badbatch@0:7,slow@3:2.5:4,enospc@8,corrupt@4,slowsave@4:2.5,slowsave@6,baddiag@h/n1,kill@1:9*"
    faults = parse_faults(spec)
    assert [str(f) for f in faults] == spec.split(",")
    assert faults[2] == Fault("hang", 2, 4, 7.5)
    assert faults[6] == Fault("slow", 3, 4, 2.5)
    assert faults[-1].every_attempt


@pytest.mark.parametrize(
    "bad",
    ["boom@1:2", "kill@1", "kill@-1:2", "kill@1:0", "slow@1:0.5", "enospc@1:2", "hang@1:2:0",
     "nan@1:2:3", "baddiag@", "kill1:2", "kill@a:b", "slowsave@2:0", "corrupt@2:1"],
)  # fmt: skip
def test_bad_fault_specs_are_named(bad):
    with pytest.raises(ConfigError, match="is not a fault; allowed: kill@R:S"):
        parse_faults(f"kill@0:1,{bad}")


def test_a_fault_for_a_missing_rank_is_refused():
    with pytest.raises(ConfigError, match="names rank 4, but the run has 4 rank"):
        check_ranks(parse_faults("kill@4:2"), 4)


def test_faults_fire_in_the_first_attempt_unless_starred():
    faults = parse_faults("kill@1:5,crash@1:6*,nan@0:3")
    assert [f.kind for f in FaultPlan(faults, rank=1, this_attempt=0).faults] == ["kill", "crash"]
    assert [f.kind for f in FaultPlan(faults, rank=1, this_attempt=1).faults] == ["crash"]
    assert not FaultPlan(faults, rank=2, this_attempt=0)
    assert bad_diag_nodes(parse_faults("baddiag@a,baddiag@b*"), 0) == ["a", "b"]
    assert bad_diag_nodes(parse_faults("baddiag@a,baddiag@b*"), 1) == ["b"]


def test_nan_is_transient_once_and_a_bad_batch_follows_its_data():
    plan = FaultPlan(parse_faults("nan@0:3,badbatch@0:5"), rank=0, this_attempt=0)
    assert plan.poison_loss(3, (0, 16)) and not plan.poison_loss(3, (0, 16))  # the replay is clean
    assert plan.poison_loss(5, (0, 32)) and plan.poison_loss(5, (0, 32))  # the replay is not
    assert not plan.poison_loss(5, (0, 40))  # step 5 after the rollback: another batch
    assert plan.poison_loss(9, (0, 32))  # that batch, wherever it comes back


def test_node_pool_excludes_for_good(tmp_path):
    pool = NodePool(tmp_path, "host", needed=2, spares=1)
    assert pool.active() == ["host/n0", "host/n1"]
    pool.exclude("host/n1", {"why": "memcpy"})
    assert pool.active() == ["host/n0", "host/n2"]
    again = NodePool(tmp_path, "host", needed=2, spares=1)  # a new supervisor on the run dir
    assert again.excluded == ["host/n1"] and again.active() == ["host/n0", "host/n2"]
    again.exclude("host/n0", {})
    assert again.active() is None
    assert NodePool(tmp_path / "one", "host", 1, 0).active() == ["host"]


def test_a_damaged_exclusion_list_is_kept_aside(tmp_path):
    (tmp_path / "excluded_nodes.json").write_text("{not json")
    pool = NodePool(tmp_path, "host", 1, 0)
    assert pool.active() == ["host"] and (tmp_path / "excluded_nodes.damaged").is_file()


def test_skipped_batches_are_passed_over_as_if_consumed(tmp_path):
    tokens = np.arange(2000, dtype=np.int64)
    plain, skipping = PackedBatches(tokens, 8, 4, seed=1), PackedBatches(tokens, 8, 4, seed=1)
    batches = [plain.next_batch() for _ in range(4)]
    positions = [(0, 4 * i) for i in range(4)]
    record_skipped(tmp_path, 2, positions[1])
    assert json.loads((tmp_path / SKIPPED).read_text()) == [{"step": 2, "epoch": 0, "cursor": 4}]
    skipping.exclude(read_skipped(tmp_path))
    got = [skipping.next_batch() for _ in range(3)]
    for a, b in zip(got, [batches[0], batches[2], batches[3]]):
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert skipping.position == positions[3]


def test_a_damaged_skip_list_is_named(tmp_path):
    (tmp_path / SKIPPED).write_text('[{"step": 1}]')
    with pytest.raises(CheckpointError, match="skipped_batches.json is damaged"):
        read_skipped(tmp_path)


@pytest.mark.parametrize(
    ("filename", "blocked"),
    [
        ("/site-packages/torch/distributed/distributed_c10d.py", True),  # a collective
        ("/site-packages/torch/distributed/tensor/_dispatch.py", False),  # DTensor compute
        ("/work/model/layers.py", False),  # compute
    ],
)
def test_heartbeat_sees_the_main_thread_blocked_in_torch_distributed(filename, blocked):
    """The heartbeat thread reads the main thread's innermost frame: a function defined in a
    torch.distributed file (other than DTensor's op dispatch) is communication."""
    namespace: dict = {}
    source = "def wait(lock):\n    lock.acquire(timeout=10)\n"  # blocks in C, as a collective
    exec(compile(source, filename, "exec"), namespace)
    lock, seen = threading.Lock(), []
    lock.acquire()

    def observe():
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # until the main thread is inside wait()
            frame = sys._current_frames()[threading.main_thread().ident]
            if frame.f_code is namespace["wait"].__code__:
                break
            time.sleep(0.001)
        seen.append(main_thread_blocked_in())
        lock.release()

    observer = threading.Thread(target=observe)
    observer.start()
    namespace["wait"](lock)  # the main thread sits here until the observer has looked
    observer.join()
    assert (seen[0] is not None) == blocked, seen
    if blocked:
        assert seen[0].startswith("torch.distributed distributed_c10d.py:2 wait")


class _Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def log(self, event: str, text: str, **_) -> None:
        self.events.append((event, text))


def _watched(published: list[int], **heartbeat) -> tuple[Watch, FakeStore]:
    store = FakeStore()
    r = ResilienceConfig(hang_floor_s=1.5, hang_factor=2.0, long_phase_s=300.0)
    watch = Watch(FakeGroup(2), store, 0, r, ["n0", "n0"], published=lambda: published[0])
    marks = {"first_step": 1.0}
    for rank in range(2):
        hb = {"seq": 1, "progress": 10, "step": 5, "step_p99_s": 0.2, "marks": marks, **heartbeat}
        store.kv[f"hb/0/{rank}"] = json.dumps(hb)
    for rank in watch.ranks:
        rank.exit = None
    return watch, store


def _beat(store: FakeStore) -> None:
    for key, value in store.kv.items():
        hb = json.loads(value)
        store.kv[key] = json.dumps({**hb, "seq": hb["seq"] + 1})


def test_a_background_save_in_flight_is_a_long_phase_for_the_hang_limit():
    """Steps beside a background save run slower (its writer takes cores and disk): a group whose
    progress stalls 2 s while a save is in flight is not hung under a 1.5 s limit."""
    now = time.time()
    published = [0]
    watch, store = _watched(published, saving=4)
    watch._read(now - 2.0)  # progress last changed 2 s ago
    _beat(store)  # alive, no progress
    assert watch._read_and_judge(now, _Log()) is None
    assert watch._progress_limit([0, 1]) == (
        300.0,
        "a background save of step 4 in flight: long_phase_s",
    )

    published[0] = 4  # on disk: the rank's next beat will say so; the directory already does
    _beat(store)
    fault = watch._read_and_judge(now, _Log())
    assert fault is not None and fault.kind == "hung" and "limit 1.50 s" in fault.detail


def test_a_hung_group_waits_for_its_save_in_flight_and_no_longer():
    published = [0]
    watch, store = _watched(published, saving=4)
    watch._read(time.time())
    log = _Log()
    threading.Timer(0.3, lambda: published.__setitem__(0, 4)).start()
    from depthscale.resilience.watch import Fault as Found

    hung = Found("hung", [1], ["n0"], "stalled", 0.0, 0.0)
    start = time.time()
    watch.settle_saves(hung, log)
    assert 0.25 < time.time() - start < 30
    assert [e for e, _ in log.events] == ["settle", "settled"]
    assert "the save finished" in log.events[1][1]

    dead = Found("dead", [1], ["n0"], "killed by SIGKILL", 0.0, 0.0)
    published[0] = 0
    log = _Log()
    watch.settle_saves(dead, log)  # a dead rank's writer died with it: nothing to wait for
    assert log.events == []


def test_heartbeat_probes_are_read_at_every_beat_and_never_stop_it():
    from depthscale.resilience.heartbeat import Heartbeat

    beat = Heartbeat.__new__(Heartbeat)  # the record alone: no store, no thread
    beat.fields, beat.steps, beat.seq, beat._progress_without_spans = {}, [], 0, 0
    beat.probes, beat.period = {}, 0.25
    state = {"saving": 8}
    beat.probe("saving", lambda: state["saving"])
    beat.probe("broken", lambda: 1 / 0)
    assert beat.record()["saving"] == 8 and "broken" not in beat.record()
    state["saving"] = None
    assert beat.record()["saving"] is None


def test_a_later_start_keeps_the_stacks_an_earlier_fault_dumped(tmp_path):
    """Attempts are numbered from 0 in every invocation: a later start's worker (one with nothing
    to do, even) opened RUN/supervisor/attempt0/stacks/rank0.txt for writing and emptied it."""
    import os
    import subprocess

    from depthscale.resilience.heartbeat import STACKS_ENV

    dump = (
        "import os, signal, time\n"
        "from depthscale.resilience.heartbeat import _dump_stacks_on_sigusr1\n"
        "_dump_stacks_on_sigusr1()\n"
        "if os.environ.get('DUMP'):\n"
        "    os.kill(os.getpid(), signal.SIGUSR1)\n"
        "    time.sleep(0.2)\n"
    )
    env = dict(os.environ, **{STACKS_ENV: str(tmp_path), "RANK": "0"})
    for extra in ({"DUMP": "1"}, {}):
        proc = subprocess.run([sys.executable, "-c", dump], env={**env, **extra}, timeout=120)
        assert proc.returncode == 0
    text = (tmp_path / "rank0.txt").read_text()
    assert text.count("--- rank 0, pid ") == 2
    assert "most recent call first" in text.split("--- rank 0, pid ")[1]
