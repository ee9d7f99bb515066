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
from supervised import assert_same_run, kill_node, node_events, start_nodes

from depthscale.resilience.keeper import snapshot_dir
from depthscale.resilience.replica import replica_root

pytestmark = [pytest.mark.dist, pytest.mark.slow]

EVERY = 3
NODES = [
    "--nproc", "1", "--parallel.dp_shard", "2", "--resilience.diagnose", "false",
    "--checkpoint.snapshot_every", str(EVERY), "--checkpoint.every", "100",
    "--resilience.slow_steps", "1000",
]  # fmt: skip
WINDOW = ["--faults", "slow@1:100:10"]
STEP = "step_00000009"
PART = "__1_0.distcp"
"""Node 1's part of a version: the DCP shard file of its one rank."""


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
    deadline = time.monotonic() + 300
    while not (copy(run, 1, 0).is_dir() and copy(run, 0, 1).is_dir()):
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            _end(procs)
            pytest.fail(f"snapshot 9 was never copied: {[p.communicate() for p in procs]}")
        time.sleep(0.05)
    return procs


def _finish(procs: list, codes=(0, 0)) -> list[str]:
    outs = []
    try:
        for proc, code in zip(procs, codes):
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == code, err[-4000:]
            outs.append(out)  # the workers' console (the supervisor's own lines: stderr)
    finally:
        _end(procs)
    return outs


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


def _kill_keeper(root: Path) -> None:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"depthscale.resilience.keeper" in cmd and str(root).encode() in cmd:
                os.kill(int(pid), signal.SIGKILL)


def _flip(file: Path) -> None:
    """Flip one byte in the middle of `file` (memory going bad under a snapshot)."""
    with open(file, "r+b") as fh:
        fh.seek(file.stat().st_size // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0xFF]))
