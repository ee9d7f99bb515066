"""When each rank posts its pipeline messages, so that NCCL can run them (pure; no torch).

NCCL pairs a rank's k-th send to a peer with the peer's k-th receive from it, and a posted group
holds its stream until all its operations met their partners. So both ranks of a pair must post
their common messages in the same order, and no rank may hold a receive ahead of a send its partner
needs first (the deadlock of posting receives "two actions ahead").

The rule used here: every message gets one global position — the time its sender produces it in a
simulation of the schedule (`schedules.simulate`), ties broken by sender, direction, microbatch and
stage — and every rank posts its sends and receives in that order, as groups: after each compute,
everything up to the next send whose data does not exist yet. That is deadlock-free under NCCL's
rules: the earliest unfinished message is at the head of both its ranks' streams (everything
earlier on either is finished), and its sender can produce it, because a compute only waits for
messages that were produced before it started, i.e. earlier ones. A receive is still posted early:
as soon as the rank's earlier sends are out. `nccl_rules.replay` checks the resulting programs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from depthscale.parallel.pipeline.schedules import Action, Kind, Layout, Schedule, simulate

SENDS = (Kind.SEND_F, Kind.SEND_B)
RECVS = (Kind.RECV_F, Kind.RECV_B)


@dataclass(frozen=True)
class Post:
    """Post these sends and receives as one group (`batch_isend_irecv`)."""

    actions: tuple[Action, ...]


@dataclass(frozen=True)
class Run:
    """Run this forward or backward; the receive it consumes (if any) is waited on first."""

    action: Action


def upstream(a: Action) -> int:
    """The stage u of the hop u -> u+1 a message belongs to (forward or gradient)."""
    return a.stage if a.kind in (Kind.SEND_F, Kind.RECV_B) else a.stage - 1


def is_forward(a: Action) -> bool:
    return a.kind in (Kind.SEND_F, Kind.RECV_F)


def label(a: Action) -> str:
    """The message's name, the same at both ends: "F3 0>1" (activations of microbatch 3, stage 0
    to 1), "B3 1>0" (their gradient)."""
    u = upstream(a)
    return f"F{a.microbatch} {u}>{u + 1}" if is_forward(a) else f"B{a.microbatch} {u + 1}>{u}"


def message_order(schedule: Schedule) -> list[list[Action]]:
    """Per rank, its SEND and RECV actions in the global message order (see the module docstring)."""
    timeline = simulate(schedule)
    done = {(a.kind, a.microbatch, a.stage): end for ev in timeline.events for _, end, a in ev}
    layout = Layout(len(schedule))

    def key(a: Action) -> tuple:
        u = upstream(a)
        producer = (Kind.F, a.microbatch, u) if is_forward(a) else (Kind.B, a.microbatch, u + 1)
        sender = layout.rank_of(producer[2])
        return (done[producer], sender, not is_forward(a), a.microbatch, u)

    return [
        sorted((a for a in actions if a.kind in SENDS + RECVS), key=key) for actions in schedule
    ]


def rank_program(
    schedule: Schedule,
    rank: int,
    skip: Callable[[Action], bool] = lambda a: False,
    order: list[Action] | None = None,
) -> list[Post | Run]:
    """What `rank` does in one step: its computes, and its messages posted in the global order
    (`skip`: hops with nothing to carry, which both ends leave out)."""
    order = [a for a in (order or message_order(schedule)[rank]) if not skip(a)]
    produced: set[tuple] = set()
    program: list[Post | Run] = []
    cursor = 0

    def flush() -> None:
        nonlocal cursor
        start = cursor
        while cursor < len(order):
            a = order[cursor]
            if a.kind in SENDS and (a.kind, a.microbatch, a.stage) not in produced:
                break
            cursor += 1
        if cursor > start:
            program.append(Post(tuple(order[start:cursor])))

    flush()
    for a in schedule[rank]:
        if a.kind in (Kind.F, Kind.B):
            program.append(Run(a))
            produced.add((Kind.SEND_F if a.kind == Kind.F else Kind.SEND_B, a.microbatch, a.stage))
            flush()
    if cursor != len(order):
        raise AssertionError(f"rank {rank}: message {order[cursor]} is never posted")
    return program


def consumed_receive(a: Action, rank_actions: Mapping[tuple, Action]) -> Action | None:
    """The receive a compute consumes, if the schedule has one (`rank_actions`: the rank's
    actions by (kind, microbatch, stage))."""
    return rank_actions.get(
        (Kind.RECV_F if a.kind == Kind.F else Kind.RECV_B, a.microbatch, a.stage)
    )


def program_trace(
    schedule: Schedule, skip: Callable[[Action], bool] = lambda a: False, nbytes: int = 1
) -> list[list[dict]]:
    """The P2P events the runtime issues, per rank, for `nccl_rules.replay` (no processes): each
    Post as a group; each consumed receive waited on before its compute, followed by waits on the
    earlier groups that sent to the same peer (the runtime frees those sends there); every group
    waited on at the end of the step. Waits count as waits for the whole group, as on NCCL."""
    traces = []
    orders = message_order(schedule)
    for rank in range(len(schedule)):
        events: list[dict] = []
        posted: dict[tuple, int] = {}
        sends_to: dict[int, set[int]] = {}  # group -> peers it sends to, not yet waited for
        keys = {(a.kind, a.microbatch, a.stage): a for a in schedule[rank]}
        group = list(range(len(schedule)))
        for step in rank_program(schedule, rank, skip, orders[rank]):
            if isinstance(step, Post):
                gid = len(events)
                ops = [
                    ["send" if a.kind in SENDS else "recv", a.peer, label(a), nbytes]
                    for a in step.actions
                ]
                events.append({"post": gid, "ops": ops, "group": group, "batched": True})
                posted.update({(a.kind, a.microbatch, a.stage): gid for a in step.actions})
                peers = {a.peer for a in step.actions if a.kind in SENDS}
                if peers:
                    sends_to[gid] = peers
            else:
                recv = consumed_receive(step.action, keys)
                if recv is not None and not skip(recv):
                    key = (recv.kind, recv.microbatch, recv.stage)
                    if key not in posted:
                        raise AssertionError(f"rank {rank}: {step.action} runs before its receive")
                    gid, peer = posted[key], recv.peer
                    events.append({"wait": gid})
                    for earlier, peers in sends_to.items():
                        if earlier < gid and peer in peers:
                            events.append({"wait": earlier})
                            peers.discard(peer)
        events += [{"wait": e["post"]} for e in list(events) if "post" in e]
        traces.append(events)
    return traces
