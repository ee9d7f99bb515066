"""The buddy replica: each node's keeper copies its committed snapshots to another node's keeper.

A snapshot lives in the memory of the node that wrote it (train/snapshot.py); a node lost whole
(its power, its kernel) takes that memory with it. So each keeper (keeper.py) also runs a small
HTTP server on its node, and a pusher thread that sends every newly committed version of its own
node to the keeper of the next node (node k's buddy is node k+1 mod N), over the network, never
through the job's collectives, at most `checkpoint.replica_mb_s`. The same server hands snapshot
files to the ranks of other nodes when a restart reads them (`Fetcher` in train/snapshot.py).

    GET  /own/step_N/FILE                  a committed version of this node
    GET  /replica/nodeK/step_N/FILE        the copy this node holds of node K's
    PUT  /replica/nodeK/step_N/FILE        a pushed file (into step_N.tmp/, hashed as it arrives)
    POST /replica/nodeK/step_N             commit: every file of node K's part and the shared ones
                                           must match the pushed manifest, then step_N.tmp/ is
                                           renamed into place and the older copies removed

A copy is committed the way a version is: only once every file is in and matches its SHA-256 in
the manifest; a push cut short leaves the previous copy. Once a copy is committed, the pusher
records its step in the node's root (`.replicated`), which the snapshot writer reads to decide
which versions the node may drop (checkpoint_write._prune_node).

No torch here: the keeper starts in a blink and outlives the workers.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPLICATED = ".replicated"
"""In a node's snapshot root: the newest step its keeper has copied to the buddy."""
MANIFEST = "manifest.json"  # train/manifest.py's name (not imported: that module needs torch)
VERSION = re.compile(r"step_\d+")
FILE = re.compile(r"[A-Za-z0-9_.\-]+")
CHUNK = 1 << 20


def replica_root(root: Path) -> Path:
    """Where a node's keeper holds the copies of other nodes' snapshots (beside its own)."""
    return root.with_name(root.name + ".replica")


def replicated_step(root: Path) -> int | None:
    """The newest step this node's keeper has copied to its buddy, or None."""
    try:
        return int((Path(root) / REPLICATED).read_text())
    except (OSError, ValueError):
        return None


def committed_versions(root: Path) -> list[Path]:
    """The committed versions under root (a `step_N` directory with its manifest), oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if VERSION.fullmatch(p.name) and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def node_part(manifest: dict, node: int) -> dict[str, dict]:
    """The entries of the files node `node` holds of a version: its ranks' and the shared ones."""
    return {k: e for k, e in manifest["files"].items() if e.get("node", node) == node}


# ---------------------------------------------------------------------------- serving


class _Handler(BaseHTTPRequestHandler):
    server: Server

    def log_message(self, *args) -> None:  # the supervisor's log says what matters
        pass

    def _where(self) -> tuple[Path, str | None] | None:
        """(directory, file) the request names, or None if it names nothing we serve."""
        parts = self.path.strip("/").split("/")
        if len(parts) in (2, 3) and parts[0] == "own" and VERSION.fullmatch(parts[1]):
            base, rest = self.server.root, parts[1:]
        elif (
            len(parts) in (3, 4)
            and parts[0] == "replica"
            and re.fullmatch(r"node\d+", parts[1])
            and VERSION.fullmatch(parts[2])
        ):
            base, rest = replica_root(self.server.root) / parts[1], parts[2:]
        else:
            return None
        name = rest[1] if len(rest) == 2 else None
        if name is not None and (not FILE.fullmatch(name) or name in (".", "..")):
            return None
        return base / rest[0], name

    def _reply(self, code: int, text: str = "") -> None:
        body = text.encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        where = self._where()
        if where is None or where[1] is None:
            return self._reply(404, "not served")
        version, name = where
        file = version / name  # committed versions only: a .tmp directory is never named here
        if not file.is_file():
            return self._reply(404, f"{file.name} is not here")
        with open(file, "rb") as f:
            self.send_response(200)
            self.send_header("Content-Length", str(os.fstat(f.fileno()).st_size))
            self.end_headers()
            shutil.copyfileobj(f, self.wfile, CHUNK)

    def do_PUT(self) -> None:
        where = self._where()
        if where is None or where[1] is None or not self.path.startswith("/replica/"):
            return self._reply(404, "not served")
        version, name = where
        tmp = version.with_name(version.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        left = int(self.headers.get("Content-Length", "0"))
        digest = hashlib.sha256()
        with open(tmp / name, "wb") as out:
            while left:
                chunk = self.rfile.read(min(CHUNK, left))
                if not chunk:
                    break
                digest.update(chunk)
                out.write(chunk)
                left -= len(chunk)
        self.server.digests[str(tmp / name)] = digest.hexdigest()
        self._reply(200 if left == 0 else 400, "" if left == 0 else "cut short")

    def do_POST(self) -> None:
        where = self._where()
        if where is None or where[1] is not None or not self.path.startswith("/replica/"):
            return self._reply(404, "not served")
        version = where[0]
        node = int(version.parent.name[4:])
        problem = self.server.commit(version, node)
        self._reply(200 if problem is None else 409, problem or "")


class Server(ThreadingHTTPServer):
    """The keeper's HTTP server: its node's snapshots and the copies it holds, read-only; pushed
    copies in, committed only when whole."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, root: Path, addr: str, port: int = 0) -> None:
        self.root = Path(root)
        self.digests: dict[str, str] = {}
        self._lock = threading.Lock()
        super().__init__((addr, port), _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def commit(self, version: Path, node: int) -> str | None:
        """Publish a pushed copy if every file of the node's part matches the manifest; the
        reason otherwise (the copy is dropped)."""
        tmp = version.with_name(version.name + ".tmp")
        with self._lock:
            problem = self._check(tmp, node)
            if problem is not None:
                shutil.rmtree(tmp, ignore_errors=True)
                return problem
            if version.exists():
                shutil.rmtree(version)
            tmp.rename(version)
            for old in version.parent.iterdir():  # older copies, and pushes cut short
                if old != version:
                    shutil.rmtree(old, ignore_errors=True)
            for key in [k for k in self.digests if k.startswith(str(tmp) + "/")]:
                del self.digests[key]
        return None

    def _check(self, tmp: Path, node: int) -> str | None:
        try:
            manifest = json.loads((tmp / MANIFEST).read_bytes())
            part = node_part(manifest, node)
        except (OSError, ValueError, KeyError, AttributeError) as err:
            return f"{MANIFEST} of the copy cannot be read ({err})"
        for name, entry in sorted(part.items()):
            file = tmp / name
            if not file.is_file():
                return f"{name} was not received"
            if file.stat().st_size != entry.get("bytes"):
                return f"{name} has {file.stat().st_size} bytes, its manifest says {entry['bytes']}"
            if self.digests.get(str(file)) != entry.get("sha256"):
                return f"{name} is corrupt (its SHA-256 differs from the manifest's)"
        return None


def serve(root: Path, addr: str, port: int = 0) -> Server:
    """Start the server on a daemon thread; bound to `port` when free (a restarted keeper keeps
    its predecessor's, so the URLs the other nodes hold stay good), else to any."""
    try:
        server = Server(root, addr, port)
    except OSError:
        server = Server(root, addr, 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


# ---------------------------------------------------------------------------- pushing


class Pusher:
    """Copies each newly committed version of this node (`root`, node `node`) to the buddy's
    keeper at `url`, at most `mb_s` MB/s; records the step once the buddy has committed it."""

    def __init__(self, root: Path, node: int, mb_s: float, say=None) -> None:
        self.root, self.node, self.rate = Path(root), node, mb_s * 1e6
        self.url: str | None = None
        self._say = say or (lambda text: print(f"depthscale: keeper: {text}", file=sys.stderr))
        self._warned: str | None = None
        self._wake = threading.Event()
        threading.Thread(target=self._loop, daemon=True).start()

    def to(self, url: str) -> None:
        self.url = url.rstrip("/")
        self._wake.set()

    def flush(self, timeout: float) -> None:
        """Wait (at most `timeout` s) until the newest committed version is with the buddy: a
        job that gives up leaves its copies complete for the requeued one."""
        deadline = time.monotonic() + timeout
        while self.url is not None and time.monotonic() < deadline:
            versions = committed_versions(self.root)
            done = replicated_step(self.root)
            if not versions or (done is not None and done >= int(versions[-1].name[5:])):
                return
            if self._warned is not None:  # the buddy refuses or is gone: no use waiting
                return
            time.sleep(0.05)

    def _loop(self) -> None:
        while True:
            self._wake.wait(0.2)
            self._wake.clear()
            if self.url is None:
                continue
            versions = committed_versions(self.root)
            if not versions:
                continue
            newest = versions[-1]
            step = int(newest.name[5:])
            if replicated_step(self.root) is not None and replicated_step(self.root) >= step:
                continue
            problem = self._push(newest)
            if problem is None:
                _write_atomic(self.root / REPLICATED, str(step))
                self._warned = None
            elif problem != self._warned and newest.exists():
                self._warned = problem
                self._say(f"warning: snapshot {newest.name} not copied to the buddy: {problem}")

    def _push(self, version: Path) -> str | None:
        base = f"{self.url}/replica/node{self.node}/{version.name}"
        try:
            names = sorted(p.name for p in version.iterdir())
            for name in sorted(names, key=lambda n: n == MANIFEST):  # the manifest last
                self._put(f"{base}/{name}", version / name)
            request = urllib.request.Request(base, data=b"", method="POST")
            with urllib.request.urlopen(request, timeout=60):
                return None
        except urllib.error.HTTPError as err:
            return f"the buddy refused it ({err.read().decode(errors='replace') or err.code})"
        except (OSError, urllib.error.URLError) as err:
            return f"{type(err).__name__}: {err}"

    def _put(self, url: str, file: Path) -> None:
        size = file.stat().st_size
        request = urllib.request.Request(
            url, data=self._paced(file), method="PUT", headers={"Content-Length": str(size)}
        )
        with urllib.request.urlopen(request, timeout=60):
            pass

    def _paced(self, file: Path):
        """The file's bytes, in chunks, no faster than the rate."""
        start, sent = time.monotonic(), 0
        with open(file, "rb") as f:
            while chunk := f.read(CHUNK):
                yield chunk
                sent += len(chunk)
                ahead = sent / self.rate - (time.monotonic() - start)
                if ahead > 0:
                    time.sleep(ahead)


def fetch(url: str, into: Path, entry: dict | None) -> None:
    """GET url into the file `into` (atomically); with `entry`, its size and SHA-256 must match
    (else ValueError naming the difference)."""
    into.parent.mkdir(parents=True, exist_ok=True)
    part = into.with_name(f"{into.name}.{os.getpid()}.part")
    digest = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=60) as response, open(part, "wb") as out:
        while chunk := response.read(CHUNK):
            digest.update(chunk)
            out.write(chunk)
    if entry is not None:
        size = part.stat().st_size
        if size != entry["bytes"] or digest.hexdigest() != entry["sha256"]:
            part.unlink()
            raise ValueError(f"{into.name} from {url} does not match its manifest entry")
    part.replace(into)


def _write_atomic(file: Path, text: str) -> None:
    part = file.with_name(file.name + ".part")
    part.write_text(text)
    part.replace(file)


def advertised_addr(peer: str) -> str:
    """The address of this host that `peer` (node 0's store) reaches it by: the local end of a
    route to it (no packet is sent)."""
    import socket

    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((peer, 1))
        return sock.getsockname()[0]
    return "127.0.0.1"
