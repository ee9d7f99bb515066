"""Always-on spans: what each rank did when, written per rank without ever making training wait.

One API for every producer — the trainer's phases, the pipeline runtime, ring attention, the
collectives — and every consumer: the merged timeline (`observe/timeline.py`), the online straggler
detector (`observe/stragglers.py`) and the hang dumps (`observe/watchdog.py`). The file format is
documented in docs/observability.md.

    with spans.span("forward", mb=3):        # a no-op when no recorder is active
        ...
    op = spans.begin("send", "pp", peer=2, label="step 4: F3 0>1", bytes=4096)
    ...
    spans.end(op)                            # begins and ends need not nest (posted messages)

Costs on the hot path (~5 µs a span on CPU): three clock reads, one small object and an append
to a bounded buffer; the record's JSON encoding and the file writes happen on a background thread, and when that thread falls behind
events are dropped and counted, never waited for. Nothing here synchronises a device: on CUDA a
compute span's duration comes from a pair of CUDA events that the writer thread resolves — after
making the rank's GPU its current device: CUDA's current device is per thread, 0 in a new one, and
an event synchronised from a thread that never chose one opened a context on GPU 0 (~0.5 GB) for
every rank of the node.

"Busy" time (`take_busy`) is what the straggler detector compares across ranks: the time a rank
itself worked in a phase, waits for peers excluded. On CPU that is the thread's CPU time
(`time.thread_time_ns`), which does not advance while gloo blocks in a collective or a receive —
so a rank that only waits for a slow peer is not blamed; `data` is the wall time spent waiting for
the next batch. On CUDA it is the compute spans' event durations, one step behind (the events of
step s are complete once step s's loss has reached the host).

This module imports nothing else from depthscale, so any layer may record (see test_layering).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BUSY_PHASES = ("data", "forward", "backward", "optimizer")
"""The phases whose per-step busy time every rank reports (the straggler detector's input)."""

SKEW_ENV = "DEPTHSCALE_CLOCK_SKEW_MS"
"""Drills only: `RANK:MS[,RANK:MS...]` shifts those ranks' span clocks, as different hosts' clocks
differ; the merge must measure and undo it."""

SLOW_ENV = "DEPTHSCALE_INJECT_SLOW"
"""Drills only: `RANK:FROM_STEP:AMOUNT[:PHASE,...]` makes that rank slow from that step on, as a
failing device would: AMOUNT is `20%` (each span of the phase works that much longer, spinning —
busy, as a slow device is) or `30ms` (that much more per span; slept in the `data` phase, where
a slow loader keeps the rank waiting). Phases: forward,backward by default."""

HANG_ENV = "DEPTHSCALE_INJECT_HANG"
"""Drills only: `RANK:STEP:OP` stops that rank (SIGSTOP, as a hung device or host would) when it is
about to begin OP — a span name: `all_reduce`, `recv`, `send`, `forward`, ... — at or after STEP.
Its peers then wait in what they were doing, time out and dump; the stopped rank writes nothing."""


def _hang_point(rank: int) -> tuple[int, str] | None:
    spec = os.environ.get(HANG_ENV, "")
    if not spec:
        return None
    try:
        at, step, op = spec.split(":")
        return (int(step), op) if int(at) == rank else None
    except ValueError:
        raise ValueError(f"{HANG_ENV}={spec!r} must look like RANK:STEP:OP") from None


def clock_skew_ns(rank: int) -> int:
    """This rank's injected clock shift (`DEPTHSCALE_CLOCK_SKEW_MS`), in ns; 0 without one."""
    spec = os.environ.get(SKEW_ENV, "")
    for item in filter(None, (part.strip() for part in spec.split(","))):
        try:
            at, ms = item.split(":")
            if int(at) == rank:
                return round(float(ms) * 1e6)
        except ValueError:
            raise ValueError(f"{SKEW_ENV}={spec!r} must look like RANK:MS[,RANK:MS...]") from None
    return 0


class Slowdown:
    """A parsed SLOW_ENV for one rank (None when it does not apply)."""

    def __init__(self, from_step: int, fraction: float, extra_ns: int, phases: tuple[str, ...]):
        self.from_step, self.fraction, self.extra_ns, self.phases = (
            from_step,
            fraction,
            extra_ns,
            phases,
        )

    @classmethod
    def from_env(cls, rank: int) -> Slowdown | None:
        spec = os.environ.get(SLOW_ENV, "")
        if not spec:
            return None
        try:
            at, step, amount, *rest = spec.split(":")
            phases = tuple(rest[0].split(",")) if rest else ("forward", "backward")
            if amount.endswith("%"):
                fraction, extra = float(amount[:-1]) / 100, 0
            elif amount.endswith("ms"):
                fraction, extra = 0.0, round(float(amount[:-2]) * 1e6)
            else:
                raise ValueError(amount)
            if not set(phases) <= set(BUSY_PHASES) or len(rest) > 1:
                raise ValueError(phases)
            return cls(int(step), fraction, extra, phases) if int(at) == rank else None
        except ValueError:
            raise ValueError(
                f"{SLOW_ENV}={spec!r} must look like RANK:FROM_STEP:20%[:forward,backward] or "
                f"RANK:FROM_STEP:30ms:data (phases: {', '.join(BUSY_PHASES)})"
            ) from None

    def apply(self, o: Open) -> None:
        """Stretch span `o`, about to end."""
        if o.name not in self.phases or o.step < self.from_step:
            return
        if o.name == "data":
            time.sleep(self.extra_ns / 1e9)
            return
        spin = self.extra_ns + self.fraction * (time.thread_time_ns() - o.cpu)
        t0 = time.thread_time_ns()
        while time.thread_time_ns() - t0 < spin:
            pass


def trace_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / "trace" / f"rank{rank:05d}.jsonl"


def trace_files(run_dir: Path, folder: Path | None = None) -> list[Path]:
    """The run's per-rank trace files (in `folder`: an archived attempt's, default RUN/trace); a
    ValueError naming the folder when there are none."""
    trace = Path(folder) if folder is not None else Path(run_dir) / "trace"
    files = sorted(trace.glob("rank*.jsonl"))
    if not files:
        raise ValueError(
            f"{trace} holds no rank*.jsonl trace files: train the run with logging.trace = true "
            "(the default) first"
        )
    return files


def read_trace_file(path: Path) -> tuple[dict, list[tuple[int, dict]]]:
    """(the meta record, [(line number, record), ...]) of one rank's file. A cut last line (the
    writer of a killed run) is left out; any other damage is a ValueError naming file and line."""
    lines = Path(path).read_bytes().decode("utf-8", errors="replace").splitlines()  # bytes
    records = []  # that are not text fail below as JSON, named by file and line
    for n, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines) and n > 1:
                break
            raise ValueError(f"{path}:{n} is not a JSON record") from None
        if not isinstance(record, dict) and n > 1:
            raise ValueError(f"{path}:{n} is not a JSON object")
        records.append((n, record))
    if not records:
        raise ValueError(f"{path} is empty")
    meta = records[0][1]
    if (
        not isinstance(meta, dict)
        or meta.get("kind") != "meta"
        or not isinstance(meta.get("rank"), int)
    ):
        raise ValueError(f"{path}:1: the first record must be the meta line with a rank")
    return meta, records[1:]


class Open:
    """A span that has begun: `end()` it (or leave its `with` block)."""

    __slots__ = ("name", "cat", "args", "ts", "cpu", "event", "step", "dur", "end_event")

    def __init__(self, name: str, cat: str, args: dict, ts: int, cpu: int, event, step: int):
        self.name, self.cat, self.args, self.ts = name, cat, args, ts
        self.cpu, self.event, self.step = cpu, event, step
        self.dur, self.end_event = None, None

    def as_record(self) -> dict:
        return {"name": self.name, "cat": self.cat, "ts": self.ts, "step": self.step, **_args(self)}

    def as_span(self) -> dict:
        """The file's record of this ended span (on CUDA: its duration from its events)."""
        dur = self.dur
        if self.end_event is not None:
            self.end_event.synchronize()  # on the writer thread, never the training thread
            dur = round(self.event.elapsed_time(self.end_event) * 1e6)
        return {"kind": "span", **self.as_record(), "dur": dur}


def _args(o: Open) -> dict:
    return {"args": o.args} if o.args else {}


class SpanRecorder:
    """This rank's recorder: spans to `path` (JSONL) through a background writer.

    `meta` (rank, world, coordinates, ...) is the file's first line. The writer wakes every
    `flush_s` seconds, not per event: a thread woken 30 times a step preempts the compute threads
    (two cores running two intra-op threads) and cost 4.7 % of a CPU step in
    `benchmarks/timeline_overhead.py`. `queue_size` bounds what it may fall behind by; beyond it
    events are dropped (`dropped` counts them). A killed process loses its last `flush_s`.
    On CUDA the writer runs on GPU `device_index` (default: the creating thread's current device,
    which start-up set to the rank's own)."""

    def __init__(
        self,
        path: Path,
        meta: dict[str, Any],
        *,
        device_type: str = "cpu",
        device_index: int | None = None,
        queue_size: int = 1 << 16,
        recent: int = 200,
        flush_s: float = 0.25,
    ) -> None:
        self.path = Path(path)
        self.meta = dict(meta)
        self.rank = int(meta.get("rank", 0))
        self.skew_ns = clock_skew_ns(self.rank)
        self.slowdown = Slowdown.from_env(self.rank)
        self.hang_at = _hang_point(self.rank)
        self.cuda = device_type == "cuda"
        if self.cuda and device_index is None:
            import torch

            device_index = torch.cuda.current_device()
        self.device_index = device_index
        """The rank's GPU: the writer thread makes it current before it touches an event."""
        self.step = 0
        self.dropped = 0
        self.progress = 0
        """Spans ended so far: the supervisor's progress counter (`resilience/heartbeat.py`)."""
        self.recent: collections.deque[Open] = collections.deque(maxlen=recent)
        """The last ended spans, for hang dumps (`recent_records`)."""
        self._open: dict[int, Open] = {}  # id → begun, not ended (what a hang dump shows)
        self._waiting: set[int] = set()  # ids of the open spans this rank is blocked on now
        self._busy: dict[str, int] = dict.fromkeys(BUSY_PHASES, 0)
        self._wall: dict[str, int] = dict.fromkeys((*BUSY_PHASES, "step"), 0)
        self._pending_busy: list[tuple[str, Any, Any]] = []  # CUDA: (phase, start, end) events
        self._last_progress = self.now_ns()
        # appended by the training thread, popped by the writer: deque operations are atomic
        self._pending: collections.deque[Open | dict] = collections.deque()
        self._queue_size = queue_size
        self._flush_s = flush_s
        self._closing = threading.Event()
        self._write_lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 (closed in close())
        self._file.write(json.dumps({"kind": "meta", **self.meta}) + "\n")
        self._file.flush()
        self._writer = threading.Thread(target=self._drain, name="depthscale-spans", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------------ recording

    def now_ns(self) -> int:
        """This rank's span clock (monotonic; shifted in drills, see SKEW_ENV)."""
        return time.perf_counter_ns() + self.skew_ns

    def begin(self, name: str, cat: str = "compute", args: dict | None = None) -> Open:
        if self.hang_at is not None and name == self.hang_at[1] and self.step >= self.hang_at[0]:
            import signal

            os.kill(os.getpid(), signal.SIGSTOP)
        event = None
        if self.cuda and cat == "compute":
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
        cpu = time.thread_time_ns() if name in BUSY_PHASES else 0
        o = Open(name, cat, args or {}, self.now_ns(), cpu, event, self.step)
        self._open[id(o)] = o
        return o

    def end(self, o: Open, **more: Any) -> None:
        if self.slowdown is not None:
            self.slowdown.apply(o)
        now = self.now_ns()
        self._open.pop(id(o), None)
        self._last_progress = now
        self.progress += 1
        if more:
            o.args = {**o.args, **more}
        o.dur = now - o.ts
        if o.name in self._wall:
            self._wall[o.name] += o.dur
            if o.name != "step":
                self._count_busy(o, now)
        if o.event is not None:
            import torch

            o.end_event = torch.cuda.Event(enable_timing=True)
            o.end_event.record()
            if o.name in BUSY_PHASES:
                self._pending_busy.append((o.name, o.event, o.end_event))
        self.recent.append(o)
        self.put(o)

    def _count_busy(self, o: Open, now: int) -> None:
        if o.name == "data":
            self._busy["data"] += now - o.ts
        elif not self.cuda:
            self._busy[o.name] += time.thread_time_ns() - o.cpu

    def put(self, record: dict | Open) -> None:
        """Queue any record (clock, step, straggler, ...) for the file; never blocks."""
        if len(self._pending) < self._queue_size:
            self._pending.append(record)
        else:
            self.dropped += 1

    def recent_records(self) -> list[dict]:
        """The last ended spans as file records (durations as this rank's clock measured them)."""
        return [{"kind": "span", **o.as_record(), "dur": o.dur} for o in list(self.recent)]

    def take_busy(self) -> dict[str, int]:
        """The busy ns per phase since the last call (CUDA: of the spans whose events are done)."""
        if self.cuda:
            still = []
            for phase, start, end in self._pending_busy:
                if end.query():
                    self._busy[phase] += round(start.elapsed_time(end) * 1e6)
                else:
                    still.append((phase, start, end))
            self._pending_busy = still
        busy, self._busy = self._busy, dict.fromkeys(BUSY_PHASES, 0)
        return busy

    def take_wall(self) -> dict[str, int]:
        """Wall ns per phase since the last call, and "waiting": the steps' time outside them
        (communication not hidden, waiting for peers)."""
        wall, self._wall = self._wall, dict.fromkeys((*BUSY_PHASES, "step"), 0)
        step = wall.pop("step")
        wall["waiting"] = max(0, step - sum(wall.values())) if step else 0
        return wall

    # ------------------------------------------------------------------ state for hang dumps

    def in_flight(self) -> list[dict]:
        """Spans begun and not ended, oldest first (copied: safe from another thread); those this
        rank is blocked on right now carry "waiting": true."""
        waiting = set(self._waiting)
        return [
            {**o.as_record(), "waiting": id(o) in waiting or o.cat == "collective"}
            for o in sorted(list(self._open.values()), key=lambda o: o.ts)
        ]

    def idle_ns(self) -> int:
        """Nanoseconds since a span last ended: how long this rank has made no visible progress."""
        return self.now_ns() - self._last_progress

    # ------------------------------------------------------------------ writer

    def _drain(self) -> None:
        if self.device_index is not None:
            import torch

            torch.cuda.set_device(self.device_index)
        stop = False
        while not stop:
            stop = self._closing.wait(self._flush_s)
            self.flush()

    def flush(self, timeout: float = 30.0) -> bool:
        """Write what is queued now (the writer calls it every `flush_s`; the trainer at the end of
        a run). False when another flush held the file for `timeout` s (a hung disk)."""
        if not self._write_lock.acquire(timeout=timeout):
            return False
        try:
            lines = []
            for _ in range(len(self._pending)):  # what is there now; later ones wait a turn
                record = self._pending.popleft()
                if isinstance(record, Open):
                    record = record.as_span()
                lines.append(json.dumps(record, separators=(",", ":")))
            if lines and not self._file.closed:
                self._write("\n".join(lines) + "\n")
        finally:
            self._write_lock.release()
        return True

    def _write(self, text: str) -> None:
        self._file.write(text)
        self._file.flush()

    def close(self) -> None:
        """Write what is queued and the drop count, then stop the writer."""
        if self._file.closed:
            return
        self._closing.set()
        self._writer.join(timeout=30)
        if not self._writer.is_alive():  # else stuck for 30 s (a hung disk): leave the file to it
            self.flush()  # anything put while the writer was stopping
            if self.dropped:
                self._file.write(json.dumps({"kind": "dropped", "n": self.dropped}) + "\n")
            self._file.close()


# --------------------------------------------------------------------------- the active recorder

_active: SpanRecorder | None = None


def activate(recorder: SpanRecorder | None) -> SpanRecorder | None:
    """Make `recorder` the one `span`/`begin`/`end` record into (None: stop); returns the old one."""
    global _active
    old, _active = _active, recorder
    return old


def active() -> SpanRecorder | None:
    return _active


class _Span:
    __slots__ = ("name", "cat", "args", "open")

    def __init__(self, name: str, cat: str, args: dict) -> None:
        self.name, self.cat, self.args, self.open = name, cat, args, None

    def __enter__(self) -> _Span:
        r = _active
        if r is not None:
            self.open = r.begin(self.name, self.cat, self.args)
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        r = _active
        if r is not None and self.open is not None:
            if exc_type is None:
                r.end(self.open)
            else:  # left open, marked: a hang dump written on the way out shows where it failed
                r._waiting.add(id(self.open))


class _Nothing:
    __slots__ = ()

    def __enter__(self) -> _Nothing:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


_NOTHING = _Nothing()


def span(name: str, cat: str = "compute", **args: Any) -> _Span | _Nothing:
    """A span around a `with` block, recorded into the active recorder (if any)."""
    if _active is None:
        return _NOTHING
    return _Span(name, cat, args)


def begin(name: str, cat: str = "compute", **args: Any) -> Open | None:
    """Begin a span that ends elsewhere (`end`); None when nothing records."""
    r = _active
    return None if r is None else r.begin(name, cat, args)


def end(o: Open | None, **more: Any) -> None:
    r = _active
    if r is not None and o is not None:
        r.end(o, **more)


@contextlib.contextmanager
def waiting(opens: list[Open | None]) -> Iterator[None]:
    """Mark begun spans (posted messages) as what this rank is blocked on, for hang dumps."""
    r = _active
    ids = [id(o) for o in opens if o is not None]
    if r is None or not ids:
        yield
        return
    r._waiting.update(ids)
    yield  # an exception leaves them marked: the dump written on the way out shows where
    r._waiting.difference_update(ids)


def set_step(step: int) -> None:
    """The optimizer step now being computed (1-based), stamped on the spans that begin."""
    if _active is not None:
        _active.step = step


_group_names: dict[int, str] = {}
_seq: dict[str, int] = {}


def collective(op: str, group: Any = None, tensor: Any = None) -> _Span | _Nothing:
    """A span around one collective: its group's global ranks ("0,1,2,3"), bytes and sequence
    number in that group, the key by which a hang analysis matches ranks in the same collective.
    All members of a group issue the same collectives in the same order, so the numbers agree."""
    if _active is None:
        return _NOTHING
    where = _group_names.get(id(group))
    if where is None:
        import torch.distributed as dist

        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        where = _group_names[id(group)] = ",".join(map(str, ranks))
    _seq[where] = seq = _seq.get(where, 0) + 1
    nbytes = tensor.numel() * tensor.element_size() if tensor is not None else 0
    return _Span(op, "collective", {"group": where, "seq": seq, "bytes": nbytes})
