"""Hang dumps: what every rank was doing when the job stopped making progress.

MegaScale's rule (§5.2): on a communication timeout every rank logs the operation it is in; the
rank with the faulty device hangs and logs nothing, so the silent rank is the culprit. Each rank
therefore writes `RUN/trace/hang/rank{R:05d}.json` — its in-flight spans (the collective or
message it waits in, with group, sequence number, peer and label), its recent spans and the Python
stacks of all its threads — in two situations:

- its own watchdog sees no span end for `timeout_s` while a step is running (a rank stuck in a
  collective, a receive, or in its own code — the last case is a culprit that is still alive);
- a collective or receive raises a timeout (`dump_on_error`, called by the trainer).

`observe/hang.py` reads the dumps of all ranks and names the silent rank.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import tempfile
import threading
from pathlib import Path

from depthscale.observe import flight_recorder
from depthscale.observe.spans import SpanRecorder


def hang_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / "trace" / "hang" / f"rank{rank:05d}.json"


def python_stacks() -> str:
    """Every thread's Python stack, as faulthandler prints it (works while the GIL is held by a
    thread stuck in C code, which `traceback` cannot)."""
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(f, all_threads=True)
        f.seek(0)
        return f.read()


def write_hang_dump(
    run_dir: Path, recorder: SpanRecorder, reason: str, error: str | None = None
) -> Path:
    """Write this rank's dump (atomically: a reader never sees half a file).

    A dump written on an error replaces the watchdog's from the same process, but keeps the
    watchdog's Flight Recorder state when its own has nothing pending: a collective that timed
    out is retired by then, and the earlier record is the one that says what was waited for."""
    meta = recorder.meta
    path = hang_path(run_dir, recorder.rank)
    recorded = flight_recorder.snapshot()
    if not (recorded or {}).get("in_flight"):
        earlier = _previous(path)
        if (earlier.get("flight_recorder") or {}).get("in_flight"):
            recorded = {**earlier["flight_recorder"], "taken": earlier.get("reason")}
    dump = {
        "rank": recorder.rank,
        "world": meta.get("world", 1),
        "coords": meta.get("coords", {}),
        "dims": meta.get("dims", {}),
        "host": meta.get("host", socket.gethostname()),
        "pid": os.getpid(),
        "reason": reason,
        "error": error,
        "time_ns": recorder.now_ns(),
        "step": recorder.step,
        "in_flight": recorder.in_flight(),
        "recent": recorder.recent_records(),
        "stacks": python_stacks(),
        "flight_recorder": recorded,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(dump, default=str))
    os.replace(tmp, path)
    return path


def _previous(path: Path) -> dict:
    """This process's earlier dump at `path` ({} when there is none, or another process's)."""
    try:
        earlier = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return earlier if earlier.get("pid") == os.getpid() else {}


class Watchdog:
    """Dumps this rank's state once it has made no progress for `timeout_s` inside a step (and
    again only after progress resumed and stalled anew). A daemon thread; `close()` stops it."""

    def __init__(self, run_dir: Path, recorder: SpanRecorder, timeout_s: float) -> None:
        self.run_dir, self.recorder, self.timeout_ns = run_dir, recorder, int(timeout_s * 1e9)
        self.dumped: Path | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="depthscale-watchdog", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        period = min(1.0, self.timeout_ns / 4e9)
        armed = True
        while not self._stop.wait(period):
            stalled = self.recorder.in_flight() and self.recorder.idle_ns() > self.timeout_ns
            if stalled and armed:
                self.dumped = write_hang_dump(self.run_dir, self.recorder, "watchdog")
                armed = False
            elif not stalled:
                armed = True

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
