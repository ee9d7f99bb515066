"""The checks of `depthscale diagnose`, run on every rank of an initialised gloo/NCCL group.

`run_checks` returns this rank's row: for each check whether it passed, what it measured and, for
a correctness failure, which ranks sent the wrong data. `report.flag_outliers` turns the rows of
all ranks into a verdict per node.

Correctness patterns let a receiver tell *whose* data was wrong: every rank contributes its own
slot of small integers (exact in fp32), zeros elsewhere, so the sum keeps each contribution apart.
Bandwidths are the best of a few timed runs after a warm-up (the best run is the one least
disturbed by other processes on a busy host); collectives report bus bandwidth (nccl-tests'
convention: comparable across group sizes). A slow rank delays every collective, so collective
bandwidth cannot say *who* is slow: the neighbour exchanges and the local checks (memcpy, disk)
localise it.

Fault injection for drills, off by default: `DEPTHSCALE_DIAG_FAULT=KIND@NODE[,KIND@NODE...]`,
KIND one of `slow` (that node's ranks sleep 9× an operation's own time before each timed run, so
its bandwidths read ≥ 10× lower), `wrong` (they corrupt their all-reduce contribution), `hang`
(they stop before the all-to-all check, never to return).
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from depthscale.errors import ConfigError
from depthscale.parallel import p2p

NODE_ENV = "DEPTHSCALE_NODE_ID"
FAULT_ENV = "DEPTHSCALE_DIAG_FAULT"
FAULT_KINDS = ("slow", "wrong", "hang")
TIMED_RUNS = 8
COLLECTIVE_RUNS = 4
"""Fewer for the collectives: each costs every rank, and an injected `slow` sleeps through each."""
SLOW_SLEEP = 9.0
"""`slow` sleeps this many times the operation's own (warm-up) time before each timed run."""
PROBE_BYTES = 4 * 2**20
"""Size of the write+fsync probe file: a few MB, enough to reach the disk, quick to write."""
PROBE_WRITES = 3
"""The best of a few: one fsync often waits behind other processes' writes."""
MB = 1e6

CheckFn = Callable[[], dict]


def node_id() -> str:
    """This process's node: $DEPTHSCALE_NODE_ID (tests simulate several nodes on one host), else
    the hostname."""
    return os.environ.get(NODE_ENV) or socket.gethostname()


def parse_faults(spec: str | None) -> dict[str, set[str]]:
    """`slow@nodeB,wrong@nodeC` → {"nodeB": {"slow"}, "nodeC": {"wrong"}}."""
    faults: dict[str, set[str]] = {}
    for item in filter(None, (part.strip() for part in (spec or "").split(","))):
        kind, _, node = item.partition("@")
        if kind not in FAULT_KINDS or not node:
            raise ConfigError(
                f"{FAULT_ENV}={spec!r}: {item!r} is not allowed; allowed: KIND@NODE with KIND one "
                f"of {', '.join(FAULT_KINDS)}, comma-separated"
            )
        faults.setdefault(node, set()).add(kind)
    return faults


def run_checks(
    ckpt_dir: Path | None,
    size_mb: float,
    node: str,
    on_check: Callable[[str], None] | None = None,
) -> dict:
    """Run every check on this rank (collectively: every rank of the default group calls it) and
    return this rank's row. `on_check(name)` is called as each check starts, so that a supervisor
    can tell which rank stopped where if the run hangs."""
    faults = parse_faults(os.environ.get(FAULT_ENV)).get(node, set())
    device = torch.device("cuda", torch.cuda.current_device()) if _on_cuda() else None
    probe = _Probe(size_mb, device or torch.device("cpu"), "slow" in faults, "wrong" in faults)
    checks: dict[str, CheckFn] = {
        "all_reduce": probe.all_reduce,
        "all_to_all": probe.all_to_all,
        "reduce_scatter": probe.reduce_scatter,
        "send_recv": probe.send_recv,
        "memcpy": probe.memcpy,
    }
    if device is not None:
        checks["h2d"] = lambda: probe.host_device_copy(to_device=True)
        checks["d2h"] = lambda: probe.host_device_copy(to_device=False)
    if ckpt_dir is not None:
        checks["ckpt_write"] = lambda: _write_probe(ckpt_dir, probe.rank)
        checks["free_disk"] = lambda: _free_disk(ckpt_dir)
    results = {}
    for name, check in checks.items():
        if name == "all_to_all" and "hang" in faults:
            while True:  # the injected hang: this rank goes silent, its peers wait in all-to-all
                time.sleep(60)
        if on_check is not None:
            on_check(name)
        results[name] = check()
    return {"rank": probe.rank, "node": node, "world_size": probe.world, "checks": results}


def _on_cuda() -> bool:
    return torch.cuda.is_available() and dist.get_backend() == "nccl"


def _pattern(key: int, n: int, device: torch.device) -> torch.Tensor:
    """Small distinct integers per `key` (a source rank, or a source/destination pair)."""
    i = torch.arange(n, device=device, dtype=torch.float32)
    return torch.remainder(i * 7 + key * 13, 251) + 1


class _Probe:
    def __init__(self, size_mb: float, device: torch.device, slow: bool, wrong: bool) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.elems = max(self.world**2, int(size_mb * MB) // 4)
        self.device, self.slow, self.wrong = device, slow, wrong

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _best_seconds(self, prepare: Callable[[], None], op: Callable[[], None], barrier: bool):
        """Seconds of the best timed run of `op` (COLLECTIVE_RUNS of a collective, started
        together after a barrier, else TIMED_RUNS) after one warm-up; `prepare` refills inputs
        outside the timing."""
        prepare()
        self._sync()
        start = time.perf_counter()
        op()
        self._sync()
        warm = time.perf_counter() - start
        best = float("inf")
        for _ in range(COLLECTIVE_RUNS if barrier else TIMED_RUNS):
            prepare()
            if barrier:
                dist.barrier()
            self._sync()
            start = time.perf_counter()
            if self.slow:
                time.sleep(SLOW_SLEEP * warm)
            op()
            self._sync()
            best = min(best, time.perf_counter() - start)
        return best

    def _verify(self, received: torch.Tensor, expected: Callable[[int], torch.Tensor]) -> list[int]:
        """Source ranks whose slot (row s of `received`) differs from `expected(s)`."""
        return [s for s in range(self.world) if not torch.equal(received[s], expected(s))]

    def _collective(self, seconds: float, nbytes: int, bus: float, bad: list[int]):
        value = nbytes * bus / seconds / MB if self.world > 1 else None
        detail = f"wrong data from rank(s) {bad}" if bad else ""
        return {"ok": not bad, "value": value, "bad_sources": bad, "detail": detail}

    def all_reduce(self) -> dict:
        n, m = self.world, self.elems // self.world
        mine = _pattern(self.rank, m, self.device)
        buf = torch.zeros(n, m, device=self.device)

        def prepare() -> None:
            buf.zero_()
            buf[self.rank] = mine
            if self.wrong:
                buf[self.rank, 0] += 1

        seconds = self._best_seconds(prepare, lambda: dist.all_reduce(buf), barrier=True)
        prepare()
        dist.all_reduce(buf)  # the checked run: the timed ones may have been corrupted in between
        bad = self._verify(buf, lambda s: _pattern(s, m, self.device))
        return self._collective(seconds, buf.numel() * 4, 2 * (n - 1) / n, bad)

    def all_to_all(self) -> dict:
        n, m = self.world, self.elems // self.world
        src = torch.stack([_pattern(self.rank * n + j, m, self.device) for j in range(n)])
        out = torch.empty_like(src)
        seconds = self._best_seconds(
            lambda: None, lambda: dist.all_to_all_single(out, src), barrier=True
        )
        bad = self._verify(out, lambda s: _pattern(s * n + self.rank, m, self.device))
        return self._collective(seconds, src.numel() * 4, (n - 1) / n, bad)

    def reduce_scatter(self) -> dict:
        """The list form: gloo has no `reduce_scatter_tensor`; the list form works on both."""
        n, m = self.world, self.elems // self.world**2
        inputs = [torch.zeros(n, m, device=self.device) for _ in range(n)]
        for j, chunk in enumerate(inputs):
            chunk[self.rank] = _pattern(self.rank * n + j, m, self.device)
        out = torch.empty(n, m, device=self.device)
        seconds = self._best_seconds(
            lambda: None, lambda: dist.reduce_scatter(out, inputs), barrier=True
        )
        bad = self._verify(out, lambda s: _pattern(s * n + self.rank, m, self.device))
        return self._collective(seconds, n * n * m * 4, (n - 1) / n, bad)

    def send_recv(self) -> dict:
        """Each ring neighbour pair (r, r+1) exchanges one message each way, posted as one
        `batch_isend_irecv` in the same order on both sides (NCCL matches per pair in posting
        order; no tags). Pairs run in phases (even r, odd r, and the wrap-around pair when the
        ring is odd) so that a rank is in one exchange at a time and a pair's time is its own:
        in a whole-ring exchange one slow rank delays everyone's batch."""
        n, m = self.world, self.elems
        pairs = sorted({tuple(sorted((r, (r + 1) % n))) for r in range(n)} if n > 1 else set())
        sent = _pattern(self.rank, m, self.device)
        readings: dict[str, float] = {}
        bad: list[int] = []
        for phase in range(3):
            for a, b in pairs:
                if _phase(a, b, n) == phase and self.rank in (a, b):
                    peer = b if self.rank == a else a
                    seconds, got = self._exchange(a, b, sent)
                    readings[f"{a}-{b}"] = m * 4 / seconds / MB
                    if not torch.equal(got, _pattern(peer, m, self.device)):
                        bad.append(peer)
            if phase < 2 and n > 1:
                dist.barrier()
        detail = f"wrong data from rank(s) {bad}" if bad else ""
        return {"ok": not bad, "pairs": readings, "bad_sources": bad, "detail": detail}

    def _exchange(self, a: int, b: int, sent: torch.Tensor):
        """One message each way between a and b, posted as one batch through `parallel/p2p.py`
        (as training's messages are: sends before receives, no tags)."""
        peer = b if self.rank == a else a
        got: list[torch.Tensor] = []

        def op() -> None:
            batch = p2p.post(
                dist.group.WORLD,
                [p2p.Send(sent, peer, "diag")],
                [p2p.Recv(tuple(sent.shape), sent.dtype, peer, "diag")],
                self.device,
                p2p.Traffic(),
            )
            got[:] = [batch.recv("diag")]
            batch.wait()

        return self._best_seconds(lambda: None, op, barrier=False), got[-1]

    def memcpy(self) -> dict:
        src = torch.ones(self.elems)
        dst = torch.empty_like(src)
        seconds = self._best_seconds(lambda: None, lambda: dst.copy_(src), barrier=False)
        return {"ok": True, "value": src.numel() * 4 / seconds / MB, "detail": ""}

    def host_device_copy(self, to_device: bool) -> dict:
        host = torch.ones(self.elems, pin_memory=True)
        dev = torch.empty(self.elems, device=self.device)
        src, dst = (host, dev) if to_device else (dev, host)
        seconds = self._best_seconds(lambda: None, lambda: dst.copy_(src), barrier=False)
        return {"ok": True, "value": host.numel() * 4 / seconds / MB, "detail": ""}


def _phase(a: int, b: int, n: int) -> int:
    """Phase of pair (a, b), a < b: ring pairs (r, r+1) by the parity of r; the wrap-around pair
    (0, n-1) of an odd ring shares a rank with both neighbours' phases, so it gets a third."""
    if b == a + 1:
        return a % 2
    return 2 if n % 2 else 1


def _write_probe(ckpt_dir: Path, rank: int) -> dict:
    """Write PROBE_BYTES, fsync, time it, delete (best of PROBE_WRITES): the checkpoint directory
    takes writes now."""
    path = Path(ckpt_dir) / f".diagnose-rank{rank}-{os.getpid()}.tmp"
    data = os.urandom(PROBE_BYTES)
    seconds = float("inf")
    try:
        Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
        for _ in range(PROBE_WRITES):
            start = time.perf_counter()
            with open(path, "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
            seconds = min(seconds, time.perf_counter() - start)
            path.unlink()
    except OSError as err:
        return {
            "ok": False,
            "value": None,
            "detail": f"{ckpt_dir} is not writable ({err.strerror})",
        }
    return {"ok": True, "value": len(data) / seconds / MB, "detail": ""}


def _free_disk(ckpt_dir: Path) -> dict:
    """Free bytes where checkpoints go (the nearest existing ancestor, if the probe failed)."""
    path = Path(ckpt_dir).absolute()
    while not path.is_dir() and path != path.parent:
        path = path.parent
    try:
        free = shutil.disk_usage(path).free
    except OSError as err:
        return {"ok": False, "value": None, "detail": f"cannot read free space of {path}: {err}"}
    return {"ok": True, "value": free, "detail": str(path)}


DIAGNOSE_ENV = "DEPTHSCALE_DIAGNOSE"
"""Set by the supervisor for a group restarted after a fault: run the checks first (MB per rank)."""


def diagnose_in_group(ckpt_dir: Path, publish: Callable[[str], None]) -> None:
    """The checks, run by a restarted training group itself right after its process group is up
    (every rank calls this), instead of in a group of its own: a restart then pays no second
    launch. Rank 0 gathers the rows and `publish`es them as JSON; the supervisor judges them
    (`diagnose.verdict`) and stops the group if a node fails."""
    import json

    size_mb = float(os.environ.get(DIAGNOSE_ENV) or 4)
    row = run_checks(ckpt_dir, size_mb, node_id())
    rows = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(row, rows, dst=0)
    if rows is not None:
        publish(json.dumps({"size_mb": size_mb, "rows": rows}))
