"""Snapshots in memory (train/snapshot.py) and their keeper (resilience/keeper.py), in one process:
the tier a restart picks and why, and the keeper's life. The drills with real workers and signals
are tests/faults/test_snapshots.py."""

import os
import signal
import time

import torch
from torch import nn

from depthscale.config import Config
from depthscale.resilience.faults import corrupt_checkpoint
from depthscale.resilience.keeper import SNAPSHOT_DIR_ENV, Keeper, snapshot_dir, with_restore
from depthscale.train.checkpoint import Checkpointer
from depthscale.train.snapshot import Snapshots


def _save(root, cfg, *steps):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    ckpt = Checkpointer(root, cfg.checkpoint, cfg.model)
    for step in steps:
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        ckpt.save(step, model, optimizer, {"step": step})
    ckpt.wait()


def _snapshots(tmp_path, monkeypatch, memory, disk):
    cfg = Config()
    cfg.checkpoint.async_save = False
    monkeypatch.setenv(SNAPSHOT_DIR_ENV, str(tmp_path / "shm"))
    _save(tmp_path / "shm", cfg, *memory)
    _save(tmp_path / "disk", cfg, *disk)
    return Snapshots(cfg, Checkpointer(tmp_path / "disk", cfg.checkpoint, cfg.model))


def test_memory_first_when_not_older_than_disk(tmp_path, monkeypatch):
    snaps = _snapshots(tmp_path, monkeypatch, memory=[6], disk=[4])
    path = snaps.resolve_resume()
    assert path == tmp_path / "shm" / "step_00000006" and snaps.tier(path) == "memory"
    assert snaps.failed == []


def test_disk_when_newer_than_memory(tmp_path, monkeypatch):
    snaps = _snapshots(tmp_path, monkeypatch, memory=[3], disk=[4])
    path = snaps.resolve_resume()
    assert path == tmp_path / "disk" / "step_00000004" and snaps.tier(path) == "disk"


def test_a_damaged_snapshot_is_named_once_and_the_next_tier_used(tmp_path, monkeypatch, capsys):
    snaps = _snapshots(tmp_path, monkeypatch, memory=[6], disk=[4])
    corrupt_checkpoint(tmp_path / "shm" / "step_00000006")
    path = snaps.resolve_resume()
    assert snaps.tier(path) == "disk" and path.name == "step_00000004"
    (failed,) = snaps.failed
    assert "snapshot step_00000006 in the memory of node 0 failed verification" in failed
    said = [ln for ln in capsys.readouterr().out.splitlines() if "failed verification" in ln]
    assert len(said) == 1 and "next tier (checkpoint step_00000004 on disk)" in said[0]


def test_named_or_no_resume_never_reads_memory(tmp_path, monkeypatch):
    snaps = _snapshots(tmp_path, monkeypatch, memory=[6], disk=[4])
    snaps.cfg.checkpoint.resume = str(tmp_path / "disk" / "step_00000004")
    assert snaps.tier(snaps.resolve_resume()) == "disk"


def test_unsupervised_runs_take_no_snapshots(monkeypatch):
    monkeypatch.delenv(SNAPSHOT_DIR_ENV, raising=False)
    snaps = Snapshots(Config(), None)
    assert not snaps.enabled and snaps.every == 0


def test_restart_record_names_tiers_bytes_and_failures():
    rec = {"tier": "memory", "step": 9, "bytes": 1_500_000, "failed": []}
    bad = {**rec, "tier": "disk", "step": 8, "failed": ["snapshot step_00000009 ... failed"]}
    text, fields = with_restore("t", {}, [rec, rec], 0)
    assert text == "t; restored from memory step 9 (ranks 0,1), 3.00 MB read"
    assert fields["restore"] == {"0": rec, "1": rec}
    text, _ = with_restore("t", {}, [bad], 2)
    assert "disk step 8 (rank 2)" in text and "failed verification: snapshot step_00000009" in text
    assert with_restore("t", {"a": 1}, [None], 0) == ("t", {"a": 1})


def test_snapshot_dir_is_per_run_user_and_node(tmp_path):
    a, b = snapshot_dir(tmp_path / "a"), snapshot_dir(tmp_path / "b")
    assert a != b and a == snapshot_dir(tmp_path / "x" / ".." / "a")
    assert a.parent == snapshot_dir(tmp_path).parent and a.name.startswith("depthscale-")
    assert snapshot_dir(tmp_path / "a", 1) != a and a.name.endswith("-node0")


def test_keeper_sweeps_is_replaced_once_and_frees_or_keeps(tmp_path):
    root = tmp_path / "shm"
    (root / "step_00000003.tmp").mkdir(parents=True)
    (root / "step_00000003").mkdir()
    logged = []
    keeper = Keeper(root, lambda event, text, **kw: logged.append((event, text)))
    deadline = time.monotonic() + 30
    while (root / "step_00000003.tmp").exists():  # swept by a fresh keeper
        assert time.monotonic() < deadline
        time.sleep(0.05)
    first = keeper.pid
    os.kill(first, signal.SIGKILL)
    while keeper.pid == first or not logged:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    ((event, text),) = logged
    assert event == "keeper" and f"(pid {first}) was killed by SIGKILL" in text
    (root / "step_00000006.tmp").mkdir()  # in flight: a replacement does not sweep
    time.sleep(0.3)
    assert (root / "step_00000006.tmp").exists() and (root / "step_00000003").exists()
    keeper.sweep()
    assert not (root / "step_00000006.tmp").exists()
    keeper.close(keep=True)  # the job gave up: a requeue adopts the snapshots
    assert (root / "step_00000003").exists() and len(logged) == 1
    Keeper(root, logged.append).close(keep=False)  # the job ended well
    assert not root.exists()


def test_the_writer_reads_training_gone_with_a_reply_unread_as_its_end():
    """Training stopped by a signal exits without reading the writer's last reply: the writer's
    next read is a reset, not EOF, and means the same (before: a traceback per rank at Ctrl-C
    of a run with snapshots)."""
    from multiprocessing import Pipe

    from depthscale.train.save_process import _next_request

    training, writer = Pipe()
    training.send("request")
    assert _next_request(writer) == "request"
    writer.send("reply")  # never read
    training.close()
    assert _next_request(writer) is None
