"""Start-up phase marks: when each phase of a worker's (re)start ended, so that a supervisor can log
where a restart's time went (MegaScale: init is what a restart waits for, at every restart).

A worker calls `mark(phase)` as each phase ends and `save(run_dir, rank)` once the first step is
done; both are cheap and never synchronise. Each rank writes RUN/startup/rank<r>.json (wall-clock
times: ranks on different hosts are compared by phase durations, not by stamps):

    {"rank": 0, "pid": 123, "host": "h", "process_start": 1764070000.12,
     "marks": {"imports": 1764070002.61, "process_group": ..., ..., "first_step": ...}}

`startup_phases(run_dir)` reads every rank's file into seconds per phase. The process start comes
from /proc/self/stat (when the process was created, before the interpreter loaded anything); off
Linux, from the import of this module.

This module imports nothing else from depthscale, so any layer may mark.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

PHASES = (
    "imports",  # process start → the trainer starts building: interpreter, imports, config
    "process_group",  # rendezvous and the world process group
    "mesh",  # the device mesh's groups
    "diagnose",  # a supervised restart's diagnostics, run by the new group itself (optional)
    "data",  # tokenizer and token cache (the node's local rank 0 first)
    "model",  # build on meta, split, shard, materialise, optimizer
    "checkpoint_load",  # finding, verifying and loading the newest checkpoint (if any)
    "first_step",  # the rest of set-up (telemetry, clock offsets) and the first optimizer step
)

OPTIONAL = ("diagnose",)
"""Phases only some starts have."""

_IMPORTED = time.time()
_marks: dict[str, float] = {}


def process_start_time() -> float:
    """Wall-clock time at which this process was created."""
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime, after "(comm)"
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return _IMPORTED


def mark(phase: str) -> None:
    """`phase` (one of PHASES) ended now; a later mark of the same phase replaces it."""
    if phase not in PHASES:
        raise ValueError(f"unknown start-up phase {phase!r}; allowed: {', '.join(PHASES)}")
    _marks[phase] = time.time()


def marks() -> dict[str, float]:
    """This process's marks so far (a copy; the supervisor's heartbeat carries them)."""
    return dict(_marks)


def save(run_dir: Path, rank: int) -> Path:
    """Write this rank's marks so far to RUN/startup/rank<r>.json (atomically: a reader never sees
    half a file)."""
    path = startup_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "rank": rank,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "process_start": process_start_time(),
        "marks": dict(_marks),
    }
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)
    return path


def startup_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / "startup" / f"rank{rank:05d}.json"


def startup_phases(run_dir: Path, launched_at: float | None = None) -> dict[int, dict[str, float]]:
    """{rank: {phase: seconds}} from every rank's file, phases in PHASES order, each the time from
    the previous mark (the first from the process start) to its own; phases a rank has not reached
    are absent. `launched_at` (wall clock: when the supervisor started the worker group) adds a
    `launch` phase, launch → process start, first. Also `total`: process start (or launch) → last
    mark."""
    out: dict[int, dict[str, float]] = {}
    for path in sorted((Path(run_dir) / "startup").glob("rank*.json")):
        record = json.loads(path.read_text())
        start = record["process_start"]
        phases: dict[str, float] = {}
        if launched_at is not None:
            phases["launch"] = start - launched_at
        previous = start
        for phase in PHASES:
            if phase in record["marks"]:
                phases[phase] = record["marks"][phase] - previous
                previous = record["marks"][phase]
        phases["total"] = previous - (launched_at if launched_at is not None else start)
        out[record["rank"]] = phases
    return out
