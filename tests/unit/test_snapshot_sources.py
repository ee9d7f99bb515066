"""Snapshots across nodes, in one process: which version and which source a restart takes from
every node's report (`choose_version`), what a node's memory keeps (`_prune_node`), and the
keepers' copy to the buddy and a restart's fetch over HTTP (resilience/replica.py), with damage.
The drills with two supervisors and real signals are tests/faults/test_snapshot_nodes.py."""

import hashlib
import json
import time

import pytest

from depthscale.resilience.replica import (
    REPLICATED,
    Pusher,
    fetch,
    replica_root,
    replicated_step,
    serve,
)
from depthscale.train.checkpoint_write import _prune_node
from depthscale.train.snapshot import Fetcher, choose_version

BAD = "__1_0.distcp is corrupt"


def _report(node, own=None, replica=None, writers=2):
    own = own or {}
    replica = replica or {}
    steps = {*own, *(s for held in replica.values() for s in held)}
    return {"node": node, "own": own, "replica": replica, "writers": dict.fromkeys(steps, writers)}


def test_each_part_from_its_own_memory_first():
    reports = [_report(0, {6: None, 9: None}, {1: {9: None}}), _report(1, {9: None}, {0: {9: None}})]
    assert choose_version(reports) == ((9, {0: ("memory", 0), 1: ("memory", 1)}), [])


def test_a_node_lost_whole_is_served_by_its_buddy_copy():
    reports = [_report(0, {9: None}, {1: {9: None}}), _report(1)]  # node 1: a replacement
    assert choose_version(reports) == ((9, {0: ("memory", 0), 1: ("replica", 0)}), [])


def test_a_damaged_part_is_named_and_the_copy_used():
    reports = [_report(0, {9: None}, {1: {9: None}}), _report(1, {9: BAD}, {0: {9: None}})]
    choice, failed = choose_version(reports)
    assert choice == (9, {0: ("memory", 0), 1: ("replica", 0)})
    assert failed == [f"snapshot step_00000009 in the memory of node 1 failed verification: {BAD}"]


def test_both_damaged_falls_to_an_older_version_or_none():
    both = [_report(0, {6: None, 9: None}, {1: {6: None, 9: BAD}}), _report(1, {6: None, 9: BAD})]
    choice, failed = choose_version(both)
    assert choice == (6, {0: ("memory", 0), 1: ("memory", 1)}) and len(failed) == 2
    assert "the copy of node 1's snapshot step_00000009 on node 0 failed" in failed[1]
    choice, failed = choose_version([_report(0, {9: None}, {1: {9: BAD}}), _report(1, {9: BAD})])
    assert choice is None and len(failed) == 2


def test_a_part_absent_everywhere_is_no_failure_and_an_older_version_serves():
    reports = [_report(0, {6: None, 9: None}, {1: {6: None}}), _report(1)]  # 9's copy not in yet
    assert choose_version(reports) == ((6, {0: ("memory", 0), 1: ("replica", 0)}), [])


def test_one_node_versions_need_only_node_0():
    assert choose_version([_report(0, {3: None}, writers=1)]) == ((3, {0: ("memory", 0)}), [])
    assert choose_version([]) == (None, [])


@pytest.mark.parametrize(
    "have, replicated, kept",
    [
        ([6, 9], [9, 9], [9]),  # every copy of 9 is in: 6 can go
        ([6, 9], [9, 6], [6, 9]),  # node 1's copy of 9 is not: 6 stays
        ([3, 6, 9], [None, 9], [6, 9]),  # nothing copied yet: at most two versions
    ],
)
def test_a_node_keeps_a_version_until_a_newer_one_is_copied_everywhere(
    tmp_path, have, replicated, kept
):
    for step in have:
        (tmp_path / f"step_{step:08d}").mkdir()
    _prune_node(tmp_path, max(have), replicated)
    assert sorted(int(p.name[5:]) for p in tmp_path.iterdir()) == kept


def _version(root, step, node, files):
    """Node `node`'s part of a committed version in `root`: of `files` ({name: (its node or None
    for shared, bytes)}) the ones it holds, and the manifest naming them all."""
    version = root / f"step_{step:08d}"
    version.mkdir(parents=True)
    entries = {}
    for name, (holder, data) in files.items():
        entries[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        if holder is not None:
            entries[name]["node"] = holder
        if holder in (None, node):
            (version / name).write_bytes(data)
    manifest = {"format": 1, "step": step, "rng_ranks": 2, "model": None, "files": entries}
    (version / "manifest.json").write_text(json.dumps({**manifest, "nodes": 2}))
    return version


def _until(cond, timeout=20):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_a_keeper_copies_each_committed_version_to_its_buddy_and_refuses_damage(tmp_path):
    node1, node0 = tmp_path / "n1", tmp_path / "n0"
    node0.mkdir()
    buddy = serve(node0, "127.0.0.1")
    said = []
    pusher = Pusher(node1, 1, mb_s=50, say=said.append)
    _version(node1, 3, 1, {".metadata": (None, b"m"), "__1_0.distcp": (1, b"x" * 3000)})
    pusher.to(buddy.url)
    copy = replica_root(node0) / "node1" / "step_00000003"
    _until(lambda: replicated_step(node1) == 3)
    assert (copy / "__1_0.distcp").read_bytes() == b"x" * 3000 and (copy / "manifest.json").exists()
    version = _version(node1, 6, 1, {".metadata": (None, b"m"), "__1_0.distcp": (1, b"y" * 3000)})
    manifest = json.loads((version / "manifest.json").read_text())
    manifest["files"]["__1_0.distcp"]["sha256"] = "0" * 64  # bytes that no longer match
    (version / "manifest.json").write_text(json.dumps(manifest))
    _until(lambda: said)
    assert "snapshot step_00000006 not copied to the buddy" in said[0] and "corrupt" in said[0]
    assert replicated_step(node1) == 3 and copy.is_dir()  # the previous copy stands
    assert not (copy.parent / "step_00000006.tmp").exists()
    assert (node1 / REPLICATED).read_text() == "3"
    buddy.shutdown()


def test_a_restart_fetches_another_nodes_part_checked_against_the_manifest(tmp_path):
    node0, node1 = tmp_path / "n0", tmp_path / "n1"
    files = {".metadata": (None, b"meta"), "__0_0.distcp": (0, b"a" * 500), "__1_0.distcp": (1, b"b")}
    _version(node0, 9, 0, files)
    _version(node1, 9, 1, files)
    keeper0 = serve(node0, "127.0.0.1")
    fetcher = Fetcher(node1, 1, 9, {0: ("memory", 0), 1: ("memory", 1)}, [keeper0.url, ""])
    assert fetcher("__1_0.distcp") == node1 / "step_00000009" / "__1_0.distcp"  # its own
    got = fetcher("__0_0.distcp")
    assert got.read_bytes() == b"a" * 500 and got.is_relative_to(node1 / ".fetched")
    (node0 / "step_00000009" / "__0_0.distcp").write_bytes(b"c" * 500)  # damaged at the source
    with pytest.raises(ValueError, match="does not match its manifest"):
        fetch(f"{keeper0.url}/own/step_00000009/__0_0.distcp", tmp_path / "f", {"bytes": 500,
              "sha256": hashlib.sha256(b"a" * 500).hexdigest()})  # fmt: skip
    with pytest.raises(KeyError):
        fetcher("__5_0.distcp")  # not in this version
    keeper0.shutdown()


def test_the_copy_to_the_buddy_keeps_to_its_rate(tmp_path):
    file = tmp_path / "part"
    file.write_bytes(bytes(4 << 20))
    pusher = Pusher(tmp_path / "root", 0, mb_s=40)  # 4 MiB at 40 MB/s: >= 0.1 s
    start = time.monotonic()
    assert sum(map(len, pusher._paced(file))) == 4 << 20
    assert time.monotonic() - start >= (4 << 20) / 40e6 - 0.005
