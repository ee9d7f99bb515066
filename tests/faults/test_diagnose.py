"""`depthscale diagnose` on 4 real gloo processes: a healthy run passes and saves the baseline; a
node made slow, one sending wrong data, an unwritable checkpoint directory and a hung node are each
named. Faults are injected with DEPTHSCALE_DIAG_FAULT; nodes simulated with DEPTHSCALE_NODE_ID.

No timing asserts: `slow` reads ≥ 10× lower, the flag fires at 5×."""

import json
import os
import subprocess
import sys

import pytest
import torch

from depthscale.config import CheckpointConfig
from depthscale.resilience.diagnose import diagnose
from depthscale.train.checkpoint import Checkpointer

TIMEOUT_S = float(os.environ.get("DEPTHSCALE_E2E_TIMEOUT_S", "900"))  # a hang guard only


def cli(*args, env=None):
    env = dict(os.environ, PYTHONWARNINGS="ignore", **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "depthscale.cli", "diagnose", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def nodes(*names):
    return {rank: {"DEPTHSCALE_NODE_ID": name} for rank, name in enumerate(names)}


@pytest.fixture(scope="module")
def healthy_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("diagnose") / "run"
    _checkpoints_with_a_damaged_newest(run / "checkpoints")
    proc = cli("--nproc", "4", "--run", str(run), "--json")
    return run, proc


def _checkpoints_with_a_damaged_newest(root):
    """step_1 intact, step_2 with a flipped byte: what diagnose's recovery tiers must name."""
    model = torch.nn.Linear(4, 3)
    saver = Checkpointer(root, CheckpointConfig(), None)
    for step in (1, 2):
        saver.save(step, model, torch.optim.AdamW(model.parameters()), {"step": step})
    shard = next((root / "step_00000002").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def test_healthy_run_exits_0_and_saves_the_baseline(healthy_run):
    run, proc = healthy_run
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["healthy"] and report["info"]["baseline"] == "saved"
    assert [row["rank"] for row in report["rows"]] == [0, 1, 2, 3]
    assert set(report["pairs"]) == {"0-1", "1-2", "2-3", "0-3"}
    baseline = json.loads((run / "diagnostics" / "baseline.json").read_text())
    assert set(baseline["nproc=4,size_mb=4"]) >= {"all_reduce", "send_recv", "memcpy"}
    assert len(list((run / "diagnostics").glob("2*.json"))) == 1
    # the recovery tiers, verified as a restart would: the damaged newest checkpoint is named
    # (a warning, not a node failure) and the one a restart would use is said
    disk = next(t for t in report["recovery_tiers"] if t["tier"] == "disk")
    assert disk["verified"] == "step_00000001" and len(disk["failed"]) == 1
    assert "recovery tier disk: checkpoint step_00000002 on disk (" in proc.stderr


@pytest.fixture(scope="module")
def faulty_report(healthy_run, monkeypatch_module):
    """One launch for two faults on two nodes: nodeB (ranks 2, 3) slow, nodeC (rank 1) wrong."""
    run, _ = healthy_run
    monkeypatch_module.setenv("DEPTHSCALE_DIAG_FAULT", "slow@nodeB,wrong@nodeC")
    return diagnose(4, run, nodes("nodeA", "nodeC", "nodeB", "nodeB"))


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_slow_node_is_named(faulty_report):
    assert sorted(faulty_report.bad_nodes) == ["nodeB", "nodeC"]
    slow = {(f.rank, f.check) for f in faulty_report.failures if f.node == "nodeB"}
    # localised by its own memory copies (against the median) and by its exchanges (against the
    # healthy run's baseline: 3 of 4 exchanges touch nodeB, so their median is slow too)
    assert slow == {(2, "memcpy"), (3, "memcpy"), (2, "send_recv"), (3, "send_recv")}
    assert faulty_report.info["baseline"] == "compared"


def test_wrong_data_names_the_node_and_the_check(faulty_report):
    (wrong,) = [f for f in faulty_report.failures if f.node == "nodeC"]
    assert (wrong.rank, wrong.check) == (1, "all_reduce")
    assert "wrong data from rank 1" in wrong.detail


def test_unwritable_checkpoint_dir_is_named(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")  # a file where a directory should be: unwritable even for root
    ckpt = blocker / "checkpoints"
    proc = cli("--nproc", "4", "--run", str(tmp_path / "run"), "--checkpoint-dir", str(ckpt))
    assert proc.returncode == 1
    assert f"ranks 0,1,2,3 ckpt_write: {ckpt} is not writable (Not a directory)" in proc.stderr
    assert "FAILED node" in proc.stdout and "Traceback" not in proc.stderr


def test_bad_arguments_are_one_line_exit_2(tmp_path):
    proc = cli("--nproc", "2", "--run", str(tmp_path), "--size-mb", "1e9")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "depthscale: config error: diagnose: size_mb=1000000000.0 is not allowed; "
        "allowed: (0, 4096.0]"
    ]
    proc = cli("--nproc", "2", "--run", str(tmp_path), env={"DEPTHSCALE_DIAG_FAULT": "slow"})
    assert proc.returncode == 2 and "KIND@NODE" in proc.stderr and "Traceback" not in proc.stderr
    proc = cli("--nproc", "0", "--run", str(tmp_path))
    assert proc.returncode == 2 and "'0' is not allowed; allowed: an integer >= 1" in proc.stderr


@pytest.mark.slow
def test_hung_node_is_named_as_silent(tmp_path, monkeypatch):
    """nodeB stops before the all-to-all: its ranks are the silent ones, not the peers waiting."""
    monkeypatch.setenv("DEPTHSCALE_DIAG_FAULT", "hang@nodeB")
    report = diagnose(4, tmp_path, nodes("nodeA", "nodeA", "nodeB", "nodeB"), timeout_s=10)
    assert report.bad_nodes == {
        "nodeB": ["ranks 2,3 silent: silent for 10 s; last seen at: all_reduce"]
    }
