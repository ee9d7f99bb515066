"""Recovery from memory (train/snapshot.py, resilience/keeper.py), drilled with real signals on a
supervised job: each restart names the tier that served every rank, and a recovered run has the
losses and final parameters of an uninterrupted one, bit for bit.

Snapshots every 3 steps; `checkpoint.every 100` leaves the disk tier empty until the run's end
unless a drill says otherwise. A version is committed once every rank's part is written and
hashed, and training waits for it at the end of the step after it: the steps lost are at most
snapshot_every. One node here; the other drills run as two nodes (test_snapshot_nodes.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from supervised import assert_same_run, events, train

from depthscale.resilience.keeper import drop, snapshot_dir

pytestmark = [pytest.mark.dist, pytest.mark.slow]

EVERY = 3
DP2 = ["--nproc", "2", "--parallel.dp_shard", "2", "--resilience.diagnose", "false"]
SNAP = [*DP2, "--checkpoint.snapshot_every", str(EVERY), "--checkpoint.every", "100"]


@pytest.fixture(autouse=True)
def _free_memory(tmp_path):
    """A drill that fails leaves nothing in /dev/shm."""
    yield
    drop(snapshot_dir(tmp_path / "run"))


@pytest.fixture
def reference(reference_run):
    """DP2 uninterrupted, without snapshots (snapshot_every is 0 by default): the run the other
    fault drills compare with too (tests/faults/conftest.py)."""
    return reference_run(*DP2)


def _restored(run: Path) -> tuple[dict, dict]:
    """The one restart's log record and its per-rank restore records."""
    (restart,) = events(run, "restart_time")
    return restart, restart["restore"]


def _gone(run: Path) -> None:
    """The job ended well: its keeper freed the memory."""
    assert not snapshot_dir(run).exists(), sorted(os.listdir(snapshot_dir(run)))


def test_sigkill_a_worker_restores_from_its_node_memory(tmp_path, reference):
    run = tmp_path / "run"
    proc = train(run, *SNAP, "--faults", "kill@1:11")
    assert proc.returncode == 0, proc.stderr[-4000:]
    restart, ranks = _restored(run)
    assert {r["tier"] for r in ranks.values()} == {"memory"}, restart["text"]
    (step,) = {r["step"] for r in ranks.values()}
    assert step == 9 and 10 - step <= EVERY, restart["text"]  # 10 steps done when killed
    assert "restored from memory step" in restart["text"] and "MB read" in restart["text"]
    assert all(r["bytes"] > 0 and not r["failed"] for r in ranks.values())
    assert_same_run(run, reference)
    _gone(run)
