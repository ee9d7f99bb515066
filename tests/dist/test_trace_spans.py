"""Spans recorded by real gloo processes: clock offsets measured under injected skew, and every
message's two ends (p2p.post) and every collective (spans.collective) recorded so that the merge
can pair them."""

from __future__ import annotations

import json
import os

import time

import torch
import torch.distributed as dist

from depthscale.observe import spans
from depthscale.observe.spans import SKEW_ENV, SpanRecorder, trace_path
from depthscale.parallel import p2p
from depthscale.parallel.clock_sync import measure_offset

SKEW_MS = {1: 50.0, 2: -50.0, 3: 25.0}


class _Ring(p2p.Traffic):
    channel = "cp"


def _record(run_dir: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ[SKEW_ENV] = ",".join(f"{r}:{ms}" for r, ms in SKEW_MS.items())
    try:
        recorder = SpanRecorder(trace_path(run_dir, rank), {"rank": rank, "world": world})
    finally:
        del os.environ[SKEW_ENV]
    # one host: rank 0 measures the ranks whose clocks the drill shifted, and only those
    clock = measure_offset(recorder.now_ns, torch.device("cpu"), rank, recorder.skew_ns != 0)
    old = spans.activate(recorder)
    try:
        for step in range(3):  # a ring: send to the next rank, receive from the previous one
            spans.set_step(step + 1)
            nxt, prev = (rank + 1) % world, (rank - 1) % world
            send = p2p.Send(torch.full((4,), float(rank)), nxt, f"hop {step} {rank}>{nxt}")
            recv = p2p.Recv((4,), torch.float32, prev, f"hop {step} {prev}>{rank}")
            batch = p2p.post(dist.group.WORLD, [send], [recv], torch.device("cpu"), _Ring())
            got = batch.recv(recv.label)
            batch.wait()
            assert got[0].item() == prev
            total = torch.ones(1)
            with spans.collective("all_reduce", None, total):
                dist.all_reduce(total)
    finally:
        spans.activate(old)
        recorder.close()
    return clock


def test_clock_offsets_undo_injected_skew_and_messages_pair(dist_pool, tmp_path):
    clocks = dist_pool(4).run(_record, str(tmp_path))
    for rank, clock in enumerate(clocks):
        # rank 0's clock = this rank's + offset, and this rank's clock runs SKEW ms ahead
        true = -SKEW_MS.get(rank, 0.0) * 1e6
        assert clock["lo_ns"] <= true + 1e6 and true - 1e6 <= clock["hi_ns"], clock
        assert abs(clock["offset_ns"] - true) <= 1e6, (rank, clock)
    records = {
        rank: [json.loads(line) for line in trace_path(tmp_path, rank).read_text().splitlines()]
        for rank in range(4)
    }
    sends, recvs, collectives = {}, {}, {}
    for rank, lines in records.items():
        assert lines[0]["kind"] == "meta" and lines[0]["rank"] == rank
        for r in lines[1:]:
            a = r.get("args", {})
            if r["name"] == "send":
                sends[(rank, a["peer"], a["label"])] = r
            elif r["name"] == "recv":
                recvs[(a["peer"], rank, a["label"])] = r
            elif r["cat"] == "collective":
                collectives.setdefault((a["group"], a["seq"]), set()).add(rank)
    assert len(sends) == 12 and sends.keys() == recvs.keys()
    assert all(r["cat"] == "cp" and r["args"]["group"] == "0,1,2,3" for r in sends.values())
    assert all(r["args"]["bytes"] == 16 for r in [*sends.values(), *recvs.values()])
    assert collectives == {("0,1,2,3", seq): {0, 1, 2, 3} for seq in (1, 2, 3)}
    for key, send in sends.items():  # on the corrected time base, no message arrives before it left
        src, dst, _ = key
        recv = recvs[key]
        sent = send["ts"] + clocks[src]["offset_ns"]
        arrived = recv["ts"] + recv["dur"] + clocks[dst]["offset_ns"]
        assert arrived - sent >= -1e6, (key, arrived - sent)


def _flight_recorder_while_a_peer_is_late() -> dict:
    from depthscale.observe import flight_recorder
    from depthscale.parallel.startup import own_group

    rank = dist.get_rank()
    pair = own_group([[0, 1], [2, 3]], "pair")  # not `new_group([0, 1])`: see parallel/startup.py
    x = torch.ones(2)
    dist.all_reduce(x, group=pair)  # collective #1 of the pair, done
    seen = None
    if rank == 0:
        work = dist.all_reduce(x, group=pair, async_op=True)  # #2: rank 1 is not there yet
        seen = flight_recorder.snapshot()
        dist.barrier()
        work.wait()
    else:
        if rank == 1:  # before it enqueues #2; gloo marks #1 complete from its own thread,
            deadline = time.monotonic() + 30  # a moment after wait() returned: poll for that
            while True:
                seen = flight_recorder.snapshot()
                pending = [e for e in seen["in_flight"] if e["group"] == pair.group_name]
                if not pending or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
        dist.barrier()
        if rank == 1:
            dist.all_reduce(x, group=pair)
    dist.barrier()
    return {**seen, "pair": pair.group_name} if seen is not None else None


def test_flight_recorder_names_the_pending_collective_and_who_enqueued_it(dist_pool):
    """What the hang analysis reads from torch's Flight Recorder on gloo: rank 0 is in the pair's
    collective #2, which rank 1 has not enqueued (its count is 1)."""
    waiting, late = dist_pool(4).run(_flight_recorder_while_a_peer_is_late)[:2]
    name = waiting["pair"]  # the workers are shared: other tests' groups of [0, 1] are there too
    assert waiting["groups"][name]["ranks"] == [0, 1]
    assert waiting["groups"][name]["enqueued"] == 2
    assert {"group": name, "seq": 2, "op": "all_reduce"} in waiting["in_flight"]
    assert late["pair"] == name
    assert late["groups"][name] == {**waiting["groups"][name], "enqueued": 1}
    assert not [e for e in late["in_flight"] if e["group"] == name]
