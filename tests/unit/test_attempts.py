"""`trace hang` after a rank died, and after the run was started again: the dumps are looked for in
the archived attempts, the supervisor's records are tied to the attempt by the workers' pids, and a
dead rank is named — by the supervisor's record, by its peers' closed connections, or where its
trace ends — rather than "the dumps show no hang". Synthetic run directories, laid out as the
trainer and the supervisor write them (the real drills: tests/faults/test_supervisor.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from depthscale.errors import DepthscaleError
from depthscale.observe.attempts import supervised_launch, trace_folders
from depthscale.observe.trace_report import run_report
from depthscale.train.telemetry import _archive_previous

DP2 = {r: {"pp": 0, "dp": r, "cp": 0, "tp": 0} for r in range(2)}
DP4 = {r: {"pp": 0, "dp": r, "cp": 0, "tp": 0} for r in range(4)}
CLOSED = (
    "RuntimeError('[/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:15516. This is typically caused by a remote worker crashing.')"
)


def _span(name: str, step: int, ts: int) -> dict:
    return {"kind": "span", "name": name, "cat": "compute", "ts": ts, "step": step, "dur": 5}


def _attempt(folder: Path, coords: dict, pids: dict[int, int], last_step: dict[int, int]) -> None:
    """Rank files as a start writes them: meta (with the pid), clock, spans up to `last_step`."""
    folder.mkdir(parents=True, exist_ok=True)
    for rank, c in coords.items():
        meta = {"kind": "meta", "rank": rank, "world": len(coords), "coords": c, "pid": pids[rank]}
        lines = [meta, {"kind": "clock", "same_clock_as": 0}]
        for step in range(1, last_step.get(rank, 0) + 1):
            lines += [_span("forward", step, 10 * step), _span("backward", step, 10 * step + 5)]
        (folder / f"rank{rank:05d}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def _dump(folder: Path, rank: int, coords: dict, error: str | None, at: int = 6) -> None:
    """Rank's hang dump as `Telemetry.on_error` writes it: failed in its forward of step `at`."""
    step = {"name": "step", "cat": "step", "ts": 0, "step": at, "waiting": False}
    inner = {"name": "forward", "cat": "compute", "ts": 1, "step": at, "args": {}, "waiting": True}
    dump = {"rank": rank, "world": len(coords), "coords": coords[rank], "reason": "error",
            "error": error, "step": at, "in_flight": [step, inner], "recent": [], "stacks": ""}  # fmt: skip
    (folder / "hang").mkdir(parents=True, exist_ok=True)
    (folder / "hang" / f"rank{rank:05d}.json").write_text(json.dumps(dump))


def _log(path: Path, *records: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as fh:
        for record in records:
            fh.write(json.dumps({"time": time.time(), **record}) + "\n")


def _launch(attempt: int, pids: dict[int, int], node: str = "vm") -> dict:
    return {"event": "launch", "attempt": attempt, "nodes": [node], "pids": pids}


def _fault(kind: str, ranks: list[int], detail: str, node: str = "vm") -> dict:
    fault = {"kind": kind, "ranks": ranks, "nodes": [node] * len(ranks), "detail": detail}
    return {"event": "fault", "fault": fault}


def _killed_then_restarted(run: Path, with_dumps: bool = True) -> Path:
    """A supervised dp=2 run: attempt 0's rank 1 SIGKILLed at step 6 (its trace ends in step 5),
    rank 0's collective failing on the closed connection; attempt 1 ran to the end."""
    old = run / "trace" / "archive" / "20261128-035050"
    _attempt(old, DP2, {0: 101, 1: 102}, {0: 6, 1: 5})
    if with_dumps:
        _dump(old, 0, DP2, CLOSED)
    _attempt(run / "trace", DP2, {0: 201, 1: 202}, {0: 12, 1: 12})
    return old


def _report(run: Path, capsys) -> str:
    assert run_report("hang", run, None) == 0
    return capsys.readouterr().out


def test_a_dead_rank_is_named_from_the_archived_attempt_and_the_supervisors_log(tmp_path, capsys):
    old = _killed_then_restarted(tmp_path)
    _log(
        tmp_path / "supervisor" / "log.jsonl",
        _launch(0, {0: 101, 1: 102}),
        _fault("dead", [1], "killed by SIGKILL (pid 102)"),
        _launch(1, {0: 201, 1: 202}),
    )
    text = _report(tmp_path, capsys)
    first, *lines = text.splitlines()
    assert "an earlier attempt" in first and "supervisor attempt 0" in first
    assert first.endswith(str(old / "hang"))
    assert lines[0] == (
        "culprit: rank 1 (pp0 dp1 cp0 tp0) on node vm died: killed by SIGKILL (pid 102), "
        "as the supervisor recorded"
    )
    assert lines[1] == "  its trace ends in step 5, in backward"
    assert lines[2] == (
        "  rank 0 (pp0 dp0 cp0 tp0) failed in forward at step 6: Connection closed by peer "
        "[127.0.0.1]:15516"
    )
    assert "show no hang" not in text


def test_without_any_dump_the_supervisors_record_names_the_dead_rank(tmp_path, capsys):
    """The supervisor stopped the group before rank 0 noticed: no dump anywhere. The fault is read
    from the log, or — when the log has none after the launch — from attemptN/forensics.json,
    but only that attempt's: another invocation's attempt 0 (other pids) is no evidence."""
    _killed_then_restarted(tmp_path, with_dumps=False)
    log = tmp_path / "supervisor" / "log.jsonl"
    _log(log, _launch(0, {0: 101, 1: 102}))
    forensics = tmp_path / "supervisor" / "attempt0" / "forensics.json"
    forensics.parent.mkdir(parents=True)
    fault = _fault("dead", [1], "killed by SIGKILL (pid 102)")["fault"]
    beats = {"0": {"pid": 301}, "1": {"pid": 302}}  # a later invocation's attempt 0
    forensics.write_text(json.dumps({"fault": fault, "heartbeats": beats}))
    with pytest.raises(DepthscaleError, match="no supervisor recorded a dead or hung rank"):
        run_report("hang", tmp_path, None)
    forensics.write_text(json.dumps({"fault": fault, "heartbeats": {"0": {"pid": 101}}}))
    text = _report(tmp_path, capsys)
    assert "no rank wrote a hang dump" in text.splitlines()[0]
    assert "culprit: rank 1 (pp0 dp1 cp0 tp0) on node vm died: killed by SIGKILL" in text
    _log(log, _fault("hung", [1], "heartbeat silent for 1.60 s (process state: T (stopped))"))
    assert "on node vm hung: heartbeat silent for 1.60 s" in _report(tmp_path, capsys)


def test_without_a_supervisor_a_closed_connection_names_the_silent_rank(tmp_path, capsys):
    """torchrun: rank 1 killed at the start of step 3 before its writer flushed a span; rank 0's
    collective failed on the reset connection. The latest attempt is read, and says so."""
    _attempt(tmp_path / "trace", DP2, {0: 11, 1: 12}, {0: 3})
    reset = "RuntimeError('Read error [127.0.0.1]:16596: Connection reset by peer')"
    _dump(tmp_path / "trace", 0, DP2, reset, at=3)
    first, *lines = _report(tmp_path, capsys).splitlines()
    assert first.startswith("hang dumps of the latest attempt, written ")
    assert lines == [
        "culprit: rank 1 (pp0 dp1 cp0 tp0) is gone: its peers' connections to it closed (Read "
        "error [127.0.0.1]:16596: Connection reset by peer); it died or its host went away",
        "  its trace file holds no span",
        "  rank 0 (pp0 dp0 cp0 tp0) failed in forward at step 3: Read error [127.0.0.1]:16596: "
        "Connection reset by peer",
    ]


def test_a_node_gone_whole(tmp_path, capsys):
    """Two supervised nodes of two ranks; node1 vanished (its supervisor with its workers): its
    log ends at the launch, node0's records its own workers' failure. Ranks 2 and 3 are named,
    on node1, with what node1's silence says."""
    pids = {0: 101, 1: 102, 2: 103, 3: 104}
    _attempt(tmp_path / "trace", DP4, pids, {0: 4, 1: 4, 2: 3, 3: 3})
    for rank in (0, 1):
        _dump(tmp_path / "trace", rank, DP4, CLOSED, at=4)
    _log(
        tmp_path / "supervisor" / "node0" / "log.jsonl",
        _launch(0, {0: 101, 1: 102}, "node0"),
        _fault("error", [0], "exited with code 1", "node0"),
    )
    _log(tmp_path / "supervisor" / "node1" / "log.jsonl", _launch(0, {0: 103, 1: 104}, "node1"))
    text = _report(tmp_path, capsys)
    for rank in (2, 3):
        assert (
            f"culprit: rank {rank} (pp0 dp{rank} cp0 tp0) on node node1 is gone: its peers' "
            "connections to it closed (Connection closed by peer [127.0.0.1]:15516); it died or "
            "its host went away; the supervisor on node1 recorded no fault for this attempt"
        ) in text
    assert "  its trace ends in step 3, in backward" in text
    assert "rank 0 (pp0 dp0 cp0 tp0) failed in forward at step 4" in text


def test_the_newest_attempt_with_dumps_is_read(tmp_path, capsys):
    """Dumps in RUN/trace win over older archived ones; without them, the newest archive does."""
    _attempt(tmp_path / "trace" / "archive" / "20261128-035050", DP2, {0: 1, 1: 2}, {0: 1})
    _dump(tmp_path / "trace" / "archive" / "20261128-035050", 0, DP2, CLOSED)
    _attempt(tmp_path / "trace" / "archive" / "20261128-035050-1", DP2, {0: 3, 1: 4}, {1: 1})
    _dump(tmp_path / "trace" / "archive" / "20261128-035050-1", 1, DP2, CLOSED)
    _attempt(tmp_path / "trace", DP2, {0: 5, 1: 6}, {0: 2, 1: 2})
    assert "culprit: rank 0 (" in _report(tmp_path, capsys)  # the -1 archive: rank 1 dumped
    _dump(tmp_path / "trace", 1, DP2, CLOSED)
    text = _report(tmp_path, capsys)
    assert text.startswith("hang dumps of the latest attempt") and "culprit: rank 0 (" in text


def test_archives_in_one_second_are_kept_apart_and_ordered(tmp_path):
    """Two starts archiving within a second (a restart right after a fast failure): each keeps
    its own folder — the second no longer overwrites the first's files — newest listed first."""
    trace = tmp_path / "trace"
    for text in ("first", "second"):
        trace.mkdir(exist_ok=True)
        (trace / "rank00000.jsonl").write_text(text)
        _archive_previous(tmp_path, 0)
    folders = trace_folders(tmp_path)
    assert folders[0] == trace and len(folders) == 3
    assert [(f / "rank00000.jsonl").read_text() for f in folders[1:]] == ["second", "first"]


def test_a_launch_is_matched_by_every_pid_it_started(tmp_path):
    """Attempt numbers restart in every invocation; pids tie a trace to its launch."""
    log = tmp_path / "supervisor" / "log.jsonl"
    _log(log, _launch(0, {0: 1, 1: 2}), _fault("dead", [1], "killed by SIGKILL (pid 2)"))
    _log(log, _launch(0, {0: 5, 1: 6}))
    assert supervised_launch(tmp_path, {0: 5, 1: 6}).faults == []
    assert supervised_launch(tmp_path, {0: 1, 1: 2}).fault_of(1)["kind"] == "dead"
    assert supervised_launch(tmp_path, {0: 1, 1: 7}) is None  # pid 2 wrote no trace here


def test_ranks_the_supervisor_stopped_after_a_death_are_not_culprits(tmp_path, capsys):
    """A loaded 4-rank tour: rank 2 SIGKILLed; the supervisor stopped ranks 0 and 3 before they
    wrote a dump, and rank 1's collective failed on the reset connection. Before, all three
    silent ranks were named culprits ("is gone: its peers' connections to it closed")."""
    pids = {0: 101, 1: 102, 2: 103, 3: 104}
    _attempt(tmp_path / "trace", DP4, pids, {0: 5, 1: 5, 2: 4, 3: 5})
    _dump(tmp_path / "trace", 1, DP4, CLOSED, at=5)
    _log(
        tmp_path / "supervisor" / "log.jsonl",
        _launch(0, pids),
        _fault("dead", [2], "killed by SIGKILL (pid 103)"),
    )
    lines = _report(tmp_path, capsys).splitlines()[1:]
    assert [ln for ln in lines if ln.startswith("culprit:")] == [
        "culprit: rank 2 (pp0 dp2 cp0 tp0) on node vm died: killed by SIGKILL (pid 103), as the "
        "supervisor recorded"
    ]
    for rank in (0, 3):
        assert (
            f"  rank {rank} (pp0 dp{rank} cp0 tp0) on node vm wrote no dump: the supervisor "
            "stopped it after that fault"
        ) in lines


def test_a_node_its_peers_supervisor_found_lost(tmp_path, capsys):
    """Node 1's supervisor killed: node 0's recorded it lost (ranks 2, 3); rank 2 noticed and
    wrote a dump, rank 3 did not. Before, rank 3 was "gone" with "the supervisor on vm recorded
    no fault for this attempt", though node 0's had."""
    pids = {0: 101, 1: 102, 2: 103, 3: 104}
    _attempt(tmp_path / "trace", DP4, pids, {0: 4, 1: 4, 2: 4, 3: 3})
    for rank in (0, 1, 2):
        _dump(tmp_path / "trace", rank, DP4, CLOSED, at=4)
    lost = "its supervisor has not beaten in node 0's store for 5.0 s"
    _log(
        tmp_path / "supervisor" / "node0" / "log.jsonl",
        _launch(0, {0: 101, 1: 102}, "node0"),
        _fault("lost", [2, 3], lost, "node1"),
    )
    _log(tmp_path / "supervisor" / "node1" / "log.jsonl", _launch(0, {0: 103, 1: 104}, "node1"))
    text = _report(tmp_path, capsys)
    assert (
        f"culprit: rank 3 (pp0 dp3 cp0 tp0) on node node1 is gone with its node: {lost}, as the "
        "supervisor recorded"
    ) in text
    assert "recorded no fault" not in text
