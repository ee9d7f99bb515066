"""How far each host's span clock is from rank 0's: NTP-style ping-pong over the process group.

Hosts' monotonic clocks start at different times and drift apart; a merged timeline needs them on
one time base. Processes on one host share its clock, so rank 0 measures one rank per host — the
one with local rank 0 (torchrun numbers a node's ranks contiguously) — and the others record that
they share its clock (`same_clock_as`). Measuring every rank would make rank 0 open a connection to
each of thousands of ranks (NCCL allocates buffers per peer); per host it is one per node.

Rank 0 exchanges `rounds` messages with each measured rank r: it reads its clock (t0), sends, r reads
its clock (tr) on arrival and answers, rank 0 reads t1 on the answer. Rank r's reading happened
between t0 and t1 on rank 0's clock, so (rank 0's clock − r's) lies in [t0 − tr, t1 − tr]; the round
with the shortest round trip gives the tightest interval. Rank 0 sends each rank its interval; the
merge (`observe/timeline.py`) narrows it further with causality (no message is received before it
was sent).

Each message is its own group through `p2p.post`, waited on at once, in one fixed order: it runs
under NCCL's rules too (device tensors there). It costs one all-gather of two integers and
hosts × rounds round trips, once, at start-up.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from depthscale.parallel import p2p


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
    if rank not in measured:
        return {"kind": "clock", "same_clock_as": rank - local_rank}
    group, traffic = dist.group.WORLD, p2p.Traffic()

    def send(values: list[int], peer: int, label: str) -> None:
        t = torch.tensor(values, dtype=torch.int64, device=device)
        p2p.post(group, [p2p.Send(t, peer, label)], [], device, traffic).wait()

    def recv(peer: int, label: str) -> list[int]:
        want = p2p.Recv((4,), torch.int64, peer, label)
        return p2p.post(group, [], [want], device, traffic).recv(label).tolist()

    if rank == 0:
        for peer in measured[1:]:
            best = None
            for i in range(rounds):
                t0 = now_ns()
                send([0, 0, 0, 0], peer, f"clock ping {i}")
                tr = recv(peer, f"clock pong {i}")[0]
                t1 = now_ns()
                if best is None or t1 - t0 < best[1] - best[0]:
                    best = (t0, t1, tr)
            t0, t1, tr = best
            lo, hi = t0 - tr, t1 - tr
            send([(lo + hi) // 2, lo, hi, t1 - t0], peer, "clock offset")
        return zero
    for i in range(rounds):
        recv(0, f"clock ping {i}")
        send([now_ns(), 0, 0, 0], 0, f"clock pong {i}")
    offset, lo, hi, rtt = recv(0, "clock offset")
    return {"kind": "clock", "offset_ns": offset, "lo_ns": lo, "hi_ns": hi, "rtt_ns": rtt}
