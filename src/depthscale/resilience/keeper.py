"""The node's snapshot keeper: the process that owns a run's snapshots in shared memory.

The workers write each snapshot (train/snapshot.py) into a directory on /dev/shm that the keeper
made; the files are tmpfs pages, so they outlive the worker that wrote them, and the supervisor's
next group reads them back. The keeper is what decides how long they live:

- at the supervisor's start it makes the directory (mode 700) and sweeps unfinished versions
  (`step_N.tmp/`, a writer killed mid-snapshot) left by an earlier job on this run;
- between two attempts the supervisor has it sweep again (no group runs then, so nothing is
  being written);
- when the job ends well (done, bad input, stopped by a signal: a checkpoint was saved) it removes
  the directory and its memory; when the job gives up (exit 75: a requeue resumes) or the
  supervisor dies, it keeps it, for the requeued job's keeper to adopt.

It is its own process, not a thread of the supervisor, so that what it does with the memory does
not depend on the supervisor surviving. Killed alone, nothing is lost (the files stay): the
supervisor names it in one warning and starts another, which adopts the directory without
sweeping (a snapshot may be in flight).

Protocol, one line each on its stdin: `sweep`, `drop` (remove all and exit), `keep` (exit);
end of input (the supervisor is gone) means `keep`.
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

UNFINISHED = re.compile(r"step_\d+\.tmp")
"""A version a writer had not finished (train/manifest.py names versions `step_N`). Matched
here, not imported: the keeper process imports no torch, so it starts in a blink."""
SNAPSHOT_DIR_ENV = "DEPTHSCALE_SNAPSHOT_DIR"
"""Set by the supervisor for its workers: the directory its keeper owns."""
SHM = Path("/dev/shm")


def snapshot_dir(run_path: Path, base: Path = SHM) -> Path:
    """The run's snapshot directory in shared memory: one per run directory and user."""
    digest = hashlib.sha1(str(Path(run_path).resolve()).encode()).hexdigest()[:12]
    return base / f"depthscale-{getpass.getuser()}-{digest}"


def sweep(root: Path) -> list[str]:
    """Remove unfinished versions (`step_N.tmp/`) under root; their names."""
    gone = []
    if not root.is_dir():
        return gone
    for entry in root.iterdir():
        if UNFINISHED.fullmatch(entry.name):
            shutil.rmtree(entry, ignore_errors=True)
            gone.append(entry.name)
    return gone


def held_bytes(root: Path) -> int:
    """Bytes of shared memory the snapshots under root take."""
    if not root.is_dir():
        return 0
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def with_restore(text: str, fields: dict, records: list[dict | None], base: int) -> tuple:
    """A (re)start's log record with what each rank restored from (`Snapshots.report`): the
    tiers, the bytes read and any version that failed verification, in its text once."""
    ranks = {str(base + r): rec for r, rec in enumerate(records) if rec}
    if not ranks:
        return text, fields
    by_tier: dict[str, list[str]] = {}
    for rank, rec in ranks.items():
        by_tier.setdefault(f"{rec['tier']} step {rec['step']}", []).append(rank)
    read = sum(rec["bytes"] for rec in ranks.values())
    text += "; restored from " + ", ".join(
        f"{tier} (rank{'s' if len(r) > 1 else ''} {','.join(r)})" for tier, r in by_tier.items()
    )
    text += f", {read / 1e6:.2f} MB read"
    failed = next((rec["failed"] for rec in ranks.values() if rec.get("failed")), None)
    if failed:
        text += f"; failed verification: {failed[0]}"
    return text, {**fields, "restore": ranks}


class Keeper:
    """The supervisor's handle: start the keeper, restart it once per death with one warning, and
    tell it how the job ended."""

    def __init__(self, root: Path, log: Callable[..., None]) -> None:
        self.root = Path(root)
        self._log = log
        self._closing = False
        self.restarts = 0
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)  # before any worker writes
        self._proc = self._start(fresh=True)
        self._watch = threading.Thread(target=self._watch_loop, daemon=True)
        self._watch.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _start(self, fresh: bool) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "depthscale.resilience.keeper", str(self.root)]
            + (["--sweep"] if fresh else []),
            stdin=subprocess.PIPE,
            text=True,
            start_new_session=True,  # a Ctrl-C to the job's process group is the supervisor's
        )

    def _watch_loop(self) -> None:
        while True:
            proc = self._proc
            code = proc.wait()
            if self._closing:
                return
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited {code}"
            self._proc = self._start(fresh=False)
            self.restarts += 1
            self._log(
                "keeper",
                f"warning: the snapshot keeper (pid {proc.pid}) {how}; started another "
                f"(pid {self._proc.pid}); the snapshots in {self.root} are kept and go on",
                pid=self._proc.pid,
                died=proc.pid,
                exit=code,
            )

    def _send(self, line: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._proc.stdin.write(line + "\n")
            self._proc.stdin.flush()

    def sweep(self) -> None:
        """Between attempts: remove unfinished versions (asked of the keeper, waited for here)."""
        self._send("sweep")
        sweep(self.root)  # the same, done here too: the next group must not start before it

    def close(self, keep: bool) -> None:
        self._closing = True
        self._send("keep" if keep else "drop")
        with contextlib.suppress(OSError, ValueError):
            self._proc.stdin.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        if not keep:  # a keeper that could not do it (killed just now): done here
            shutil.rmtree(self.root, ignore_errors=True)


def _serve(root: Path, fresh: bool) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # the supervisor tells it when the job ends
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    if fresh:
        sweep(root)
    for line in sys.stdin:
        command = line.strip()
        if command == "sweep":
            sweep(root)
        elif command == "drop":
            shutil.rmtree(root, ignore_errors=True)
            return
        elif command == "keep":
            return


if __name__ == "__main__":
    _serve(Path(sys.argv[1]), "--sweep" in sys.argv[2:])
