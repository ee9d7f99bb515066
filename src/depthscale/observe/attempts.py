"""Which start's records a report reads, and what the supervisor wrote about that start.

Every start that trains moves the previous start's trace to RUN/trace/archive/<time>/
(`train/telemetry.py`), so RUN/trace holds the newest attempt and the archive the earlier ones. A
supervised run restarts after a fault: by the time anyone asks, the attempt whose hang dumps say
what went wrong is an archived one. `trace hang` and `trace timeline` therefore look back through
the attempts, newest first, and say which one they read.

The supervisor (`resilience/supervisor.py`) logs each launch with its workers' pids to
RUN/supervisor/log.jsonl (RUN/supervisor/nodeK/log.jsonl on node K of a multi-node job), then the
fault that ended the attempt, also written to attemptN/forensics.json beside the log. The pids in
the trace files' meta lines tie a trace to its launch: attempt numbers start again at 0 in every
invocation, pids do not repeat while a machine runs. These files are read as data: observe/ does
not import resilience/.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

ARCHIVE = "archive"
_ARCHIVE_NAME = re.compile(r"^(\d{8}-\d{6})(?:-(\d+))?$")
_SPAN = re.compile(r'"kind":\s*"span"')


def archive_name(trace: Path) -> str:
    """A new folder name under trace/archive/: the time, made unique by a suffix when another
    start archived in the same second (a restart right after a fast failure)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    taken = {p.name for p in (trace / ARCHIVE).glob(f"{stamp}*")}
    n = 0
    while (name := stamp if n == 0 else f"{stamp}-{n}") in taken:
        n += 1
    return name


def trace_folders(run: Path) -> list[Path]:
    """RUN/trace, then the archived attempts' trace folders, newest first."""
    trace = Path(run) / "trace"
    archived = [p for p in (trace / ARCHIVE).glob("*") if _ARCHIVE_NAME.match(p.name)]

    def key(p: Path) -> tuple[str, int]:
        stamp, n = _ARCHIVE_NAME.match(p.name).groups()
        return stamp, int(n or 0)

    return [trace, *sorted(archived, key=key, reverse=True)]


def has_dumps(folder: Path) -> bool:
    return any((folder / "hang").glob("rank*.json"))


def has_spans(folder: Path) -> bool:
    """Whether any rank file in `folder` recorded a span (a start that trained, not one that
    stopped in start-up and left only the meta and clock lines)."""
    for path in folder.glob("rank*.jsonl"):
        with open(path, encoding="utf-8", errors="replace") as f:
            if any(_SPAN.search(line) for line in f):
                return True
    return False


def trace_pids(folder: Path) -> dict[int, int]:
    """rank → the pid its trace file's meta line names (ranks whose line is unreadable left out)."""
    pids = {}
    for path in folder.glob("rank*.jsonl"):
        with open(path, encoding="utf-8", errors="replace") as f:
            first = f.readline()
        try:
            meta = json.loads(first)
            pids[int(meta["rank"])] = int(meta["pid"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
    return pids


def describe(run: Path, folder: Path) -> str:
    """Which attempt `folder` holds, in words: the newest, or an archived earlier one."""
    if folder == Path(run) / "trace":
        return "the latest attempt"
    return "an earlier attempt, archived when the run was started again"


def written_at(paths: list[Path]) -> str | None:
    """The newest modification time of `paths`, local time ("2026-11-28 03:50:44")."""
    times = [p.stat().st_mtime for p in paths if p.exists()]
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(max(times))) if times else None


# --------------------------------------------------------------------------- the supervisor's log


@dataclass
class Launch:
    """One supervised attempt, from the supervisor logs of every node that launched part of it."""

    attempt: int
    launched_at: float
    node_of: dict[int, str] = field(default_factory=dict)
    """Global rank → the node the supervisor launched it on."""
    faults: list[dict] = field(default_factory=list)
    """The faults the supervisors recorded for this attempt (the `fault` field of log.jsonl)."""
    quiet: list[str] = field(default_factory=list)
    """Nodes whose supervisor logged nothing after launching its part: it is gone, or the attempt
    is still running."""

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.launched_at))
        return f"supervisor attempt {self.attempt}, launched {when}"

    def fault_of(self, rank: int) -> dict | None:
        """The recorded fault that names `rank` (None when none does): its own node's record
        before another node's relay of it (kind "peer")."""
        named = [f for f in self.faults if rank in (f.get("ranks") or [])]
        return min(named, key=lambda f: f.get("kind") == "peer", default=None)


def supervised_launch(run: Path, pids: dict[int, int]) -> Launch | None:
    """The supervised attempt whose workers had these pids (rank → pid, from the trace files);
    None for a run no supervisor launched (torchrun, one process) or when nothing matches."""
    rank_of = {pid: rank for rank, pid in pids.items()}
    launch = None
    for log in sorted((Path(run) / "supervisor").glob("**/log.jsonl")):
        found = _launch_in(log, rank_of)
        if found is None:
            continue
        if launch is None:
            launch = found
        else:  # another node's part of the same attempt
            launch.node_of.update(found.node_of)
            launch.faults += found.faults
            launch.quiet += found.quiet
    return launch


def _records(log: Path) -> list[dict]:
    records = []
    for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a killed supervisor
        if isinstance(record, dict):
            records.append(record)
    return records


def _launch_in(log: Path, rank_of: dict[int, int]) -> Launch | None:
    """This node's launch of the workers with these pids, and the faults logged after it."""
    launch = None
    for record in _records(log):
        event = record.get("event")
        if event == "launch":
            if launch is not None:
                break  # the next attempt began
            launch = _match(record, rank_of)
        elif launch is not None and event == "fault" and isinstance(record.get("fault"), dict):
            launch.faults.append(record["fault"])
    if launch is None:
        return None
    if not launch.faults:
        recorded = _forensics_fault(log.parent / f"attempt{launch.attempt}", rank_of)
        launch.faults += [recorded] if recorded else []
    if not launch.faults:
        launch.quiet = sorted(set(launch.node_of.values()))
    return launch


def _match(record: dict, rank_of: dict[int, int]) -> Launch | None:
    """The launch record as a Launch when every worker it started wrote one of these traces."""
    pids = record.get("pids")
    nodes = record.get("nodes") or []
    if not isinstance(pids, dict) or not pids or not isinstance(nodes, list):
        return None
    try:
        local = {int(k): int(v) for k, v in pids.items()}
    except (TypeError, ValueError):
        return None
    if not set(local.values()) <= rank_of.keys():
        return None
    per_node = max(1, len(local) // max(1, len(nodes)))
    node_of = {
        rank_of[pid]: str(nodes[min(i // per_node, len(nodes) - 1)]) if nodes else "?"
        for i, pid in local.items()
    }
    return Launch(int(record.get("attempt", 0)), float(record.get("time", 0)), node_of)


def _forensics_fault(directory: Path, rank_of: dict[int, int]) -> dict | None:
    """The fault in attemptN/forensics.json, when its heartbeats are these workers' (the file of
    another invocation's attempt N is not)."""
    try:
        record = json.loads((directory / "forensics.json").read_text())
        beats = [hb for hb in record["heartbeats"].values() if isinstance(hb, dict)]
    except (OSError, json.JSONDecodeError, KeyError, AttributeError, TypeError):
        return None
    if not beats or not all(hb.get("pid") in rank_of for hb in beats):
        return None
    fault = record.get("fault")
    return fault if isinstance(fault, dict) else None
