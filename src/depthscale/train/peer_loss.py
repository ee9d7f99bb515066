"""One line naming the peer a rank lost, when a collective or message failed because another
process is gone (its connection closed or was reset: it died, was killed, or its host went away).

Under plain torchrun nobody else names it: each surviving rank prints its own error, and gloo's
says only "Connection closed by peer [ip]:port" (a port no rank can be told by) with a paragraph
of advice. What a rank knows, and uses here:

- whom it waited for: the operation it failed in (its span, left open on the error: a message's
  peer, a collective's group) or, for FSDP's collectives, torch's Flight Recorder;
- whether a peer's process is gone, when the peer ran on this host (its pid, from the start-up
  record every rank writes to RUN/startup/);
- whether the rendezvous store still answers a connection: a refusal means its host is gone —
  rank 0 (or node 0's agent under torchrun), which then is the one lost.

A timed-out collective is not this (a hung peer, not a gone one): the hang dumps name it.
"""

from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path

from depthscale.errors import PeersFailed
from depthscale.observe import flight_recorder
from depthscale.observe.startup import startup_path
from depthscale.parallel.launcher import peer_lost

_SIGN = re.compile(r"(connection (?:closed|reset) by peer(?: \[[^\]]*\]:\d+)?|broken pipe)", re.I)


def is_peer_loss(err: BaseException) -> bool:
    """A peer's process is gone, as this error or any error it was raised from says (a failed
    background save's cause included)."""
    seen = err
    while seen is not None:
        if isinstance(seen, PeersFailed) or peer_lost(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def describe(err: BaseException, rank: int, step: int, in_flight: list[dict], run_dir: Path) -> str:
    """'rank 1 lost its peer rank 0 (node 0, host vm) in all_reduce at step 8: Connection closed
    by peer [127.0.0.1]:41321; its process is gone (pid 4212 on this host)'."""
    waited, where = _waited_for(rank, in_flight)
    store = _store_gone()
    peers = waited or [r for r in range(_world()) if r != rank]
    gone = [r for r in peers if _alive(run_dir, r) is False]
    if not gone and store is not None:
        gone = [r for r in peers if r in _store_hosts()] or list(_store_hosts())
    named = gone or [r for r in peers if _alive(run_dir, r) is not True] or peers
    who = _who(named, run_dir, certain=bool(gone) or len(named) == 1)
    sign = _sign(err)
    step = next((op["step"] for op in reversed(in_flight) if op.get("step")), step)
    text = f"rank {rank} lost {who}{where} at step {step}: {sign}; "
    if gone and store is None:
        text += "its process is gone" if len(gone) == 1 else "their processes are gone"
        text += f" ({_pids(gone, run_dir)} on this host)"
    elif store is not None and store in sign:
        text += "the process hosting that store is gone"
    elif store is not None:
        text += f"the rendezvous store at {store} refuses connections too: its host is gone"
    else:
        text += "it died, was killed or its host went away: its own output says why"
    return text


def _waited_for(rank: int, in_flight: list[dict]) -> tuple[list[int], str]:
    """The ranks this rank waited for when it failed, and ' in OPERATION' (or '' unknown)."""
    for op in reversed(in_flight):
        if op.get("peer") is not None:
            return [int(op["peer"])], f" in {op.get('cat', '')} {op.get('name', '')}".rstrip()
        if op.get("cat") == "collective" and op.get("group"):
            ranks = [int(r) for r in str(op["group"]).split(",") if r.strip().isdigit()]
            return [r for r in ranks if r != rank], f" in {op.get('name', 'a collective')}"
    recorded = flight_recorder.snapshot() or {}
    for pending in recorded.get("in_flight") or []:
        group = (recorded.get("groups") or {}).get(pending.get("group"), {})
        others = [r for r in group.get("ranks") or [] if r != rank]
        if others:
            return others, f" in {pending.get('op', 'a collective')} (torch's flight recorder)"
    phase = next((op.get("name") for op in reversed(in_flight) if op.get("name")), None)
    return [], f" in {phase}" if phase else ""


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _local_world() -> int:
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _store_hosts() -> range:
    """The ranks whose loss takes the store with them: node 0's under torchrun's agent (or the
    supervisor), which hosts it there; else rank 0, which hosts it."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return range(_local_world()) if agent else range(1)


def _store_gone() -> str | None:
    """'host:port' when the rendezvous store refuses a connection (nothing listens there: the
    process hosting it is gone); None when it accepts one or cannot be told within 2 s."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not (port or "").isdigit():
        return None
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except ConnectionRefusedError:
        return f"{host}:{port}"
    except OSError:
        return None
    return None


def _record(run_dir: Path, rank: int) -> dict:
    """The peer's start-up record (pid, host), if it wrote one."""
    try:
        return json.loads(startup_path(run_dir, rank).read_text())
    except (OSError, ValueError):
        return {}


def _alive(run_dir: Path, rank: int) -> bool | None:
    """Whether the peer's process still runs: known only for a peer on this host."""
    record = _record(run_dir, rank)
    if record.get("host") != socket.gethostname() or not isinstance(record.get("pid"), int):
        return None
    try:
        with open(f"/proc/{record['pid']}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc: ask the kernel
        try:
            os.kill(record["pid"], 0)
        except ProcessLookupError:
            return False
        except OSError:  # another user's process: it exists
            return True
        return True
    return state not in ("Z", "X")  # a killed process its parent has not reaped yet is gone


def _who(ranks: list[int], run_dir: Path, certain: bool) -> str:
    """'its peer rank 0 (node 0, host vm)', 'its peers ranks 2, 3 (node 1, host b)' or 'a peer:
    one of ranks 0, 2 (...)'."""
    if not ranks:
        return "a peer"
    places = []
    for node in sorted({r // _local_world() for r in ranks}):
        hosts = {_record(run_dir, r).get("host") for r in ranks if r // _local_world() == node}
        hosts.discard(None)
        places.append(f"node {node}" + (f", host {', '.join(sorted(hosts))}" if hosts else ""))
    where = f" ({'; '.join(places)})"
    listed = ", ".join(map(str, ranks))
    if len(ranks) == 1:
        return f"its peer rank {listed}{where}"
    return (f"its peers ranks {listed}" if certain else f"a peer: one of ranks {listed}") + where


def _pids(ranks: list[int], run_dir: Path) -> str:
    return ", ".join(f"pid {_record(run_dir, r).get('pid')}" for r in ranks)


def _sign(err: BaseException) -> str:
    """The words that say how the connection ended, without gloo's advice paragraph."""
    seen = err
    while seen is not None:
        found = _SIGN.search(str(seen))
        if found:
            return found.group(1)
        if isinstance(seen, PeersFailed):
            return str(seen).splitlines()[0][:200]
        seen = seen.__cause__ or seen.__context__
    return str(err).splitlines()[0][:160]


def peers_timed_out(err: BaseException) -> bool:
    """A collective or message that timed out or lost its peer (gloo and NCCL word it so)."""
    import torch.distributed as dist

    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    text = str(err)
    return any(s in text for s in ("Timed out", "timed out", "Connection closed by peer",
                                   "Connection reset by peer"))  # fmt: skip


def timeout_names(parallel, shortened: bool) -> str:
    """The process-group timeouts in force: until the first step completes, the world group and
    the store still have the start-up one."""
    name = f"parallel.timeout_s={parallel.timeout_s:g}"
    if not shortened:
        name += f"; world group: parallel.setup_timeout_s={parallel.setup_timeout_s:g}"
    return name


def peer_failure(
    err: BaseException, rank: int, step: int, telemetry, run_dir: Path, timeouts: str
) -> PeersFailed | None:
    """The one-line error a step's failure becomes when it is about the peers, or None.

    A peer gone: one line naming it (under plain torchrun every surviving rank prints its own;
    gloo's error says only an address and a paragraph of advice), its hang dump still written,
    silently. A collective timed out: a hang seen from here, the hang analysis reads every dump.
    """
    if is_peer_loss(err):
        telemetry.on_error(err, say=False)
        recorder = telemetry.recorder
        in_flight = recorder.in_flight() if recorder is not None else []
        line = describe(err, rank, step, in_flight, run_dir)
        return PeersFailed(f"{line} (`depthscale trace hang --run {run_dir}`: every rank's view)")
    if peers_timed_out(err):
        telemetry.on_error(err)
        return PeersFailed(
            f"rank {rank}: waiting for its peers failed at step {step} "
            f"({str(err).splitlines()[0][-160:]}); every rank that could wrote its hang "
            f"dump: `depthscale trace hang --run {run_dir}` names the rank the "
            f"others waited for ({timeouts})"
        )
    return None
