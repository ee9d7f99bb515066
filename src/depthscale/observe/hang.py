"""Which rank the others wait for: the hang analysis behind `depthscale trace hang --run DIR`.

Input: the hang dumps (`observe/watchdog.py`: each rank's in-flight operations, marked "waiting"
where it is blocked) of the ranks that wrote one, and every rank's coordinates from the meta line
of its trace file (written at start-up, so it exists for a rank that later hung silently).

The rule is MegaScale's (§5.2), made precise as a wait-for graph:
- a rank blocked in a receive or a send waits for its peer;
- a rank blocked in a collective (group g, sequence number k) waits for every member of g that is
  not blocked in that same collective — members without a dump, and members somewhere else;
- following the edges from the waiting ranks ends at the culprits: ranks that others wait for
  and that wait for nobody — silent (no dump: a stopped process, a dead host) or busy in their own
  code (their dump shows where). An edge cycle with no way out is a genuine deadlock.

A rank that died is often waited for by nobody: a vanished gloo peer makes the others' next
collective fail at once, before any of them waits in it. Its silence is then explained from the
supervisor's records, its peers' errors and where its trace ends (`observe/deaths.py`), filled in
by the caller (`observe/trace_report.py`), which also picks the attempt to read (`observe/attempts.py`).

Where a dump carries torch's Flight Recorder state (`observe/flight_recorder.py`: gloo and NCCL in
torch 2.13), a blocked collective is taken from it — also one FSDP issued inside torch, which no
span sees — and a member of its group is waited for when it never enqueued that collective (its
count for the group is lower). Messages are always taken from the spans, which carry their labels.

On NCCL the host only queues collectives and runs ahead: every rank has usually enqueued the one
that hangs, so enqueued counts blame nobody. What counts there is the device: a rank is blocked in
the collective its GPU *started* and has not completed (its kernel waits for the peers), and it
waits for the members whose GPU has not started it (their `started` count is lower) — stuck in a
kernel of their own, or their host behind. A rank whose GPU started no pending collective is
blocked in none. When every member started it and none completed it, no rank is to blame: NCCL or
the network is (said in the report's notes). Where torch does not track starts, the enqueued rule
is all there is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from depthscale.observe.deaths import stopped, what_it_did
from depthscale.observe.stragglers import where

COMM_CATS = ("pp", "cp", "p2p", "collective")


@dataclass
class Waiter:
    rank: int
    op: dict | None
    """The operation it is blocked in (a span record), or None when it waits in nothing we see."""
    waits_for: set[int] = field(default_factory=set)


@dataclass
class HangReport:
    world: int
    culprits: list[int]
    silent: list[int]
    """Ranks with no dump."""
    waiters: dict[int, Waiter]
    coords: dict[int, dict]
    deadlock: list[int] = field(default_factory=list)
    """Ranks on a wait cycle nobody outside can break (empty when there is a culprit)."""
    problems: list[str] = field(default_factory=list)
    nodes: dict[int, str] = field(default_factory=dict)
    """Rank → the node the supervisor launched it on (empty unless supervised)."""
    fates: dict[int, str] = field(default_factory=dict)
    """Silent rank → why it wrote no dump, where evidence says (`observe/deaths.py`)."""
    ends: dict[int, str] = field(default_factory=dict)
    """Silent rank → where its trace file ends."""

    def waiting_on(self, culprit: int) -> dict[int, dict | None]:
        """The ranks that wait directly for `culprit`, with the operation each waits in."""
        return {r: w.op for r, w in self.waiters.items() if culprit in w.waits_for}


def load_dumps(run_dir: Path) -> tuple[dict[int, dict], dict[int, dict], int, list[str]]:
    """(dumps by rank, meta by rank, world size, problems reading them) of RUN/trace; a ValueError
    when there is no dump."""
    trace = Path(run_dir) / "trace"
    dumps, metas, world, problems = read_dumps(trace)
    if not dumps:
        raise ValueError(
            f"{trace / 'hang'} holds no hang dumps: ranks write them when a step stalls for "
            "logging.hang_dump_s or a collective times out (parallel.timeout_s)"
        )
    return dumps, metas, world, problems


def read_dumps(trace: Path) -> tuple[dict[int, dict], dict[int, dict], int, list[str]]:
    """`load_dumps` of one trace folder (RUN/trace or an archived attempt's), which may hold no
    dump: a rank that died writes none, and its peers may have been stopped before they could."""
    metas, problems = {}, []
    for path in sorted(trace.glob("rank*.jsonl")):
        with open(path, encoding="utf-8", errors="replace") as f:
            first = f.readline()
        try:
            meta = json.loads(first)
            metas[meta["rank"]] = meta
        except (json.JSONDecodeError, KeyError, TypeError):  # not JSON, or not a meta record
            problems.append(f"{path}: no meta line")
    dumps = {}
    for path in sorted((trace / "hang").glob("rank*.json")):
        try:
            dump = json.loads(path.read_text())
        except (json.JSONDecodeError, OSError, UnicodeDecodeError) as err:
            problems.append(f"{path}: unreadable ({err}); read as if the rank wrote none")
            continue
        if not _is_dump(dump):
            problems.append(f"{path}: not a hang dump; read as if the rank wrote none")
            continue
        dumps[dump["rank"]] = dump
    world = max(
        [m.get("world", 0) for m in metas.values()] + [d.get("world", 0) for d in dumps.values()],
        default=0,
    )
    return dumps, metas, world, problems


def _is_dump(dump: object) -> bool:
    """The fields the analysis reads, with their types (a damaged file is read as no dump)."""
    if not isinstance(dump, dict) or not isinstance(dump.get("rank"), int):
        return False
    ops = dump.get("in_flight", [])
    if not isinstance(ops, list) or not all(_is_op(op) for op in ops):
        return False
    fr = dump.get("flight_recorder")
    if fr is None or "error" in fr:
        return True
    groups, pending = fr.get("groups"), fr.get("in_flight")
    return (
        isinstance(groups, dict)
        and all(
            isinstance(g, dict)
            and isinstance(g.get("ranks"), list)
            and isinstance(g.get("enqueued"), int)
            and isinstance(g.get("completed", 0), int)
            and isinstance(g.get("started"), int | None)
            for g in groups.values()
        )
        and isinstance(pending, list)
        and all(
            isinstance(e, dict) and isinstance(e.get("seq"), int) and {"group", "op"} <= e.keys()
            for e in pending
        )
    )


def _is_op(op: object) -> bool:
    if not isinstance(op, dict) or not isinstance(op.get("cat"), str):
        return False
    args = op.setdefault("args", {})
    if op["cat"] == "collective":
        return isinstance(args, dict) and isinstance(args.get("group", ""), str)
    if op["cat"] in COMM_CATS:
        return isinstance(args, dict) and isinstance(args.get("peer"), int)
    return isinstance(args, dict)


def _blocked_in(dump: dict) -> dict | None:
    """The communication this rank is blocked in: the newest one it waits on. Messages posted and
    not waited on (a pipeline's prefetched receive) are not: the rank may be blocked elsewhere —
    in a collective only torch's Flight Recorder sees."""
    waiting = [
        op for op in dump.get("in_flight", []) if op.get("cat") in COMM_CATS and op.get("waiting")
    ]
    return waiting[-1] if waiting else None


def _same_collective(a: dict | None, b: dict | None) -> bool:
    return (
        a is not None
        and b is not None
        and a.get("cat") == b.get("cat") == "collective"
        and a["args"].get("group") == b["args"].get("group")
        and a["args"].get("seq") == b["args"].get("seq")
    )


def analyze(dumps: dict[int, dict], world: int, metas: dict[int, dict] | None = None) -> HangReport:
    metas = metas or {}
    coords = {r: (dumps.get(r) or metas.get(r) or {}).get("coords", {}) for r in range(world)}
    blocked = {r: _blocked_in(d) for r, d in dumps.items()}
    silent = [r for r in range(world) if r not in dumps]
    waiters, problems = {}, []
    for rank, op in blocked.items():
        recorded = _recorded_collective(dumps[rank], op)
        if recorded is not None:
            w, problem = _waiter_from_recorder(rank, recorded, dumps)
            waiters[rank] = w
            problems += problem
            continue
        if op is None:
            continue
        w = Waiter(rank, op)
        if op["cat"] == "collective":
            group = [int(x) for x in str(op["args"].get("group", "")).split(",") if x != ""]
            for member in group:
                if member != rank and not _same_collective(op, blocked.get(member)):
                    w.waits_for.add(member)
                    other = blocked.get(member)
                    if (
                        other is not None
                        and other.get("cat") == "collective"
                        and (other["args"].get("group") == op["args"].get("group"))
                    ):
                        problems.append(
                            f"rank {member} is in {_describe(other)} while rank {rank} waits in "
                            f"{_describe(op)}: the group's members issued different collectives"
                        )
        else:
            w.waits_for.add(int(op["args"]["peer"]))
        waiters[rank] = w
    culprits, deadlock = _ends(waiters)
    return HangReport(world, culprits, silent, waiters, coords, deadlock, sorted(set(problems)))


def _recorded_collective(dump: dict, op: dict | None) -> tuple[dict, str, int] | None:
    """(op, group name, sequence number) of the Flight Recorder collective this rank is blocked in:
    the newest pending one of the group its open collective span names, or — when no span shows a
    communication — the oldest pending one (a group runs its collectives in order). On NCCL only
    a collective its GPU started counts (`_can_block`). None when a message is what it waits for,
    or the recorder knows nothing."""
    fr = dump.get("flight_recorder") or {}
    groups = fr.get("groups") or {}
    pending = [e for e in fr.get("in_flight") or [] if _can_block(groups, e)]
    if not pending or (op is not None and op.get("cat") != "collective"):
        return None
    if op is not None:
        members = op["args"].get("group")
        mine = [e for e in pending if _ranks_text(groups, e["group"]) == members]
        if not mine:
            return None
        e = mine[-1]
    else:
        e = pending[0]
    group = groups.get(e["group"], {})
    if not group.get("ranks"):
        return None
    args = {"group": _ranks_text(groups, e["group"]), "seq": e["seq"], "source": "flight recorder"}
    if group.get("desc"):
        args["process_group"] = group["desc"]
    if e.get("state") == "started":
        args["state"] = "started"
    args["recorder_group"] = e["group"]
    return {"cat": "collective", "name": e["op"], "args": args}, e["group"], int(e["seq"])


def _can_block(groups: dict, e: dict) -> bool:
    """Whether a pending collective can be what its rank is blocked in: any on gloo, where the
    host runs it; on NCCL, where the host only queued it, one the GPU started (or any, where
    torch does not track starts)."""
    group = groups.get(e["group"], {})
    if group.get("backend") != "nccl" or group.get("started") is None:
        return True
    return e.get("state") == "started"


def _joined(theirs: dict, seq: int) -> bool:
    """Whether a member's record of a group shows it joined collective `seq`: enqueued it, and on
    NCCL (when starts are tracked) started it on its GPU, or completed it."""
    if theirs["enqueued"] < seq:
        return False
    if theirs.get("completed", 0) >= seq:
        return True
    return theirs.get("started") is None or theirs["started"] >= seq


def _ranks_text(groups: dict, name: str) -> str:
    return ",".join(map(str, groups.get(name, {}).get("ranks", [])))


def _waiter_from_recorder(
    rank: int, recorded: tuple[dict, str, int], dumps: dict[int, dict]
) -> tuple[Waiter, list[str]]:
    """Rank waits for the members of the group that have not joined collective `seq` (`_joined`)
    — every member without a dump, and those whose recorder counts fewer collectives in the group
    (enqueued; on NCCL, started on the GPU)."""
    op, name, seq = recorded
    w, problems, known = Waiter(rank, op), [], True
    for member in (int(r) for r in op["args"]["group"].split(",")):
        if member == rank:
            continue
        other = dumps.get(member)
        if other is None:
            w.waits_for.add(member)
            continue
        theirs = ((other.get("flight_recorder") or {}).get("groups") or {}).get(name)
        if theirs is None:
            known = False
            problems.append(
                f"rank {member}'s dump has no Flight Recorder record of the group of ranks "
                f"[{op['args']['group']}]: whether it joined {op['name']} #{seq} is unknown"
            )
        elif not _joined(theirs, seq):
            w.waits_for.add(member)
    if known and not w.waits_for:
        problems += _nobody_behind(op, seq, _group_record(dumps[rank], name))
    return w, problems


def _group_record(dump: dict, name: str) -> dict:
    return ((dump.get("flight_recorder") or {}).get("groups") or {}).get(name) or {}


def _nobody_behind(op: dict, seq: int, mine: dict) -> list[str]:
    """Why an NCCL collective every member joined hangs, as far as the recorders tell."""
    where = f"{op['name']} #{seq} of the group of ranks [{op['args']['group']}]"
    if op["args"].get("state") == "started":
        return [
            f"every member started {where} on its GPU and it never completed: no rank is behind, "
            "NCCL or the network hangs (NCCL_DEBUG=INFO, the links between their nodes)"
        ]
    if mine.get("backend") == "nccl" and mine.get("started") is None:
        return [
            f"every member enqueued {where}, as NCCL hosts do ahead of their GPUs, and torch did "
            "not track which GPUs started it: set TORCH_NCCL_ENABLE_TIMING=1 (a CUDA `depthscale "
            "train` does) to find the rank behind"
        ]
    return []


def _ends(waiters: dict[int, Waiter]) -> tuple[list[int], list[int]]:
    """Ranks reachable from the waiters that wait for nobody; else the ranks on a closed cycle."""
    reached, stack = set(), [r for w in waiters.values() for r in w.waits_for]
    while stack:
        r = stack.pop()
        if r not in reached:
            reached.add(r)
            stack += list(waiters[r].waits_for) if r in waiters else []
    culprits = sorted(r for r in reached if r not in waiters or not waiters[r].waits_for)
    if culprits or not waiters:
        return culprits, []
    return [], sorted(reached)


def _describe(op: dict | None) -> str:
    if op is None:
        return "nothing depthscale issued (see its stack)"
    a = op.get("args", {})
    if op["cat"] == "collective":
        text = f"{op['name']} over ranks [{a.get('group')}] #{a.get('seq')}"
        if a.get("source"):
            where = f", process group {a['process_group']}" if a.get("process_group") else ""
            started = ", started on its GPU" if a.get("state") == "started" else ""
            text += f" (from torch's {a['source']}{where}{started})"
        return text
    arrow = "to" if op["name"] == "send" else "from"
    return f"{op['cat']} {op['name']} {arrow} rank {a.get('peer')} ({a.get('label')!r})"


def _training_stack(stacks: str) -> list[str]:
    """The training thread's frames from a faulthandler dump of all threads (the one in the
    trainer's loop; else the last thread listed, the main thread), innermost first."""
    blocks = [b.strip().splitlines() for b in stacks.split("\n\n") if b.strip()]
    if not blocks:
        return []
    main = next((b for b in blocks if any(" in _fit" in ln for ln in b)), blocks[-1])
    return [ln.strip() for ln in main]


def format_report(report: HangReport, dumps: dict[int, dict] | None = None) -> str:
    dumps = dumps or {}
    lines = _deadlock_lines(report)
    for culprit in report.culprits:
        lines += _culprit_lines(report, culprit, dumps)
    lines += _behind_lines(report)
    if not report.culprits and not report.deadlock:
        lines += _lost_lines(report, dumps)
    if not lines:
        lines.append("no rank is blocked on another: the dumps show no hang")
    lines += [f"note: {p}" for p in report.problems]
    return "\n".join(lines)


def _who(report: HangReport, rank: int) -> str:
    node = f" on node {report.nodes[rank]}" if rank in report.nodes else ""
    return f"rank {rank} ({where(report.coords.get(rank, {}))}){node}"


def _state(report: HangReport, rank: int) -> str:
    if rank in report.fates:
        return report.fates[rank]
    if rank in report.silent:
        return "wrote no hang dump: it is stopped, dead or unreachable"
    return "is not blocked in any communication: it is stuck in its own work"


def _deadlock_lines(report: HangReport) -> list[str]:
    if not report.deadlock:
        return []
    return [
        "deadlock: ranks " + ", ".join(map(str, report.deadlock)) + " wait in a cycle:",
        *(
            f"  rank {r} ({where(report.coords[r])}) waits in {_describe(report.waiters[r].op)}"
            for r in report.deadlock
        ),
    ]


def _culprit_lines(report: HangReport, culprit: int, dumps: dict[int, dict]) -> list[str]:
    lines = [f"culprit: {_who(report, culprit)} {_state(report, culprit)}"]
    if culprit in report.ends:
        lines.append(f"  {report.ends[culprit]}")
    dump = dumps.get(culprit)
    if dump is not None:
        inner = (dump.get("in_flight") or [{}])[-1]
        lines.append(
            f"  its innermost open span: {inner.get('name', 'none')} (step {dump.get('step')})"
        )
        lines += ["  " + ln for ln in _training_stack(dump.get("stacks", ""))[:7]]
        lines += _device_lines(report, culprit, dump)
    for rank, op in sorted(report.waiting_on(culprit).items()):
        lines.append(f"  rank {rank} ({where(report.coords[rank])}) waits in {_describe(op)}")
    return lines


def _device_lines(report: HangReport, culprit: int, dump: dict) -> list[str]:
    """On NCCL, how far the culprit's GPU got in the groups where others wait for it."""
    groups = (dump.get("flight_recorder") or {}).get("groups") or {}
    ops = [op for op in report.waiting_on(culprit).values() if op is not None]
    waited_in = {op.get("args", {}).get("recorder_group") for op in ops}
    lines = []
    for name in sorted(waited_in - {None}):
        g = groups.get(name) or {}
        if g.get("backend") == "nccl" and g.get("started") is not None:
            ranks = ",".join(map(str, g.get("ranks", [])))
            lines.append(
                f"  its GPU in the group of ranks [{ranks}]: enqueued #{g['enqueued']}, "
                f"started #{g['started']}, completed #{g.get('completed', 0)}"
            )
    return lines


def _behind_lines(report: HangReport) -> list[str]:
    """The waiters that wait for a culprit only through another waiter."""
    if not report.culprits:
        return []
    direct = {r for c in report.culprits for r in report.waiting_on(c)}
    behind = sorted(r for r in report.waiters if r not in direct and r not in report.deadlock)
    lines = ["waiting behind them:"] if behind else []
    for rank in behind:
        w = report.waiters[rank]
        peers = ", ".join(map(str, sorted(w.waits_for))) or "nobody"
        lines.append(
            f"  rank {rank} ({where(report.coords[rank])}) waits in {_describe(w.op)} "
            f"(for rank {peers})"
        )
    return lines


def _lost_lines(report: HangReport, dumps: dict[int, dict]) -> list[str]:
    """Silent ranks nobody was seen waiting for, named when evidence explains their silence or
    their peers failed (a peer that died makes the others' next collective fail at once, before
    any of them waits in it); then what each rank with a dump was doing."""
    failed = any(d.get("error") for d in dumps.values())
    lost = sorted(report.fates) or (report.silent if failed else [])
    if not lost:
        return []
    lines = []
    for rank in lost:
        lines.append(f"culprit: {_who(report, rank)} {_state(report, rank)}")
        lines += [f"  {report.ends[rank]}"] if rank in report.ends else []
    for rank in stopped(report.silent, report.fates):
        lines.append(
            f"  {_who(report, rank)} wrote no dump: the supervisor stopped it after that fault"
        )
    for rank, dump in sorted(dumps.items()):
        lines.append(f"  rank {rank} ({where(report.coords.get(rank, {}))}) {what_it_did(dump)}")
    return lines
