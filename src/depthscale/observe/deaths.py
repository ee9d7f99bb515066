"""Why a rank wrote no hang dump: what `trace hang` says about a rank that died.

Only a live rank writes a hang dump (`observe/watchdog.py`). A rank SIGKILLed, or on a node that
went away, writes none, and its peers' dumps need not show a wait on it: a gloo peer that vanishes
makes the others' next collective fail at once, often inside FSDP's forward where no span waits,
so the wait-for graph (`observe/hang.py`) has no edge to follow. The silent rank is then named
from other evidence, strongest first:

- the supervisor's record of the attempt (`observe/attempts.py`): the rank it found dead, with the
  signal, or hung, with its process state;
- its peers' errors: a connection closed or reset by the peer means the peer's process is gone;
- its own trace file, which ends where the rank stopped writing (the writer flushes every 0.25 s,
  so a killed rank's last quarter second is missing).
"""

from __future__ import annotations

import re
from pathlib import Path

from depthscale.observe.attempts import Launch
from depthscale.observe.spans import read_trace_file

GONE = re.compile(
    r"closed by peer|connection reset|broken pipe|remote process exited|econnreset|socket closed",
    re.IGNORECASE,
)
"""Errors (gloo's, NCCL's, the OS's) that say the other end's process or host is gone."""
VERBS = {"dead": "died", "hung": "hung", "error": "failed", "lost": "is gone with its node"}
"""The supervisor's fault kinds that explain a silent rank, as the report words them."""


def fates(silent: list[int], dumps: dict[int, dict], launch: Launch | None) -> dict[int, str]:
    """Rank → why it wrote no dump, for the silent ranks some evidence explains. When the
    supervisor recorded the death of some silent ranks, those are the culprits: the other silent
    ranks are ones it stopped when it acted on that fault (their peers' closed connections say
    nothing about them), and `stopped` lists them."""
    recorded = {}
    for rank in silent:
        fault = launch.fault_of(rank) if launch is not None else None
        if fault is not None and fault.get("kind") in VERBS:
            verb = VERBS[fault["kind"]]
            recorded[rank] = f"{verb}: {fault.get('detail')}, as the supervisor recorded"
    if recorded:
        return recorded
    gone = next((short_error(d["error"]) for d in dumps.values() if _says_gone(d)), None)
    if gone is None:
        return {}
    out = {}
    for rank in silent:
        out[rank] = (
            f"is gone: its peers' connections to it closed ({gone}); it died or its host went away"
        )
        node = launch.node_of.get(rank) if launch is not None else None
        if node is not None and node in launch.quiet:
            out[rank] += f"; the supervisor on {node} recorded no fault for this attempt"
    return out


def stopped(silent: list[int], fates: dict[int, str]) -> list[int]:
    """The silent ranks with no fate of their own beside ranks whose death the supervisor
    recorded: it stopped them (SIGTERM, then SIGKILL) before they wrote a dump."""
    return [r for r in silent if r not in fates] if fates else []


def _says_gone(dump: dict) -> bool:
    return isinstance(dump.get("error"), str) and GONE.search(dump["error"]) is not None


def short_error(error: str) -> str:
    """An exception's repr cut to what names the failure: gloo's "RuntimeError('[.../pair.cc:553]
    Connection closed by peer [127.0.0.1]:15516. This is typically ...')" → "Connection closed by
    peer [127.0.0.1]:15516"."""
    text = re.sub(r"^\w+\((['\"])", "", error.strip()).rstrip("')\"")
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    text = text.split(". ")[0].splitlines()[0] if text else text
    return text[:160]


def trace_end(folder: Path, rank: int) -> str | None:
    """Where a rank's trace file ends ("its trace ends in step 5, in backward"), or that it holds
    no span (a rank killed early: its writer had flushed nothing); None without a readable file."""
    path = Path(folder) / f"rank{rank:05d}.jsonl"
    try:
        _, records = read_trace_file(path)
    except (OSError, ValueError):
        return None
    last = next((r for _, r in reversed(records) if r.get("kind") == "span"), None)
    if last is None:
        return "its trace file holds no span"
    return f"its trace ends in step {last.get('step')}, in {last.get('name')}"


def what_it_did(dump: dict) -> str:
    """A dumped rank's state in a few words: the span it was in, and its error if it failed."""
    inner = (dump.get("in_flight") or [{}])[-1].get("name", "no span")
    if dump.get("error"):
        return f"failed in {inner} at step {dump.get('step')}: {short_error(str(dump['error']))}"
    return f"was in {inner} at step {dump.get('step')} ({dump.get('reason', 'a dump')})"
