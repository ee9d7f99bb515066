"""The worker's side of supervision: a heartbeat thread that publishes what this rank is doing.

Every `period` seconds a daemon thread writes one JSON record to the supervisor's store (the
rendezvous store the supervisor hosts, key `hb/<attempt>/<rank>`): rank, node, pid, step, the
phase and operation in flight, the last collective, loss, tokens/s, RSS, step-time p99, the
progress counter, start-up marks. Two signals in one record, because a thread alone cannot tell a
hung rank from a busy one:

- liveness — a new record at all. A SIGSTOPped or frozen process stops writing (MegaScale: the
  silent rank is the culprit);
- progress — the span recorder's count of ended spans (`observe/spans.py`: data, forward,
  backward, optimizer, every message and collective). A rank asleep in a kernel or blocked in a
  collective keeps its heartbeat but stops its progress; the in-flight span says which.

The span API is the single source: the heartbeat reads the active recorder, the training loop only
reports per-step numbers (`update`); start-up marks come from `observe/startup.py`, compilations
from `compile_watch.py` (a start that compiles for minutes is making progress).

All ranks beat into one store (the supervisor's, node 0's in a multi-node job), so the period
grows with the world: at most `BEATS_PER_S` beats a second reach it (`beat_period`: the configured
0.25 s up to 64 ranks, 2 s at 512). Each record carries its period; the watch's limits follow it.

Fencing: a worker whose supervisor (its parent process) is gone kills itself at the next beat, and
one that cannot reach the store for `fence_s` too, so that a lost supervisor never leaves a group
training on unsupervised (and writing checkpoints) beside a new one.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import datetime
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from depthscale.observe import spans, startup
from depthscale.resilience.compile_watch import COMPILES

SUPERVISOR_ENV = "DEPTHSCALE_SUPERVISOR"
"""host:port of the supervisor's store; set by the supervisor for its workers."""
PERIOD_ENV = "DEPTHSCALE_HEARTBEAT_S"
NODE_ENV = "DEPTHSCALE_NODE_ID"
STACKS_ENV = "DEPTHSCALE_STACKS_DIR"
"""Where `faulthandler` writes this rank's Python stacks when the supervisor sends SIGUSR1."""
BEATS_PER_S = 256.0
"""Heartbeats a second the whole group may send to the one store: a TCPStore serves every call on
one thread, and the watches read each beat back, besides the start-up's own keys."""


def beat_period(heartbeat_s: float, world: int) -> float:
    """Seconds between one rank's beats: `resilience.heartbeat_s`, or longer where `world` ranks
    beating that often would send the store more than BEATS_PER_S beats a second."""
    return max(heartbeat_s, world / BEATS_PER_S)


def node_id() -> str:
    """This process's node: `DEPTHSCALE_NODE_ID` (set by the supervisor; drills simulate several
    nodes on one host with it), else the host name."""
    return os.environ.get(NODE_ENV) or socket.gethostname()


def heartbeat_key(attempt: int, rank: int) -> str:
    return f"hb/{attempt}/{rank}"


def diagnostics_key(attempt: int) -> str:
    """Where a restarted group's rank 0 publishes every rank's diagnostics row."""
    return f"diag/{attempt}"


def rss_mb() -> float:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6
    except (OSError, ValueError, IndexError):
        return 0.0


class Heartbeat:
    """Publishes this rank's record every `period` s from a daemon thread (see the module doc)."""

    def __init__(
        self,
        address: str,
        rank: int,
        attempt: int,
        period: float = 0.25,
        fence_s: float = 30.0,
    ) -> None:
        import torch.distributed as dist

        host, port = address.rsplit(":", 1)
        self.store = dist.TCPStore(
            host,
            int(port),
            is_master=False,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=max(2.0, 4 * period)),
        )
        self.key = heartbeat_key(attempt, rank)
        self.supervisor_pid = os.getppid()
        self.period, self.fence_s = period, fence_s
        self.fields: dict[str, Any] = {
            "rank": rank,
            "node": node_id(),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "attempt": attempt,
            "step": 0,
        }
        self.steps: collections.deque[float] = collections.deque(maxlen=100)
        self.probes: dict[str, Callable[[], Any]] = {}
        self.seq = 0
        self._progress_without_spans = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="depthscale-heartbeat", daemon=True)
        _dump_stacks_on_sigusr1()
        self._thread.start()
        atexit.register(self.close)

    @classmethod
    def from_env(cls, rank: int, attempt: int) -> Heartbeat | None:
        """The heartbeat of a supervised worker; None when no supervisor started this process."""
        address = os.environ.get(SUPERVISOR_ENV)
        if not address:
            return None
        world = int(os.environ.get("WORLD_SIZE", "1"))
        return cls(
            address, rank, attempt, beat_period(float(os.environ.get(PERIOD_ENV, "0.25")), world)
        )

    # ------------------------------------------------------------------ called by the trainer

    def update(self, step_seconds: float | None = None, **fields: Any) -> None:
        """Per-step numbers (step, loss, tokens_per_s, events); `step_seconds` feeds the p99."""
        if step_seconds is not None:
            self.steps.append(step_seconds)
        self.fields.update(fields)
        self._progress_without_spans += 1

    def probe(self, name: str, read: Callable[[], Any]) -> None:
        """Publish `read()` as field `name` at every beat, not only at step ends: what must be
        seen while the main thread is busy or stuck (a background save still in flight)."""
        self.probes[name] = read

    def publish_diagnostics(self, report: str) -> None:
        """Rank 0 of a restarted group: every rank's diagnostics rows, for the supervisor."""
        self.store.set(diagnostics_key(self.fields["attempt"]), report)

    def close(self, state: str = "exiting") -> None:
        """Stop beating, after a last record saying so: the interpreter's shutdown (which stops
        daemon threads first) can take seconds, and a silent exiting rank is not a frozen one."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=2 * self.period + 1)
        self.fields["state"] = state
        with contextlib.suppress(Exception):
            self.store.set(self.key, json.dumps(self.record(), default=str))

    # ------------------------------------------------------------------ the thread

    def record(self) -> dict[str, Any]:
        rec = spans.active()
        if rec is not None:
            flight = rec.in_flight()
            progress = rec.progress
            last = flight[-1] if flight else None
            collective = next((f for f in reversed(flight) if f.get("cat") == "collective"), None)
        else:
            progress, last, collective = self._progress_without_spans, None, None
        blocked = main_thread_blocked_in()
        waiting = bool(last and last.get("waiting")) or blocked is not None
        steps = sorted(self.steps)
        p99 = steps[min(len(steps) - 1, int(0.99 * len(steps)))] if steps else None
        probed = {}
        for name, read in self.probes.items():
            with contextlib.suppress(Exception):  # a probe must never stop the beat
                probed[name] = read()
        self.seq += 1
        return {
            **self.fields,
            **probed,
            **COMPILES.snapshot(),
            "seq": self.seq,
            "period": self.period,
            "time": time.time(),
            "progress": progress,
            "phase": last["name"] if last else None,
            "waiting": waiting,
            "in_flight": last,
            "blocked_in": blocked,
            "collective": collective,
            "step_p99_s": p99,
            "rss_mb": round(rss_mb(), 1),
            "process_start": startup.process_start_time(),
            "marks": startup.marks(),
        }

    def _run(self) -> None:
        unreachable_since: float | None = None
        while not self._stop.is_set():
            if os.getppid() != self.supervisor_pid:  # the supervisor (our parent) died
                self._fence("its supervisor process is gone")
            COMPILES.install()  # once something has loaded dynamo
            try:
                self.store.set(self.key, json.dumps(self.record(), default=str))
                unreachable_since = None
            except Exception:  # the store is unreachable (node 0's supervisor is gone)
                now = time.monotonic()
                unreachable_since = unreachable_since or now
                if now - unreachable_since > self.fence_s:
                    self._fence(f"the supervisor's store was unreachable for {self.fence_s:g} s")
                self._stop.wait(1.0)  # each failed call makes torch log a stack trace: not 4/s
                continue
            self._stop.wait(self.period)

    def _fence(self, why: str) -> None:
        """A group must not train on unsupervised beside the one a new supervisor starts."""
        print(f"depthscale: rank {self.fields['rank']}: {why}; stopping", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


_COMMUNICATION = ("torch/distributed/",)
_COMPUTE_UNDER_DISTRIBUTED = ("torch/distributed/tensor/_dispatch", "torch/distributed/tensor/_ops")


def main_thread_blocked_in() -> str | None:
    """The torch.distributed call the main thread is inside now ("file:line function"), if any.

    Collectives issued by torch itself (FSDP's all-gathers and reduce-scatters, DTensor
    redistributions) have no depthscale span; a rank blocked in one shows it in its innermost
    Python frame, which the C++ collective was called from. DTensor's op dispatch is compute, not
    communication. A rank that is computing (or asleep in a kernel) has another innermost frame."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return None
    name = frame.f_code.co_filename.replace(os.sep, "/")
    if any(c in name for c in _COMMUNICATION) and not any(
        c in name for c in _COMPUTE_UNDER_DISTRIBUTED
    ):
        short = name.split("torch/distributed/", 1)[1]
        return f"torch.distributed {short}:{frame.f_lineno} {frame.f_code.co_name}"
    return None


def _dump_stacks_on_sigusr1() -> None:
    """Python stacks of every thread, written by faulthandler in C: it works while the main thread
    is blocked inside a collective, where no Python signal handler could run."""
    import faulthandler

    directory = os.environ.get(STACKS_ENV)
    if not directory:
        return
    os.makedirs(directory, exist_ok=True)
    rank = os.environ.get("RANK", "0")
    # appended, each process under a header: attempts are numbered from 0 in every invocation, so
    # a later start (one with nothing to do, even) truncated the stacks an earlier fault left here
    fh = open(os.path.join(directory, f"rank{rank}.txt"), "a")  # noqa: SIM115 (lives with the process)
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
    fh.write(f"--- rank {rank}, pid {os.getpid()}, started {started}\n")
    fh.flush()
    faulthandler.register(signal.SIGUSR1, file=fh, all_threads=True, chain=False)
