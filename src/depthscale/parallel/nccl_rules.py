"""Replay recorded point-to-point traffic under NCCL's rules: would it deadlock or mis-pair?

Our multi-process tests run on gloo, which cannot show what NCCL would do with the same calls. This
module replays what every rank posted (`depthscale.parallel.p2p.recording`, or any trace in that
form) under NCCL's semantics, conservatively:

* **matching**: no tags. Between a sender and a receiver on one communicator, the k-th send pairs
  with the k-th receive. Unbatched operations run on a two-rank communicator per pair, batched
  groups on the group's own, so the two never pair with each other.
* **streams**: a rank's unbatched operations with one peer share one stream; its batched groups
  share the group's stream. A stream runs its units (a single operation, or a whole group) one at a
  time in posting order, and a unit occupies the stream until every operation in it has met its
  partner — a send may not complete before its receive runs (large messages never do).
* **groups are atomic**: the operations of a group run together and the group ends when all have.
* **hosts**: a rank posts in program order without blocking and blocks at a `wait` until the waited
  unit has ended (the receive's consumer, or a send whose buffer is to be freed).

`replay(traces)` runs that model to the end and reports a deadlock (who waits on what), any pair
whose labels or sizes differ (a message landing in the wrong buffer), and operations never matched.
"""

from __future__ import annotations

import json
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class _Op:
    kind: str  # "send" | "recv"
    rank: int
    peer: int
    label: str
    nbytes: int
    unit: _Unit
    partner: _Op | None = None
    done: bool = False

    def __str__(self) -> str:
        arrow = "->" if self.kind == "send" else "<-"
        return f"{self.kind} {self.label!r} {arrow} {self.peer} ({self.nbytes} B)"


@dataclass
class _Unit:
    rank: int
    uid: object
    stream: tuple
    ops: list[_Op] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return all(op.done for op in self.ops)


@dataclass
class Report:
    deadlock: str | None = None
    mispaired: list[str] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)
    messages: int = 0

    @property
    def ok(self) -> bool:
        return self.deadlock is None and not self.mispaired and not self.unmatched

    def __str__(self) -> str:
        if self.ok:
            return f"ok: {self.messages} messages, no deadlock, every pair as intended"
        lines = []
        if self.deadlock:
            lines.append(f"deadlock:\n{self.deadlock}")
        lines += [f"mis-paired: {m}" for m in self.mispaired[:10]]
        lines += [f"never matched: {m}" for m in self.unmatched[:10]]
        return "\n".join(lines)


def replay(traces: list[list[dict]]) -> Report:
    """Replay per-rank event lists (index = global rank) under NCCL's rules."""
    report = Report()
    pc = [0] * len(traces)
    units: dict[tuple[int, object], _Unit] = {}
    streams: dict[tuple[int, tuple], deque[_Unit]] = defaultdict(deque)
    sends: dict[tuple, list[_Op]] = defaultdict(list)
    recvs: dict[tuple, list[_Op]] = defaultdict(list)

    def post(rank: int, event: dict) -> None:
        group = tuple(event.get("group", ()))
        batched = event.get("batched", True)
        ops = event["ops"]
        if not batched and len(ops) != 1:
            raise ValueError(f"rank {rank}: unbatched post {event['post']} has {len(ops)} ops")
        stream = ("group", group) if batched else ("pair", group, *sorted((rank, ops[0][1])))
        unit = units[(rank, event["post"])] = _Unit(rank, event["post"], stream)
        if ops:  # an empty group is done at once
            streams[(rank, stream)].append(unit)
        for kind, peer, label, nbytes in ops:
            op = _Op(kind, rank, peer, label, nbytes, unit)
            unit.ops.append(op)
            comm = (group, batched)
            src, dst = (rank, peer) if kind == "send" else (peer, rank)
            mine, theirs = (sends, recvs) if kind == "send" else (recvs, sends)
            mine[(comm, src, dst)].append(op)
            k = len(mine[(comm, src, dst)]) - 1
            if k < len(theirs[(comm, src, dst)]):
                _pair(op, theirs[(comm, src, dst)][k], report)

    def advance_hosts() -> bool:
        moved = False
        for rank, events in enumerate(traces):
            while pc[rank] < len(events):
                event = events[pc[rank]]
                if "post" in event:
                    post(rank, event)
                else:
                    unit = units.get((rank, event["wait"]))
                    if unit is None:
                        raise ValueError(f"rank {rank} waits on {event['wait']} before posting it")
                    if not unit.done:
                        break
                pc[rank] += 1
                moved = True
        return moved

    def run_streams() -> bool:
        moved = False
        for queue in list(streams.values()):
            while queue:
                head = queue[0]
                for op in head.ops:
                    p = op.partner
                    if op.done or p is None:
                        continue
                    peer_queue = streams[(p.rank, p.unit.stream)]
                    if peer_queue and peer_queue[0] is p.unit:
                        op.done = p.done = True
                        moved = True
                if not head.done:
                    break
                queue.popleft()
                moved = True
        return moved

    while advance_hosts() | run_streams():
        pass

    report.messages = sum(len(v) for v in sends.values())
    stuck = [r for r, events in enumerate(traces) if pc[r] < len(events)]
    busy = {k: q for k, q in streams.items() if q}
    if stuck or busy:
        report.deadlock = _describe(traces, pc, stuck, busy)
    for key in set(sends) | set(recvs):
        s, r = sends.get(key, []), recvs.get(key, [])
        for op in s[len(r) :] + r[len(s) :]:
            report.unmatched.append(f"rank {op.rank}: {op}")
    return report


def _pair(a: _Op, b: _Op, report: Report) -> None:
    a.partner, b.partner = b, a
    send, recv = (a, b) if a.kind == "send" else (b, a)
    if send.label != recv.label or send.nbytes != recv.nbytes:
        report.mispaired.append(
            f"rank {recv.rank} receives {recv.label!r} ({recv.nbytes} B) from rank {send.rank}, "
            f"which sent {send.label!r} ({send.nbytes} B) in that place"
        )


def _describe(traces, pc, stuck, busy) -> str:
    lines = []
    for rank in stuck:
        lines.append(f"  rank {rank} blocks at wait {traces[rank][pc[rank]]['wait']}")
    for (rank, stream), queue in sorted(busy.items(), key=lambda kv: kv[0][0]):
        head = queue[0]
        pending = ", ".join(str(op) for op in head.ops if not op.done)
        lines.append(f"  rank {rank} stream {stream[0]}{stream[2:]}: head waits for [{pending}]")
    return "\n".join(lines)


def load(path: str | Path) -> list[list[dict]]:
    return json.loads(Path(path).read_text())


def save(traces: list[list[dict]], path: str | Path) -> None:
    Path(path).write_text(json.dumps(traces, separators=(",", ":")))
