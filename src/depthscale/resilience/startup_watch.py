"""Watching a (re)start up to its first step: hung when it stops advancing, not when it is long.

A cold start of a large model legitimately takes many minutes: tokenizer training, NCCL's
communicators over every node, one inductor compilation per transformer block (and its backward),
Triton's kernel builds, a checkpoint to read. One limit on the whole start (300 s) restarted a
cold llama-1b start three times and gave up (exit 75), while a shorter, stuck one waited it out.
So `resilience.startup_timeout_s` bounds each stretch in which the start makes no progress at
all: a rank's start advances when its heartbeat shows a new start-up mark (`observe/startup.py`),
a compilation beginning or ending (`compile_watch.py`), or any other progress (a span ended, a
number reported). The group's start is hung when no rank still starting has advanced for the
limit; the culprit is the rank whose start advanced longest ago (the others wait for it).

Also here: the slowest rank's time to each start-up mark, which the supervisor logs once the
group has started (`start_record`).
"""

from __future__ import annotations

from typing import Any

from depthscale.observe.startup import PHASES


def startup_sign(hb: dict[str, Any] | None) -> tuple:
    """What changes in a heartbeat when its rank's start advances."""
    if hb is None:
        return ()
    marks = hb.get("marks") or {}
    return (tuple(sorted(marks)), hb.get("compiles"), hb.get("compiling"), hb.get("progress"))


class StartupProgress:
    """When each rank's start last advanced, as its heartbeats show it (`observe`), and the
    verdict (`stalled`)."""

    def __init__(self, ranks: int, launched: float) -> None:
        self.sign: list[tuple] = [()] * ranks
        self.at = [launched] * ranks
        """When each rank's start last advanced (the launch, before its first heartbeat)."""

    def observe(self, rank: int, hb: dict[str, Any] | None, now: float) -> None:
        sign = startup_sign(hb)
        if sign != self.sign[rank]:
            self.sign[rank], self.at[rank] = sign, now

    def stalled(self, starting: list[int], now: float, limit: float) -> tuple[int, float] | None:
        """(culprit, since when the group has not advanced) once no rank of `starting` (those
        running and not yet past their first step) has advanced for `limit` seconds; else None."""
        if not starting:
            return None
        newest = max(self.at[r] for r in starting)
        if now - newest <= limit:
            return None
        return min(starting, key=lambda r: self.at[r]), newest


def last_phase(marks: dict[str, float]) -> str:
    """The latest start-up phase a rank has marked done ("launch" for none)."""
    return next((p for p in reversed(PHASES) if p in marks), "launch")


def start_phases(
    marks: list[dict[str, float]], starts: list[float | None], launched: float
) -> tuple[dict[str, float], dict[str, float]]:
    """(seconds per phase, when each phase ended) over the group: the slowest rank's time to each
    start-up mark every rank has, from the launch; `marks`/`starts`: each rank's marks and process
    start (None: unknown, the launch)."""
    marked = [m for m in PHASES if all(m in rank for rank in marks)]
    at = {m: max(rank[m] for rank in marks) for m in marked}
    start = max(s or launched for s in starts)
    phases = {"launch": start - launched}
    previous = start
    for mark in marked:
        phases[mark] = at[mark] - previous
        previous = at[mark]
    return phases, at


def start_record(
    attempt: int,
    marks: list[dict[str, float]],
    starts: list[float | None],
    launched: float,
    breakdown: dict[str, float] | None,
) -> tuple[str, str, dict[str, Any]]:
    """The supervisor's log record of a (re)start that reached its first step: (event, text,
    fields). `breakdown`: a restart's times before the launch (fault, detection, forensics, stop,
    relaunch), None for a first start."""
    phases, at = start_phases(marks, starts, launched)
    if breakdown is None:
        total = at["first_step"] - launched
        text = f"attempt {attempt}: first step {total:.2f} s after launch"
        fields: dict[str, Any] = {"phases_s": phases}
    else:
        before = {
            "detect": breakdown["detected"] - breakdown["fault"],
            "forensics": breakdown["forensics"],
            "stop": breakdown["stop"],
            "relaunch": launched - breakdown["relaunch_at"],
        }
        phases = {**before, **phases}
        total = at["first_step"] - breakdown["fault"]
        text = f"attempt {attempt}: fault → first completed step {total:.2f} s"
        fields = {"phases_s": phases, "fault_to_first_step_s": total}
    text += " (" + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()) + ")"
    return ("restart_time" if breakdown else "start_time"), text, fields
