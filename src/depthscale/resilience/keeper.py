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

In a multi-node job it also serves its node's snapshots over HTTP and pushes each new one to
the next node's keeper (the buddy replica, replica.py).

Protocol, one line each on its stdin: `sweep`, `buddy URL` (push to that keeper), `drop` (remove
all and exit), `keep` (exit); end of input (the supervisor is gone) means `keep`.
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

from depthscale.resilience.replica import REPLICATED, Pusher, advertised_addr, replica_root, serve

UNFINISHED = re.compile(r"step_\d+\.tmp")
"""A version a writer had not finished (train/manifest.py names versions `step_N`). Matched
here, not imported: the keeper process imports no torch, so it starts in a blink."""
SNAPSHOT_DIR_ENV = "DEPTHSCALE_SNAPSHOT_DIR"
"""Set by the supervisor for its workers: the directory its keeper owns."""
SNAPSHOT_PEERS_ENV = "DEPTHSCALE_SNAPSHOT_PEERS"
"""Set by a multi-node supervisor: JSON {"node": this node, "keepers": every node's keeper URL}."""
FLUSH_S = 60.0
"""A keeper told to keep its snapshots (the job gave up) first finishes the copy to its buddy
in flight, for at most this long."""
FETCHED = ".fetched"
"""Under a node's root: the files a restart fetched from other nodes' keepers (swept)."""
SHM = Path("/dev/shm")


def snapshot_dir(run_path: Path, node: int = 0, base: Path = SHM) -> Path:
    """A node's snapshot directory in shared memory: one per run directory, user and node (on
    one host, the simulated nodes of a multi-node drill each have their own, as real ones do)."""
    digest = hashlib.sha1(str(Path(run_path).resolve()).encode()).hexdigest()[:12]
    return base / f"depthscale-{getpass.getuser()}-{digest}-node{node}"


def sweep(root: Path) -> list[str]:
    """Remove unfinished versions (`step_N.tmp/`) under root and the files a restart fetched
    from other nodes (`FETCHED`); their names. Not the copies held for other nodes: their
    keepers push on whatever this node's workers do (replica.py drops a copy cut short)."""
    gone = []
    if not root.is_dir():
        return gone
    for entry in root.iterdir():
        if UNFINISHED.fullmatch(entry.name) or entry.name == FETCHED:
            shutil.rmtree(entry, ignore_errors=True)
            gone.append(entry.name)
    return gone


def drop(root: Path) -> None:
    """Remove a node's snapshots and the copies it holds of others'."""
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(replica_root(root), ignore_errors=True)


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
    parts = next((rec["parts"] for rec in ranks.values() if rec.get("parts")), {})
    copies = [
        f"node {w}'s part from its copy on node {s}"
        for w, (t, s) in parts.items()
        if t == "replica"
    ]
    if copies:
        text += " (" + ", ".join(copies) + ")"
    failed = next((rec["failed"] for rec in ranks.values() if rec.get("failed")), None)
    if failed:
        text += f"; failed verification: {failed[0]}"
    return text, {**fields, "restore": ranks}


class Keeper:
    """The supervisor's handle: start the keeper, restart it once per death with one warning, and
    tell it how the job ended. With `addr` (a multi-node job) the keeper serves its node's
    snapshots there (`url`) and pushes each new one to the buddy named by `buddy`."""

    def __init__(
        self,
        root: Path,
        log: Callable[..., None],
        node: int = 0,
        addr: str | None = None,
        mb_s: float = 1000.0,
    ) -> None:
        self.root = Path(root)
        self._log = log
        self._closing = False
        self.restarts = 0
        self._node, self._addr, self._mb_s = node, addr, mb_s
        self._port = 0
        self._buddy: str | None = None
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)  # before any worker writes
        self._proc = self._start(fresh=True)
        self._watch = threading.Thread(target=self._watch_loop, daemon=True)
        self._watch.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def url(self) -> str | None:
        return f"http://{self._addr}:{self._port}" if self._addr else None

    def _start(self, fresh: bool) -> subprocess.Popen:
        serving = [] if self._addr is None else ["--serve", self._addr, str(self._port)]
        proc = subprocess.Popen(
            [sys.executable, "-m", "depthscale.resilience.keeper", str(self.root),
             "--node", str(self._node), "--mb-s", str(self._mb_s), *serving]
            + (["--sweep"] if fresh else []),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE if serving else None,
            text=True,
            start_new_session=True,  # a Ctrl-C to the job's process group is the supervisor's
        )  # fmt: skip
        if serving:  # its first line: the port it serves on (its predecessor's when free)
            self._port = int(proc.stdout.readline().split()[-1] or 0)
        if self._buddy is not None:
            self._send_to(proc, f"buddy {self._buddy}")
        return proc

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

    @staticmethod
    def _send_to(proc: subprocess.Popen, line: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            proc.stdin.write(line + "\n")
            proc.stdin.flush()

    def _send(self, line: str) -> None:
        self._send_to(self._proc, line)

    def buddy(self, url: str) -> None:
        """Push each new snapshot to the keeper at `url` (another node's) from now on."""
        self._buddy = url
        self._send(f"buddy {url}")

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
            self._proc.wait(FLUSH_S + 10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        if not keep:  # a keeper that could not do it (killed just now): done here
            drop(self.root)


def start_keeper(
    root: Path,
    log: Callable[..., None],
    store,
    node: int,
    nnodes: int,
    store_addr: str,
    mb_s: float,
) -> tuple[Keeper, list[str]]:
    """This node's keeper, and every node's keeper URL (multi-node: restores fetch the parts
    other nodes serve). In a multi-node job it serves its node's snapshots on the address by
    which this node reaches node 0's store, each supervisor publishes its keeper's URL in that
    store (a torch TCPStore) and reads the others', and the keeper pushes to the next node's."""
    if nnodes == 1:
        return Keeper(root, log), []
    keeper = Keeper(root, log, node, advertised_addr(store_addr), mb_s)
    store.set(f"depthscale/keeper/node{node}", keeper.url)
    keepers = [store.get(f"depthscale/keeper/node{k}").decode() for k in range(nnodes)]
    keeper.buddy(keepers[(node + 1) % nnodes])
    return keeper, keepers


def _serve(args: list[str]) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # the supervisor tells it when the job ends
    root = Path(args[0])
    node = int(args[args.index("--node") + 1]) if "--node" in args else 0
    mb_s = float(args[args.index("--mb-s") + 1]) if "--mb-s" in args else 1000.0
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    if "--sweep" in args:
        sweep(root)
        (root / REPLICATED).unlink(missing_ok=True)  # what a buddy held before is not known
    pusher = None
    if "--serve" in args:
        at = args.index("--serve")
        server = serve(root, args[at + 1], int(args[at + 2]))
        print(f"port {server.server_address[1]}", flush=True)
        pusher = Pusher(root, node, mb_s)
    for line in sys.stdin:
        command, _, rest = line.strip().partition(" ")
        if command == "sweep":
            sweep(root)
        elif command == "buddy" and pusher is not None:
            pusher.to(rest)
        elif command == "drop":
            drop(root)
            return
        elif command == "keep":
            if pusher is not None:
                pusher.flush(FLUSH_S)
            return


if __name__ == "__main__":
    _serve(sys.argv[1:])
