"""One timeline for all ranks: the per-rank span files merged into a Perfetto / Chrome trace.

`depthscale trace timeline --run DIR` → RUN/trace/timeline.json; open it in ui.perfetto.dev (or
chrome://tracing). One process per rank, named by its coordinates and sorted by them; one track
per kind of work; an arrow from every message's send to its receive (pipeline activations and
gradients with the AttnRes depth cache, ring-attention K/V and dK/dV); collectives carry their group
and sequence number, which is how a reader finds the other participants.

Clocks: each host's offset to rank 0 comes from the ping-pong at start-up (`parallel/clock_sync`),
an interval that contains the true offset; ranks sharing a host take its measured rank's. Messages
then narrow it: a receive cannot end before its send began, so recv_end_D + off_D ≥
send_start_S + off_S for every message. `align_clocks`
moves offsets (inside their intervals) until every such constraint holds — so no arrow points
back in time — and reports what it could not satisfy.

The file format the ranks write is described in docs/observability.md.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from depthscale.observe.spans import read_trace_file, trace_files

MESSAGE_CATS = ("pp", "cp", "p2p")
MIN_LATENCY_NS = 1_000
"""No message between processes arrives within a microsecond of being sent: the least gap
alignment keeps between a send's start and its receive's end (so an arrow has a length)."""
TRACKS = {"compute": 0, "collective": 1}
"""Fixed tracks (tid) per rank; messages get lanes from tid 10 on (see `_lanes`)."""


@dataclass
class RankTrace:
    rank: int
    meta: dict
    clock: dict = field(default_factory=dict)
    spans: list[dict] = field(default_factory=list)
    dropped: int = 0


@dataclass
class Summary:
    ranks: int
    flows: dict[str, int]
    """Matched messages (arrows) per category."""
    unmatched: list[str]
    """Message ends without their other end (a killed run), described."""
    backward_flows: int
    """Arrows that still point back in time after alignment (0 unless clocks are inconsistent)."""
    offsets_ns: dict[int, int]
    """Per rank: what was added to its timestamps to put them on rank 0's clock."""
    bubble: dict[int, dict[str, float]] = field(default_factory=dict)
    """Per pipeline stage: idle / compute within each step's pipeline window, and (p−1)/(v·m)."""
    dropped: int = 0


def read_rank_files(run_dir: Path, folder: Path | None = None) -> dict[int, RankTrace]:
    """Every rank's trace of the run (of an archived attempt: `folder`, see observe/attempts)."""
    ranks = {}
    for path in trace_files(run_dir, folder):
        trace = _read(path)
        ranks[trace.rank] = trace
    return ranks


def _read(path: Path) -> RankTrace:
    meta, records = read_trace_file(path)
    trace = RankTrace(meta["rank"], meta)
    for n, record in records:
        kind = record.get("kind")
        if kind == "span":
            if not _is_span(record):
                raise ValueError(f"{path}:{n}: a span needs name, cat, ts, dur and step")
            trace.spans.append(record)
        elif kind == "clock":
            trace.clock = record
        elif kind == "dropped":
            trace.dropped = record.get("n", 0)
    return trace


def _is_span(r: dict) -> bool:
    ok = isinstance(r.get("name"), str) and isinstance(r.get("cat"), str)
    ok = ok and all(isinstance(r.get(k), int) for k in ("ts", "dur", "step"))
    args = r.get("args", {})
    if ok and r["cat"] in MESSAGE_CATS:
        return isinstance(args, dict) and "peer" in args and "label" in args
    return ok and isinstance(args, dict)


# --------------------------------------------------------------------------- messages and clocks


def match_messages(ranks: dict[int, RankTrace]) -> tuple[list[tuple], list[str]]:
    """Pairs (src, send span, dst, recv span): the k-th send from S to D labelled L with the k-th
    such receive (labels name messages uniquely; repeats pair in order, as NCCL would)."""
    sends, recvs = defaultdict(list), defaultdict(list)
    for rank, t in ranks.items():
        for s in t.spans:
            if s["cat"] in MESSAGE_CATS:
                a = s["args"]
                if s["name"] == "send":
                    sends[(rank, a["peer"], a["label"])].append(s)
                elif s["name"] == "recv":
                    recvs[(a["peer"], rank, a["label"])].append(s)
    pairs, unmatched = [], []
    for key in sends.keys() | recvs.keys():
        out, into = sends.get(key, []), recvs.get(key, [])
        pairs += [(key[0], s, key[1], r) for s, r in zip(out, into)]
        unmatched += [f"send {key[0]}→{key[1]} {key[2]!r} never received"] * (len(out) - len(into))
        unmatched += [f"receive {key[0]}→{key[1]} {key[2]!r} never sent"] * (len(into) - len(out))
    return pairs, sorted(unmatched)


def align_clocks(ranks: dict[int, RankTrace], pairs: list[tuple]) -> dict[int, int]:
    """Offsets (ns, added to each rank's timestamps) inside each rank's ping-pong interval, as
    close to its midpoint as the messages allow: every receive ends after its send began."""
    off, lo, hi = {}, {}, {}
    for rank, t in ranks.items():
        c = _host_clock(ranks, t)
        off[rank] = c.get("offset_ns", 0)
        lo[rank] = c.get("lo_ns", -math.inf) if c else -math.inf
        hi[rank] = c.get("hi_ns", math.inf) if c else math.inf
    root = min(ranks)
    lo[root] = hi[root] = off[root] = 0
    need: dict[tuple[int, int], int] = {}  # (S, D) → the largest send_start_S − recv_end_D
    for src, send, dst, recv in pairs:
        gap = send["ts"] + MIN_LATENCY_NS - (recv["ts"] + recv["dur"])
        if gap > need.get((src, dst), -math.inf):
            need[(src, dst)] = gap
    for _ in range(4 * len(ranks) + 4):  # Bellman-Ford style passes; stops when all hold
        moved = False
        for (src, dst), gap in need.items():
            deficit = gap - (off[dst] - off[src])  # > 0: the arrow S → D points back in time
            if deficit <= 0:
                continue
            up = min(deficit, hi[dst] - off[dst])  # move the receiver later ...
            off[dst] += max(0, up)
            rest = deficit - max(0, up)
            down = min(rest, off[src] - lo[src])  # ... and the sender earlier, within bounds
            off[src] -= max(0, down)
            moved = moved or up > 0 or down > 0
        if not moved:
            break
    return {r: int(v) for r, v in off.items()}


def _host_clock(ranks: dict[int, RankTrace], t: RankTrace) -> dict:
    """A rank's clock record, or — when it shares its host's clock — the measured rank's."""
    leader = t.clock.get("same_clock_as")
    if leader is None or leader == t.rank:
        return t.clock
    if leader not in ranks:  # that rank's file is missing: nothing bounds this one
        return {}
    return ranks[leader].clock


# --------------------------------------------------------------------------- the trace


def merge(ranks: dict[int, RankTrace]) -> tuple[dict, Summary]:
    pairs, unmatched = match_messages(ranks)
    offsets = align_clocks(ranks, pairs)
    t0 = min((s["ts"] + offsets[r] for r, t in ranks.items() for s in t.spans), default=0)

    def us(rank: int, ns: int) -> float:
        return round((ns + offsets[rank] - t0) / 1e3, 3)

    events: list[dict] = []
    order = sorted(ranks, key=lambda r: _coord_key(ranks[r].meta))
    for index, rank in enumerate(order):
        meta = ranks[rank].meta
        events.append(_meta(rank, 0, "process_name", {"name": _process_name(meta)}))
        events.append(_meta(rank, 0, "process_sort_index", {"sort_index": index}))
        events.append(_meta(rank, TRACKS["compute"], "thread_name", {"name": "compute"}))
        events.append(_meta(rank, TRACKS["collective"], "thread_name", {"name": "collectives"}))
    lanes = _lanes(ranks)
    for (rank, cat, name, lane), tid in sorted(lanes.names.items(), key=lambda kv: kv[1]):
        events.append(_meta(rank, tid, "thread_name", {"name": f"{cat} {name}s {lane}"}))
    for rank, t in ranks.items():
        for s in t.spans:
            tid = lanes.tid.get(
                id(s), TRACKS["collective" if s["cat"] == "collective" else "compute"]
            )
            args = dict(s.get("args", {}), step=s["step"])
            begin = us(rank, s["ts"])  # both ends rounded alike: adjacent slices stay adjacent
            events.append({
                "ph": "X", "name": _slice_name(s), "cat": s["cat"], "pid": rank, "tid": tid,
                "ts": begin, "dur": round(us(rank, s["ts"] + s["dur"]) - begin, 3), "args": args,
            })  # fmt: skip
    flows: dict[str, int] = defaultdict(int)
    backward = 0
    for n, (src, send, dst, recv) in enumerate(sorted(pairs, key=lambda p: p[1]["ts"])):
        start = us(src, send["ts"])
        end_slice = us(dst, recv["ts"]), us(dst, recv["ts"] + recv["dur"])
        if end_slice[1] < start:
            backward += 1
        end = max(end_slice[0], min(end_slice[1], max(start + 0.001, end_slice[1] - 0.001)))
        if end <= start:  # an inconsistent clock: still draw it, never backwards
            end = start + 0.001
        cat, name = send["cat"], send["args"]["label"]
        flows[cat] += 1
        events.append({"ph": "s", "id": n, "cat": cat, "name": name, "pid": src,
                       "tid": lanes.tid[id(send)], "ts": start})  # fmt: skip
        events.append({"ph": "f", "bp": "e", "id": n, "cat": cat, "name": name, "pid": dst,
                       "tid": lanes.tid[id(recv)], "ts": end})  # fmt: skip
    summary = Summary(
        ranks=len(ranks),
        flows=dict(flows),
        unmatched=unmatched,
        backward_flows=backward,
        offsets_ns=offsets,
        bubble=pipeline_bubble(ranks),
        dropped=sum(t.dropped for t in ranks.values()),
    )
    trace = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": _other(summary)}
    return trace, summary


@dataclass
class _LaneMap:
    tid: dict[int, int]
    names: dict[tuple, int]


def _lanes(ranks: dict[int, RankTrace]) -> _LaneMap:
    """Messages overlap (a group posts several; a send stays open until known complete), and
    slices on one track must nest: each (rank, category, send/recv) gets as many lanes as it has
    messages in flight at once, each message the first lane free at its start."""
    tid, names = {}, {}
    for rank, t in ranks.items():
        ends: dict[tuple, list[int]] = defaultdict(list)
        for s in sorted((s for s in t.spans if s["cat"] in MESSAGE_CATS), key=lambda s: s["ts"]):
            kind = (s["cat"], s["name"])
            free = ends[kind]
            lane = next((i for i, e in enumerate(free) if e <= s["ts"]), len(free))
            if lane == len(free):
                free.append(0)
            free[lane] = s["ts"] + s["dur"]
            key = (rank, *kind, lane)
            if key not in names:
                names[key] = 10 + len([k for k in names if k[0] == rank])
            tid[id(s)] = names[key]
    return _LaneMap(tid, names)


def pipeline_bubble(ranks: dict[int, RankTrace]) -> dict[int, dict[str, float]]:
    """Per pipeline stage: idle time over compute time inside each step's pipeline window (first
    forward start to last backward end), averaged over the stage's ranks and the steps after the
    first (warm-up) — the quantity (p−1)/(v·m) predicts."""
    per_stage: dict[int, list[float]] = defaultdict(list)
    theory = {}
    for t in ranks.values():
        dims, coords = t.meta.get("dims", {}), t.meta.get("coords", {})
        p, v, m = dims.get("pp", 1), dims.get("pp_virtual", 1), dims.get("microbatches")
        if p < 2:
            continue
        if m:
            theory[coords.get("pp", 0)] = (p - 1) / (v * m)
        by_step = defaultdict(list)
        for s in t.spans:
            if s["cat"] == "compute" and s["name"] in ("forward", "backward") and s["step"] > 1:
                by_step[s["step"]].append((s["ts"], s["ts"] + s["dur"]))
        for intervals in by_step.values():
            window = max(e for _, e in intervals) - min(b for b, _ in intervals)
            busy = _union(intervals)
            if busy > 0:
                per_stage[coords.get("pp", 0)].append((window - busy) / busy)
    return {
        stage: {"measured": sum(v) / len(v), "theory": theory.get(stage, float("nan"))}
        for stage, v in sorted(per_stage.items())
    }


def _union(intervals: list[tuple[int, int]]) -> int:
    total, end = 0, -math.inf
    for b, e in sorted(intervals):
        if b > end:
            total += e - b
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def _coord_key(meta: dict) -> tuple:
    c = meta.get("coords", {})
    return (c.get("pp", 0), c.get("dp", 0), c.get("cp", 0), c.get("tp", 0), meta["rank"])


def _process_name(meta: dict) -> str:
    c = meta.get("coords", {})
    where = " ".join(f"{k}{c[k]}" for k in ("pp", "dp", "cp", "tp") if k in c)
    return f"rank {meta['rank']} · {where}" + (f" · {meta['host']}" if "host" in meta else "")


def _slice_name(s: dict) -> str:
    a = s.get("args", {})
    if s["cat"] in MESSAGE_CATS:
        arrow = "→" if s["name"] == "send" else "←"
        return f"{s['name']} {arrow}{a.get('peer')} {a.get('label', '')}"
    if s["cat"] == "collective":
        return f"{s['name']} [{a.get('group')}] #{a.get('seq')}"
    if "mb" in a:
        return f"{s['name']} mb{a['mb']}" + (f" c{a['chunk']}" if "chunk" in a else "")
    return s["name"]


def _meta(pid: int, tid: int, name: str, args: dict) -> dict:
    return {"ph": "M", "name": name, "pid": pid, "tid": tid, "args": args}


def _other(summary: Summary) -> dict:
    return {
        "flows": summary.flows,
        "unmatched": len(summary.unmatched),
        "backward_flows": summary.backward_flows,
        "clock_offsets_ns": {str(k): v for k, v in summary.offsets_ns.items()},
        "dropped_events": summary.dropped,
    }


def write_timeline(
    run_dir: Path, out: Path | None = None, ranks: dict[int, RankTrace] | None = None
) -> tuple[Path, Summary]:
    """Merge RUN/trace/rank*.jsonl (or `ranks`, read from them) into `out` (default
    RUN/trace/timeline.json)."""
    trace, summary = merge(ranks if ranks is not None else read_rank_files(run_dir))
    out = Path(out) if out is not None else Path(run_dir) / "trace" / "timeline.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(trace, separators=(",", ":")))
    return out, summary
