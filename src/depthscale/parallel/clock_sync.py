"""How far each host's span clock is from rank 0's: NTP-style ping-pong through the rendezvous store.

Hosts' monotonic clocks start at different times and drift apart; a merged timeline needs them on
one time base. Processes on one host share its clock, so rank 0 measures one rank per host — the
one with local rank 0 (torchrun numbers a node's ranks contiguously) — and the others record that
they share its clock (`same_clock_as`).

Rank 0 exchanges `rounds` messages with each measured rank r: it reads its clock (t0), sends, r reads
its clock (tr) on arrival and answers, rank 0 reads t1 on the answer. Rank r's reading happened
between t0 and t1 on rank 0's clock, so (rank 0's clock − r's) lies in [t0 − tr, t1 − tr]; the round
with the shortest round trip gives the tightest interval. Rank 0 sends each rank its interval; the
merge (`observe/timeline.py`) narrows it further with causality (no message is received before it
was sent).

The messages are keys in the rendezvous store (the world group's), not messages of a process
group: under NCCL a first message between two ranks builds a communicator for that pair (an
`ncclCommInit` and its buffers on both GPUs), so rank 0 would have built one per node, one after
the other, at every start, and kept them all run long. Through the store a round trip is two
TCP hops (rank 0 → store → r, and back); the interval stays exact, only a little wider. It costs
one all-gather of two integers and hosts × rounds round trips, once, at start-up.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

_calls = itertools.count()
"""This process's `measure_offset` calls: each call's keys are its own (every rank makes the same
calls, in the same order)."""


def measured_ranks(local_ranks: list[int], own_clock: list[bool]) -> list[int]:
    """The ranks rank 0 measures: rank 0, every host's local rank 0, and every rank whose clock
    is its own (a drill's injected skew) or whose host leader's is."""
    chosen = []
    for rank, local in enumerate(local_ranks):
        leader = rank - local
        if rank == 0 or local == 0 or own_clock[rank] or own_clock[leader]:
            chosen.append(rank)
    return chosen


def measure_offset(
    now_ns: Callable[[], int],
    device: torch.device,
    local_rank: int = 0,
    own_clock: bool = False,
    rounds: int = 16,
) -> dict:
    """This rank's `clock` record: offset_ns (midpoint), lo_ns, hi_ns, rtt_ns (all 0 on rank 0),
    or `same_clock_as` (the rank measured for its host). Every rank of the default group must call
    it together; `own_clock`: this rank's clock is not its host's (a drill shifted it)."""
    zero = {"kind": "clock", "offset_ns": 0, "lo_ns": 0, "hi_ns": 0, "rtt_ns": 0}
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return zero
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = torch.tensor([local_rank, int(own_clock)], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    pairs = torch.stack(every).tolist()
    measured = measured_ranks([p[0] for p in pairs], [bool(p[1]) for p in pairs])
    call = next(_calls)
    if rank not in measured:
        return {"kind": "clock", "same_clock_as": rank - local_rank}
    store = distributed_c10d._get_default_store()  # its timeout: parallel.setup_timeout_s

    def key(peer: int, what: str) -> str:
        return f"depthscale/clock/{call}/{peer}/{what}"

    if rank == 0:
        for peer in measured[1:]:
            best = None
            for i in range(rounds):
                t0 = now_ns()
                store.set(key(peer, f"ping{i}"), b"")
                tr = int(store.get(key(peer, f"pong{i}")))  # waits for the key
                t1 = now_ns()
                if best is None or t1 - t0 < best[1] - best[0]:
                    best = (t0, t1, tr)
            t0, t1, tr = best
            lo, hi = t0 - tr, t1 - tr
            store.set(key(peer, "offset"), f"{(lo + hi) // 2},{lo},{hi},{t1 - t0}")
        return zero
    for i in range(rounds):
        store.get(key(rank, f"ping{i}"))
        store.set(key(rank, f"pong{i}"), str(now_ns()))
    offset, lo, hi, rtt = map(int, store.get(key(rank, "offset")).decode().split(","))
    return {"kind": "clock", "offset_ns": offset, "lo_ns": lo, "hi_ns": hi, "rtt_ns": rtt}
