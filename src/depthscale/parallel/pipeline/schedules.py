"""Pipeline schedules as pure data: per-rank lists of actions.

A model of C = P·V chunks (global stages) is placed round-robin: rank r holds stages r, r+P, r+2P, …
(Megatron's interleaved layout; V = 1 is plain 1F1B/GPipe). A schedule turns (P, V, microbatches) into,
for every rank, the ordered actions it executes:

    F / B            forward / backward of (microbatch, stage)
    RECV_F / SEND_F  activations (depth states) from / to the neighbouring stage's rank
    RECV_B / SEND_B  gradients from / to the neighbouring stage's rank

Sends and receives are separate actions (MegaScale): the runtime posts a receive early and waits only
when the compute that needs it starts, and a send never blocks the next compute. Nothing here touches
torch or processes, so schedules can be tested, simulated and drawn on their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum


class Kind(StrEnum):
    F = "F"
    B = "B"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"


@dataclass(frozen=True)
class Action:
    kind: Kind
    microbatch: int
    stage: int
    peer: int | None = None
    """The other rank of a SEND/RECV."""

    def __str__(self) -> str:
        peer = (
            f"->{self.peer}"
            if self.kind.startswith("SEND")
            else f"<-{self.peer}"
            if self.peer is not None
            else ""
        )
        return f"{self.kind.value}{self.microbatch}.{self.stage}{peer}"


@dataclass(frozen=True)
class Layout:
    ranks: int
    virtual: int = 1

    @property
    def stages(self) -> int:
        return self.ranks * self.virtual

    def rank_of(self, stage: int) -> int:
        return stage % self.ranks

    def stages_of(self, rank: int) -> list[int]:
        return [rank + v * self.ranks for v in range(self.virtual)]


Schedule = list[list[Action]]


def split_layers(n_layers: int, n_stages: int, ends_fewer: int = 0) -> list[range]:
    """Contiguous, balanced layer ranges; earlier stages take the remainder. With fewer layers than
    stages the trailing stages are empty and just pass the depth state on (the last adds the head).

    `ends_fewer`: the first and the last stage take that many layers fewer than a balanced split
    of n + 2·ends_fewer would give them — they also run the embedding and the head, and the first
    keeps the most micro-batches in flight (Llama 3 405B: 126 layers on 16 × 8 one-layer stages,
    the first and the last empty)."""
    if n_stages == 1 or ends_fewer == 0:
        sizes = _balanced(n_layers, n_stages)
    else:
        sizes = _balanced(n_layers + 2 * ends_fewer, n_stages)
        sizes[0] -= ends_fewer
        sizes[-1] -= ends_fewer
        if min(sizes[0], sizes[-1]) < 0:
            raise ValueError(
                f"{n_layers} layers over {n_stages} stages leave the end stages fewer than "
                f"{ends_fewer} layers to give up"
            )
    bounds, start = [], 0
    for size in sizes:
        bounds.append(range(start, start + size))
        start += size
    return bounds


def _balanced(n: int, parts: int) -> list[int]:
    base, extra = divmod(n, parts)
    return [base + (1 if s < extra else 0) for s in range(parts)]


def gpipe(ranks: int, microbatches: int) -> Schedule:
    """All forwards, then all backwards (peak in-flight = microbatches on every rank)."""
    layout = Layout(ranks)
    order = [
        [("F", m) for m in range(microbatches)] + [("B", m) for m in reversed(range(microbatches))]
        for _ in range(ranks)
    ]
    return _with_communication(layout, [[(k, m, r) for k, m in order[r]] for r in range(ranks)])


def one_f_one_b(ranks: int, microbatches: int) -> Schedule:
    """1F1B: rank r runs P−r−1 warm-up forwards, then alternates one forward and one backward, so at
    most P−r microbatches are in flight (instead of all of them as in GPipe)."""
    return interleaved_1f1b(ranks, 1, microbatches)


def interleaved_1f1b(ranks: int, virtual: int, microbatches: int) -> Schedule:
    """Megatron's interleaved 1F1B with `virtual` chunks per rank; bubble (P−1)/(V·M) of the ideal time.

    Forwards visit (microbatch, chunk) in groups of P microbatches per chunk; backwards the same with
    chunks reversed. Warm-up is (P−r−1)·2 + (V−1)·P forwards, then 1F1B, then the remaining backwards.
    """
    if ranks < 1 or virtual < 1 or microbatches < 1:
        raise ValueError(
            f"ranks={ranks}, virtual={virtual}, microbatches={microbatches} must be >= 1"
        )
    if virtual > 1 and microbatches % ranks:
        raise ValueError(
            f"interleaved 1F1B needs microbatches ({microbatches}) divisible by the "
            f"pipeline ranks ({ranks})"
        )
    layout = Layout(ranks, virtual)
    total = microbatches * virtual

    def unit(k: int, forward: bool) -> tuple[int, int]:
        group, within = divmod(k, ranks * virtual)
        chunk = within // ranks
        if not forward:
            chunk = virtual - 1 - chunk
        return group * ranks + within % ranks, chunk

    orders = []
    for r in range(ranks):
        if virtual == 1:
            warmup = min(ranks - r - 1, microbatches)
        else:
            warmup = min((ranks - r - 1) * 2 + (virtual - 1) * ranks, total)

        def op(kind: str, k: int, r: int = r) -> tuple[str, int, int]:
            m, c = unit(k, kind == "F")
            return kind, m, layout.stages_of(r)[c]

        seq = [op("F", f) for f in range(warmup)]  # warm-up
        for b, f in enumerate(range(warmup, total)):  # steady state: one forward, one backward
            seq += [op("F", f), op("B", b)]
        seq += [op("B", b) for b in range(total - warmup, total)]  # cool-down
        orders.append(seq)
    return _with_communication(layout, orders)


def _with_communication(layout: Layout, orders: list[list[tuple]]) -> Schedule:
    """Insert RECV before the compute that needs remote data and SEND right after the compute that
    produced it. A hop between two stages on the same rank (P = 1) needs no message."""
    schedule: Schedule = []
    last = layout.stages - 1
    for rank, order in enumerate(orders):
        actions: list[Action] = []
        for item in order:
            kind, m = item[0], item[1]
            stage = item[2] if len(item) == 3 else rank
            if kind == "F":
                if stage > 0 and layout.rank_of(stage - 1) != rank:
                    actions.append(Action(Kind.RECV_F, m, stage, layout.rank_of(stage - 1)))
                actions.append(Action(Kind.F, m, stage))
                if stage < last and layout.rank_of(stage + 1) != rank:
                    actions.append(Action(Kind.SEND_F, m, stage, layout.rank_of(stage + 1)))
            else:
                if stage < last and layout.rank_of(stage + 1) != rank:
                    actions.append(Action(Kind.RECV_B, m, stage, layout.rank_of(stage + 1)))
                actions.append(Action(Kind.B, m, stage))
                if stage > 0 and layout.rank_of(stage - 1) != rank:
                    actions.append(Action(Kind.SEND_B, m, stage, layout.rank_of(stage - 1)))
        schedule.append(actions)
    return schedule


def forward_only(ranks: int, virtual: int, microbatches: int) -> Schedule:
    """Evaluation: forwards only, in (microbatch, stage) order on every rank (deadlock-free: a rank
    only ever waits for an earlier (microbatch, stage))."""
    layout = Layout(ranks, virtual)
    orders = [
        [("F", m, s) for m in range(microbatches) for s in layout.stages_of(r)]
        for r in range(ranks)
    ]
    return _with_communication(layout, orders)


def build_schedule(name: str, ranks: int, virtual: int, microbatches: int) -> Schedule:
    if name == "gpipe":
        if virtual != 1:
            raise ValueError("gpipe takes virtual=1")
        return gpipe(ranks, microbatches)
    if name == "1f1b":
        return interleaved_1f1b(ranks, virtual, microbatches)
    raise ValueError(f"unknown pipeline schedule {name!r}; allowed: 'gpipe', '1f1b'")


# ---------------------------------------------------------------------------------------------
# Simulation: execute the lists with non-blocking sends and blocking receives.


@dataclass
class Timeline:
    events: list[list[tuple[float, float, Action]]]
    """Per rank: (start, end, action) of every compute action."""
    makespan: float
    peak_in_flight: list[int]
    """Per rank: the most microbatch-chunks whose forward ran and backward has not."""

    def bubble_ratio(self, forward_cost: float, backward_cost: float) -> float:
        """Idle time over ideal compute time, averaged over ranks; compare with (P−1)/(V·M)."""
        ideal = [sum(e - s for s, e, _ in ev) for ev in self.events]
        return sum(self.makespan - i for i in ideal) / sum(ideal)


class DeadlockError(RuntimeError):
    pass


def simulate(
    schedule: Schedule,
    forward_cost: float | Sequence[float] = 1.0,
    backward_cost: float | Sequence[float] = 2.0,
    latency: float = 0.0,
) -> Timeline:
    """Run the per-rank lists as a discrete-event simulation. Raises DeadlockError if every rank
    waits on a message that is never sent, and ValueError if a dependency is violated. A cost is
    one number for every stage, or one per stage (the planner's stages differ: the first holds
    the embedding, the last the head).

    Messages are matched by what they carry, with sends that never block: this checks the
    schedule's dependencies, not how NCCL would run its messages — `p2p_order` orders those and
    `nccl_rules.replay` checks them."""
    ranks = len(schedule)
    n_stages = _n_stages(schedule)
    f_cost = _per_stage(forward_cost, n_stages)
    b_cost = _per_stage(backward_cost, n_stages)
    clock = [0.0] * ranks
    pc = [0] * ranks
    messages: dict[tuple, float] = {}  # (kind, microbatch, stage, src, dst) -> arrival time
    done_f: dict[tuple[int, int], float] = {}
    done_b: dict[tuple[int, int], float] = {}
    events: list[list[tuple[float, float, Action]]] = [[] for _ in range(ranks)]
    in_flight = [0] * ranks
    peak = [0] * ranks
    ready_at: dict[int, float] = {r: 0.0 for r in range(ranks)}
    while any(pc[r] < len(schedule[r]) for r in range(ranks)):
        progressed = False
        for r in range(ranks):
            while pc[r] < len(schedule[r]):
                a = schedule[r][pc[r]]
                if a.kind in (Kind.SEND_F, Kind.SEND_B):
                    messages[(a.kind.value[-1], a.microbatch, a.stage, r, a.peer)] = (
                        clock[r] + latency
                    )
                elif a.kind in (Kind.RECV_F, Kind.RECV_B):
                    src_stage = a.stage - 1 if a.kind == Kind.RECV_F else a.stage + 1
                    key = (a.kind.value[-1], a.microbatch, src_stage, a.peer, r)
                    if key not in messages:
                        break
                    ready_at[r] = max(ready_at[r], messages.pop(key))
                elif a.kind == Kind.F:
                    _check_forward(a, done_f)
                    start = max(clock[r], ready_at[r])
                    clock[r] = start + f_cost[a.stage]
                    done_f[(a.microbatch, a.stage)] = clock[r]
                    events[r].append((start, clock[r], a))
                    in_flight[r] += 1
                    peak[r] = max(peak[r], in_flight[r])
                else:
                    _check_backward(a, done_f, done_b, n_stages)
                    start = max(clock[r], ready_at[r])
                    clock[r] = start + b_cost[a.stage]
                    done_b[(a.microbatch, a.stage)] = clock[r]
                    events[r].append((start, clock[r], a))
                    in_flight[r] -= 1
                pc[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: str(schedule[r][pc[r]]) for r in range(ranks) if pc[r] < len(schedule[r])}
            raise DeadlockError(f"pipeline schedule deadlocks; ranks wait at {stuck}")
    if messages:
        raise ValueError(f"messages sent but never received: {sorted(messages)[:5]}")
    return Timeline(events, max(clock), peak)


def _per_stage(cost: float | Sequence[float], n_stages: int) -> list[float]:
    if isinstance(cost, int | float):
        return [float(cost)] * n_stages
    if len(cost) != n_stages:
        raise ValueError(f"{len(cost)} costs for {n_stages} stages")
    return [float(c) for c in cost]


def _n_stages(schedule: Schedule) -> int:
    return 1 + max(a.stage for actions in schedule for a in actions)


def _check_forward(a: Action, done_f: dict) -> None:
    if (a.microbatch, a.stage) in done_f:
        raise ValueError(f"forward {a} runs twice")
    if a.stage > 0 and (a.microbatch, a.stage - 1) not in done_f:
        raise ValueError(f"forward {a} runs before its previous stage's forward")


def _check_backward(a: Action, done_f: dict, done_b: dict, n_stages: int) -> None:
    if (a.microbatch, a.stage) in done_b:
        raise ValueError(f"backward {a} runs twice")
    if (a.microbatch, a.stage) not in done_f:
        raise ValueError(f"backward {a} runs before its forward")
    if a.stage < n_stages - 1 and (a.microbatch, a.stage + 1) not in done_b:
        raise ValueError(f"backward {a} runs before the next stage's backward")


def format_schedule(schedule: Schedule) -> str:
    """One line per rank, for printing and docs."""
    return "\n".join(
        f"rank {r}: " + " ".join(str(a) for a in actions if a.kind in (Kind.F, Kind.B))
        for r, actions in enumerate(schedule)
    )
