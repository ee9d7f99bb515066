"""Every fault class recovers with no human action, and the result is what an uninterrupted run
(or, for a skipped batch, a run told to skip it) computes, bit for bit: transient and persistent
NaN, a NaN on one rank of several, a corrupt newest checkpoint, a slow rank, a node that fails the
diagnostics (excluded, a spare takes its place). Kill and hang are in test_supervisor.py, a full
disk in test_checkpoint_faults.py."""

from __future__ import annotations

import json
import shutil
import socket

import pytest
from supervised import assert_same_run, events, losses, train

from depthscale.train.nan_guard import SKIPPED

DP2 = ["--nproc", "2", "--parallel.dp_shard", "2", "--resilience.diagnose", "false"]


def _ok(proc) -> None:
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_transient_nan_is_replayed(tmp_path, reference_run):
    """A NaN once: no update from it, the step replayed, the run identical to a clean one."""
    run, reference = tmp_path / "run", reference_run()
    proc = train(run, "--faults", "nan@0:5")
    _ok(proc)
    assert "step 5: the replay was finite: a transient fault" in proc.stdout
    assert not (run / SKIPPED).exists()
    assert_same_run(run, reference)


def test_persistent_nan_rolls_back_and_skips_the_batch(tmp_path):
    """A batch that is NaN on every try: rolled back to the newest checkpoint, the batch recorded
    by data position and skipped; a clean run given the same skip list computes the same."""
    run, reference = tmp_path / "run", tmp_path / "reference"
    proc = train(run, "--faults", "badbatch@0:7")
    _ok(proc)
    assert "step 7: still non-finite on replay: rolling back to step_00000004" in proc.stdout
    (skipped,) = json.loads((run / SKIPPED).read_text())
    assert skipped["step"] == 7
    reference.mkdir()
    shutil.copy(run / SKIPPED, reference / SKIPPED)
    _ok(train(reference))
    assert_same_run(run, reference)
    assert len(losses(run)) == 12


@pytest.mark.dist
def test_nan_on_one_rank_stops_the_update_on_every_rank(tmp_path, reference_run):
    """Rank 1's NaN is seen by rank 0 in the same step (one collective flag): nobody updates."""
    run, reference = tmp_path / "run", reference_run(*DP2)
    proc = train(run, *DP2, "--faults", "nan@1:5")
    _ok(proc)
    assert "step 5: the replay was finite" in proc.stdout
    assert_same_run(run, reference)
    assert not events(run, "fault")  # handled inside the group: no restart


@pytest.mark.dist
@pytest.mark.slow
def test_corrupt_newest_checkpoint_falls_back(tmp_path, reference_run):
    """The checkpoint of step 8 is damaged, then a rank dies: the restart takes step 4's."""
    run, reference = tmp_path / "run", reference_run(*DP2)
    proc = train(run, *DP2, "--faults", "corrupt@8,kill@0:10")
    _ok(proc)
    assert "step_00000008" in proc.stderr and "resumed at step 4" in proc.stdout
    assert_same_run(run, reference)


@pytest.mark.slow
def test_checkpoints_damaged_after_their_save_never_cost_the_last_good_one(tmp_path):
    """keep = 2, saves at 4, 8, 12, 16; the bytes of step 8 and then of step 12 are flipped after
    each was saved and verified, then the rank is killed. Retention that trusted its save-time
    verdicts deleted step 4 at the save of 12, leaving nothing that verifies: the restart found
    no checkpoint to resume from. Re-hashing what it keeps, it keeps 4 and the run recovers."""
    run, reference = tmp_path / "run", tmp_path / "reference"
    one = ["--resilience.supervise", "true", "--resilience.diagnose", "false"]
    _ok(train(reference, *one, steps=16))
    keep = ["--checkpoint.keep", "2"]
    proc = train(run, *one, *keep, "--faults", "corrupt@8,corrupt@12,kill@0:14", steps=16)
    _ok(proc)
    assert "resumed at step 4" in proc.stdout, proc.stdout[-3000:]
    assert "no longer" in proc.stderr and "step_00000012" in proc.stderr
    assert_same_run(run, reference)


@pytest.mark.dist
@pytest.mark.slow
def test_a_hung_group_lets_its_save_in_flight_finish_before_the_restart(tmp_path):
    """The save of step 4 takes 4 s more in the background writers; rank 1 freezes (SIGSTOP) at
    step 5, found hung after 1.5 s. Stopping the group then killed the writers: step 4 was lost,
    the restart went back to step 0 (and a supervisor that counted the staged save as progress
    could not see the loop). Now the supervisor waits for the save, and resumes from it."""
    run = tmp_path / "run"
    quick = ["--resilience.hang_floor_s", "1.5", "--resilience.hang_factor", "2"]
    proc = train(run, *DP2, *quick, "--faults", "slowsave@4:4,stop@1:5")
    _ok(proc)
    (settle,) = events(run, "settle")
    assert "save of step 4 in flight" in settle["text"]
    (settled,) = events(run, "settled")
    assert "the save finished" in settled["text"] and settled["published"] == 4
    (restart,) = events(run, "restart")
    assert restart["checkpoint_step"] == 4
    assert "resumed at step 4" in proc.stdout


@pytest.mark.dist
@pytest.mark.slow
def test_slow_rank_is_restarted(tmp_path):
    """A rank 3× slower than its peers for resilience.slow_steps steps: forensics, restart."""
    run, reference = tmp_path / "run", tmp_path / "reference"
    extra = ["--checkpoint.every", "5"]
    _ok(train(reference, *DP2, *extra, steps=40))
    proc = train(
        run, *DP2, *extra, "--faults", "slow@1:3", "--resilience.slow_steps", "4", steps=40
    )
    _ok(proc)
    (fault,) = events(run, "fault")
    assert fault["fault"]["kind"] == "slow" and fault["fault"]["ranks"] == [1], fault["text"]
    assert_same_run(run, reference)


@pytest.mark.dist
@pytest.mark.slow
def test_node_failing_diagnostics_is_excluded(tmp_path, reference_run):
    """Two simulated nodes and a spare; after a rank dies, the restarted group's diagnostics find
    node n1 slow: it is excluded (kept in the run directory) and the spare n2 takes its ranks."""
    layout = ["--nproc", "4", "--parallel.dp_shard", "4"]
    # test_supervisor's two-node drill compares with the same run
    run, reference = tmp_path / "run", reference_run(*layout, "--resilience.diagnose", "false")
    host_nodes = ["--resilience.local_nodes", "2", "--resilience.spare_nodes", "1"]
    faults = f"kill@3:6,baddiag@{socket.gethostname()}/n1"
    proc = train(run, *layout, *host_nodes, "--faults", faults)
    _ok(proc)
    excluded = json.loads((run / "supervisor" / "excluded_nodes.json").read_text())
    assert [n.rsplit("/", 1)[1] for n in excluded] == ["n1"], excluded
    launches = [[n.rsplit("/", 1)[1] for n in e["nodes"]] for e in events(run, "launch")]
    assert launches == [["n0", "n1"], ["n0", "n1"], ["n0", "n2"]], launches
    kinds = [e["fault"]["kind"] for e in events(run, "fault")]
    assert kinds == ["dead", "bad_node"], kinds
    assert_same_run(run, reference)


@pytest.mark.dist
@pytest.mark.slow
def test_full_disk_during_an_async_save_does_not_stop_training(tmp_path, reference_run):
    """The save of step 8 fails with ENOSPC in the background writer: reported, its partial
    directory removed, the previous checkpoint intact, training goes on and saves again."""
    run, reference = tmp_path / "run", reference_run(*DP2)
    proc = train(run, *DP2, "--faults", "enospc@8")
    _ok(proc)
    assert "No space left on device" in proc.stderr, proc.stderr[-3000:]
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["step_00000004", "step_00000012"], names
    assert not events(run, "fault")
    assert_same_run(run, reference)
