"""The rules a Chrome / Perfetto JSON trace must follow to load with its arrows, checked.

What Perfetto's JSON importer and Chrome DevTools need (docs/observability.md has the sources):
slices are "X" events with numeric pid/tid/ts and a non-negative dur, and slices on one track nest
(a slice that starts inside another ends inside it); metadata are "M" events naming a process or a
thread; a v1 flow is one "s" and one "f" event sharing id, cat and name, the "f" later than the
"s", each point inside a slice of its own track ("f" with "bp": "e" binds to the slice enclosing
it). `check_trace` returns every violation, so a test can assert there is none.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict

EPS = 1e-4
"""µs: float sums (ts + dur) of microsecond values rounded to the ns are off by far less."""
_META_NAMES = {"process_name", "process_sort_index", "thread_name", "thread_sort_index"}


def check_trace(trace: dict) -> list[str]:
    problems: list[str] = []
    events = trace.get("traceEvents")
    if not isinstance(events, list):
        return ["no traceEvents list"]
    slices: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    flows: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for i, e in enumerate(events):
        ph = e.get("ph")
        if not isinstance(e.get("pid"), int) or not isinstance(e.get("tid"), int):
            problems.append(f"event {i}: pid and tid must be integers")
            continue
        if ph == "M":
            if e.get("name") not in _META_NAMES or not isinstance(e.get("args"), dict):
                problems.append(f"event {i}: metadata needs a known name and args")
            continue
        ts = e.get("ts")
        if not isinstance(ts, (int, float)) or not math.isfinite(ts):
            problems.append(f"event {i}: ts must be a finite number")
            continue
        if ph == "X":
            dur = e.get("dur")
            if not isinstance(dur, (int, float)) or not math.isfinite(dur) or dur < 0:
                problems.append(f"event {i}: X needs a finite dur >= 0")
                continue
            slices[(e["pid"], e["tid"])].append((ts, ts + dur))
        elif ph in ("s", "f"):
            key = (e.get("id"), e.get("cat"), e.get("name"))
            if ph in flows[key]:
                problems.append(f"event {i}: a second {ph!r} for flow {key}")
            flows[key][ph] = e
            if ph == "f" and e.get("bp") != "e":
                problems.append(f"event {i}: a flow end must bind to its enclosing slice (bp=e)")
        else:
            problems.append(f"event {i}: unexpected phase {ph!r}")
    for track, spans in slices.items():
        problems += _nesting(track, spans)
    starts = {t: sorted(s) for t, s in slices.items()}
    for key, ends in flows.items():
        if set(ends) != {"s", "f"}:
            problems.append(f"flow {key}: has {sorted(ends)}, needs one 's' and one 'f'")
            continue
        s, f = ends["s"], ends["f"]
        if not f["ts"] > s["ts"]:
            problems.append(f"flow {key}: ends at {f['ts']} before it starts at {s['ts']}")
        for point in (s, f):
            if not _inside(starts.get((point["pid"], point["tid"]), []), point["ts"]):
                problems.append(f"flow {key}: its {point['ph']!r} point is in no slice")
    return problems


def _nesting(track: tuple, spans: list[tuple[float, float]]) -> list[str]:
    """Slices on one track either nest or follow each other."""
    problems, open_ends = [], []
    for begin, end in sorted(spans, key=lambda s: (s[0], -s[1])):
        while open_ends and open_ends[-1] <= begin + EPS:
            open_ends.pop()
        if open_ends and end > open_ends[-1] + EPS:
            problems.append(f"track {track}: slice at {begin} overlaps its parent's end")
        open_ends.append(end)
    return problems


def _inside(sorted_spans: list[tuple[float, float]], ts: float) -> bool:
    i = bisect.bisect_right(sorted_spans, (ts, math.inf))
    return any(b - EPS <= ts <= e + EPS for b, e in sorted_spans[max(0, i - 64) : i])
