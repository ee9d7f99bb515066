"""Recovery from memory across nodes, drilled on one host as two nodes (two supervisors, one rank
each, as the multi-node drills run): each node's snapshots live in its own memory, and its keeper
copies each one to the other node's keeper (the buddy replica, resilience/replica.py). Faults are
real signals and real damage to the files; each recovered run has the losses and final parameters
of an uninterrupted one, bit for bit, and loses at most `snapshot_every` steps.

A window for the test to act in: rank 1 turns 100x slower from step 10 (`slow@1:100:10`, only
time, no fault), and the test strikes once both nodes' snapshot of step 9 is copied to the other
node."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from supervised import assert_same_run, events, kill_node, losses, node_events, start_nodes, train

from depthscale.resilience.keeper import drop, snapshot_dir
from depthscale.resilience.replica import replica_root, replicated_step

pytestmark = [pytest.mark.dist, pytest.mark.slow]

EVERY = 3
SNAP = [
    "--resilience.diagnose", "false", "--resilience.slow_steps", "1000",
    "--checkpoint.snapshot_every", str(EVERY), "--checkpoint.every", "100",
]  # fmt: skip
NODES = ["--nproc", "1", "--parallel.dp_shard", "2", *SNAP]
WINDOW = ["--faults", "slow@1:100:10"]
STEP = "step_00000009"
PART = "__1_0.distcp"
"""Node 1's part of a version: the DCP shard file of its one rank."""


@pytest.fixture(autouse=True)
def _free_memory(tmp_path):
    """Whatever a drill leaves in /dev/shm (a node that gave up keeps its snapshots for a
    requeue that, in a test, never comes) goes with it."""
    yield
    for node in (0, 1):
        drop(snapshot_dir(tmp_path / "run", node))


@pytest.fixture
def reference(reference_run):
    """The same two ranks on one node, uninterrupted (tests/faults/conftest.py's shared run)."""
    return reference_run("--nproc", "2", "--parallel.dp_shard", "2", "--resilience.diagnose", "false")


def own(run: Path, node: int) -> Path:
    return snapshot_dir(run, node) / STEP


def copy(run: Path, of: int, on: int) -> Path:
    return replica_root(snapshot_dir(run, on)) / f"node{of}" / STEP


def _windowed(run: Path, *args: str) -> list:
    """The job, returned once each node's snapshot 9 is in place on the other node too."""
    procs = start_nodes(run, 2, *NODES, *args, steps=12)
    _until(lambda: copy(run, 1, 0).is_dir() and copy(run, 0, 1).is_dir(), procs)
    return procs


def _finish(procs: list, codes=(0, 0), outs: str = "stdout") -> list:
    """Each node's stdout (the workers' console; the supervisor's own lines are on stderr), or
    (stdout, stderr) with outs="both", once it exited with its code."""
    done = []
    try:
        for proc, code in zip(procs, codes):
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == code, err[-4000:]
            done.append((out, err) if outs == "both" else out)
    finally:
        _end(procs)
    return done


def _end(procs: list) -> None:
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def _worker(run: Path, node: int) -> int:
    (pid,) = node_events(run, node, "launch")[-1]["pids"].values()
    return int(pid)


def _restore(run: Path, node: int, event: str = "restart_time") -> dict:
    (record,) = node_events(run, node, event)[-1]["restore"].values()
    return record


def _memory_freed(run: Path) -> None:
    for node in (0, 1):
        root = snapshot_dir(run, node)
        assert not root.exists() and not replica_root(root).exists(), node


def test_sigkill_a_worker_restores_each_node_from_its_own_memory(tmp_path, reference):
    run = tmp_path / "run"
    procs = _windowed(run, *WINDOW)
    os.kill(_worker(run, 1), signal.SIGKILL)
    _finish(procs)
    for node in (0, 1):
        record = _restore(run, node)
        assert (record["tier"], record["step"], record["served_by"]) == ("memory", 9, node)
        assert not record["failed"]
    assert_same_run(run, reference)
    _memory_freed(run)


def test_a_node_lost_whole_is_restored_from_its_buddy_copy(tmp_path, reference):
    run = tmp_path / "run"
    procs = _windowed(run, *WINDOW)
    # node 1 loses power: its supervisor, workers and keeper die at once, its memory with them
    kill_node(procs[1], run, 1)
    _kill_keeper(snapshot_dir(run, 1))
    shutil.rmtree(snapshot_dir(run, 1))
    shutil.rmtree(replica_root(snapshot_dir(run, 1)))
    _finish(procs, codes=(75, -signal.SIGKILL))  # node 0 gives up: the scheduler requeues
    assert own(run, 0).is_dir() and copy(run, 1, 0).is_dir()  # node 0's keeper kept both
    # the requeued job: node 0 as before, node 1 a replacement with empty memory
    _finish(start_nodes(run, 2, *NODES, steps=12))
    record = _restore(run, 0, "start_time")
    assert (record["tier"], record["step"], record["served_by"]) == ("memory", 9, 0), record
    record = _restore(run, 1, "start_time")
    assert (record["tier"], record["step"], record["served_by"]) == ("replica", 9, 0), record
    assert_same_run(run, reference)
    _memory_freed(run)


def test_a_corrupt_snapshot_is_restored_from_the_buddy_copy_named_once(tmp_path, reference):
    run = tmp_path / "run"
    procs = _windowed(run, *WINDOW)
    _flip(own(run, 1) / PART)
    os.kill(_worker(run, 1), signal.SIGKILL)
    out0, _ = _finish(procs)
    record = _restore(run, 1)
    assert (record["tier"], record["step"], record["served_by"]) == ("replica", 9, 0), record
    (line,) = record["failed"]
    assert f"snapshot {STEP} in the memory of node 1 failed verification: {PART} is corrupt" in line
    said = [ln for ln in out0.splitlines() if "failed verification" in ln]
    assert len(said) == 1 and f"restoring from snapshot {STEP}" in said[0], said
    assert _restore(run, 0)["tier"] == "memory"
    assert_same_run(run, reference)


def test_both_copies_corrupt_fall_through_to_disk_named(tmp_path, reference):
    run = tmp_path / "run"
    procs = _windowed(run, *WINDOW, "--checkpoint.every", "4")
    _flip(own(run, 1) / PART)
    _flip(copy(run, 1, 0) / PART)
    os.kill(_worker(run, 1), signal.SIGKILL)
    out0, _ = _finish(procs)
    for node in (0, 1):
        record = _restore(run, node)
        assert (record["tier"], record["step"]) == ("disk", 8), record
    failed = _restore(run, 0)["failed"]
    assert len(failed) == 2 and "the copy of node 1's snapshot" in failed[1], failed
    said = [ln for ln in out0.splitlines() if "failed verification" in ln]
    assert len(said) == 1 and "restoring from the next tier (checkpoint step_00000008" in said[0]
    assert_same_run(run, reference)


def test_sigkill_during_a_snapshot_restores_the_previous_version(tmp_path, reference):
    run = tmp_path / "run"
    # the snapshot of step 6 is written but not yet committed (30 s more) when rank 1 dies at
    # the start of step 7: 6 steps were done, 3 are lost
    _finish(start_nodes(run, 2, *NODES, "--faults", "slowsave@6:30,kill@1:7", steps=12))
    for node in (0, 1):
        record = _restore(run, node)
        assert (record["tier"], record["step"], record["served_by"]) == ("memory", 3, node)
    assert_same_run(run, reference)


def test_the_keeper_killed_alone_is_replaced_and_snapshots_and_copies_go_on(tmp_path):
    run = tmp_path / "run"
    procs = start_nodes(run, 2, *NODES, "--faults", "slow@1:4:1", steps=30)
    root = snapshot_dir(run, 1)
    try:
        _until(lambda: (replicated_step(root) or 0) >= 3, procs)  # node 1's copies are going
        killed_after = max(int(p.name[5:]) for p in root.glob("step_*[0-9]"))
        assert _kill_keeper(root)
        # its replacement serves on the same port and pushes again: a newer copy goes in
        _until(lambda: (replicated_step(root) or 0) > killed_after, procs)
        _, err1 = _finish(procs, outs="both")[1]
    finally:
        _end(procs)
    (warning,) = [ln for ln in err1.splitlines() if "snapshot keeper" in ln]
    assert "was killed by SIGKILL; started another" in warning
    assert not node_events(run, 0, "fault") and not node_events(run, 1, "fault")
    _memory_freed(run)


def test_fewer_nodes_restore_from_memory_resharded(tmp_path, reference):
    run = tmp_path / "run"
    # two nodes give up at their first fault (exit 75): the keepers keep their snapshots, node
    # 1's copy included, for the requeued job, which runs on node 0 alone at dp_shard 1
    _finish(
        start_nodes(run, 2, *NODES, "--faults", "kill@1:11", "--resilience.max_restarts", "0"),
        codes=(75, 75),
    )
    assert own(run, 0).is_dir() and copy(run, 1, 0).is_dir()
    proc = train(run, "--nproc", "1", "--resilience.supervise", "true", *SNAP)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (record,) = events(run, "start_time")[-1]["restore"].values()
    assert (record["tier"], record["step"]) == ("memory", 9), record
    assert record["parts"] == {"0": ["memory", 0], "1": ["replica", 0]}  # node 1's: the copy
    assert "node 1's part from its copy on node 0" in events(run, "start_time")[-1]["text"]
    # resharded: the steps after it match the dp_shard=2 reference to fp32 rounding (the sums
    # run in another order; bitwise equality is for the same layout)
    got, want = losses(run), losses(reference)
    for step in range(10, 13):
        assert abs(got[step] - want[step]) < 1e-4 * abs(want[step]), (step, got[step], want[step])
    assert not snapshot_dir(run, 0).exists()


def _until(cond, procs: list, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            _end(procs)
            pytest.fail(f"never happened: {[p.communicate() for p in procs]}")
        time.sleep(0.05)


def _kill_keeper(root: Path) -> bool:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"depthscale.resilience.keeper" in cmd and str(root).encode() in cmd:
                os.kill(int(pid), signal.SIGKILL)
                return True
    return False


def _flip(file: Path) -> None:
    """Flip one byte in the middle of `file` (memory going bad under a snapshot)."""
    with open(file, "r+b") as fh:
        fh.seek(file.stat().st_size // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0xFF]))
