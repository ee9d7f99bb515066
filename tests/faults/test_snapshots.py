"""Recovery from memory (train/snapshot.py, resilience/keeper.py), drilled with real signals on a
supervised job: each restart names the tier that served every rank, and a recovered run has the
losses and final parameters of an uninterrupted one, bit for bit.

Snapshots every 3 steps; `checkpoint.every 100` leaves the disk tier empty until the run's end
unless a drill says otherwise. A version is committed once every rank's part is written and
hashed, and training waits for it at the end of the step after it: the steps lost are at most
snapshot_every. The drills of several nodes (a buddy's copy) are in test_snapshot_nodes.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from supervised import CONFIG, TINY, assert_same_run, events, losses, train

from depthscale.resilience.keeper import snapshot_dir

pytestmark = [pytest.mark.dist, pytest.mark.slow]

EVERY = 3
DP2 = ["--nproc", "2", "--parallel.dp_shard", "2", "--resilience.diagnose", "false"]
SNAP = [*DP2, "--checkpoint.snapshot_every", str(EVERY), "--checkpoint.every", "100"]


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


def test_a_corrupted_snapshot_falls_through_to_disk_named_once(tmp_path, reference):
    run = tmp_path / "run"
    # snapshot 9 damaged in memory once written; the disk holds step 8; a worker dies at 11
    proc = train(run, *SNAP, "--checkpoint.every", "4", "--faults", "corrupt@9,kill@1:11")
    assert proc.returncode == 0, proc.stderr[-4000:]
    restart, ranks = _restored(run)
    assert {(r["tier"], r["step"]) for r in ranks.values()} == {("disk", 8)}, restart["text"]
    assert "failed verification: snapshot step_00000009 in the memory of node 0" in restart["text"]
    said = [ln for ln in proc.stdout.splitlines() if "failed verification" in ln]
    assert (
        len(said) == 1
        and "restoring from the next tier (checkpoint step_00000008 on disk)" in said[0]
    )
    assert len(events(run, "fault")) == 1  # no restart loop
    assert_same_run(run, reference)


def test_sigkill_during_a_snapshot_restores_the_previous_version(tmp_path, reference):
    run = tmp_path / "run"
    # the snapshot of step 6 is written but not yet committed (30 s more) when rank 1 dies at
    # the start of step 7: 6 steps were done, 3 are lost
    proc = train(run, *SNAP, "--faults", "slowsave@6:30,kill@1:7")
    assert proc.returncode == 0, proc.stderr[-4000:]
    restart, ranks = _restored(run)
    assert {(r["tier"], r["step"]) for r in ranks.values()} == {("memory", 3)}, restart["text"]
    assert_same_run(run, reference)


def _job(run: Path, *args: str, steps: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "depthscale.cli", "train", "-c", CONFIG, *TINY,
         "--train.steps", str(steps), "--train.run_dir", str(run), *args],
        cwd=run.parent, env=dict(os.environ, PYTHONWARNINGS="ignore"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _keeper_pid(root: Path) -> int | None:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"depthscale.resilience.keeper" in cmd and str(root).encode() in cmd:
                return int(pid)
    return None


def _snapshots(run: Path) -> list[int]:
    if not (run / "metrics.jsonl").exists():
        return []
    records = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return [r["step"] for r in records if r.get("split") == "snapshot"]


def test_the_keeper_killed_alone_is_replaced_and_training_goes_on(tmp_path):
    run = tmp_path / "run"
    run.parent.mkdir(parents=True, exist_ok=True)
    root = snapshot_dir(run)
    job = _job(run, *SNAP, steps=40)
    try:
        deadline = time.monotonic() + 300
        while not _snapshots(run):  # a snapshot was written: the keeper's memory is in use
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.1)
        killed_after = max(_snapshots(run))
        pid = _keeper_pid(root)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        out, err = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, err[-3000:]
    (warning,) = [ln for ln in err.splitlines() if "snapshot keeper" in ln]
    assert f"(pid {pid}) was killed by SIGKILL; started another" in warning
    assert not events(run, "fault")  # training was never stopped
    assert max(_snapshots(run)) > killed_after  # snapshots went on
    assert not root.exists()  # the replacement freed the memory at the end


def test_restart_at_another_dp_shard_reshards_from_memory(tmp_path, reference):
    run = tmp_path / "run"
    # dp_shard 2 gives up at its first fault (exit 75): the keeper keeps the snapshots for the
    # requeued job, here at dp_shard 1
    first = train(run, *SNAP, "--faults", "kill@1:11", "--resilience.max_restarts", "0")
    assert first.returncode == 75, first.stderr[-3000:]
    assert snapshot_dir(run).is_dir()
    proc = train(
        run, "--nproc", "1", "--resilience.supervise", "true", "--checkpoint.every", "100",
        "--checkpoint.snapshot_every", str(EVERY),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    starts = events(run, "start_time")
    record = starts[-1]["restore"]["0"]
    assert record["tier"] == "memory" and record["step"] in (6, 9), starts[-1]["text"]
    # resharded: the steps after it match the dp_shard=2 reference to fp32 rounding (the sums
    # run in another order; bitwise equality is for the same layout)
    got, want = losses(run), losses(reference)
    for step in range(record["step"] + 1, 13):
        assert abs(got[step] - want[step]) < 1e-4 * abs(want[step]), (step, got[step], want[step])
    _gone(run)
