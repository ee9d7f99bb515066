"""The hang analysis on synthetic dumps: the silent rank named with its coordinates and the
operation the others wait in — with or without its own dump — chains, deadlocks, mismatches."""

from __future__ import annotations

import json

import pytest

from depthscale.observe.hang import analyze, format_report, load_dumps
from depthscale.observe.spans import trace_path
from depthscale.observe.watchdog import hang_path

PP2_DP2 = {r: {"pp": r // 2, "dp": r % 2, "cp": 0, "tp": 0} for r in range(4)}
CP4 = {r: {"pp": 0, "dp": 0, "cp": r, "tp": 0} for r in range(4)}


def _op(name, cat, waiting=True, **args):
    return {"name": name, "cat": cat, "ts": 0, "step": 3, "args": args, "waiting": waiting}


def _dump(rank, coords, *ops, stacks="Thread 0x1 (most recent call first):\n  File x.py"):
    step = _op("step", "step", waiting=False)
    return {"rank": rank, "world": len(coords), "coords": coords[rank], "in_flight": [step, *ops],
            "recent": [], "stacks": stacks, "step": 3}  # fmt: skip


def _all_reduce(seq, group="0,1,2,3"):
    return _op("all_reduce", "collective", group=group, seq=seq, bytes=8)


@pytest.mark.parametrize("culprit", range(4))
@pytest.mark.parametrize("keep_culprit_dump", [False, True])
def test_data_parallel_all_reduce(culprit, keep_culprit_dump):
    """The culprit stopped before the step's all-reduce: the others wait in it (#7); its own
    dump, when it wrote one (alive but stuck), shows it in its backward."""
    dumps = {r: _dump(r, PP2_DP2, _all_reduce(7)) for r in range(4) if r != culprit}
    if keep_culprit_dump:
        dumps[culprit] = _dump(culprit, PP2_DP2, _op("backward", "compute", waiting=False))
    report = analyze(dumps, 4, {r: {"coords": c} for r, c in PP2_DP2.items()})
    assert report.culprits == [culprit]
    assert set(report.waiting_on(culprit)) == set(range(4)) - {culprit}
    text = format_report(report, dumps)
    assert f"culprit: rank {culprit} (pp{culprit // 2} dp{culprit % 2} cp0 tp0)" in text
    assert "all_reduce over ranks [0,1,2,3] #7" in text
    assert ("no hang dump" in text) is not keep_culprit_dump


@pytest.mark.parametrize("culprit", range(4))
def test_pipeline_recv_chain(culprit):
    """pp=2 × dp=2: the culprit's stage peer waits in a receive from it; that peer's data-parallel
    partner waits for the peer in the gradient all-reduce of their stage — a chain that ends at
    the culprit, not at the peer."""
    peer = (culprit + 2) % 4  # the same dp, the other stage
    partner = peer ^ 1  # the peer's data-parallel partner
    group = f"{min(peer, partner)},{max(peer, partner)}"
    dumps = {
        peer: _dump(peer, PP2_DP2, _op("send", "pp", waiting=False, peer=culprit, label="step 3: F0"),
                    _op("recv", "pp", peer=culprit, label="step 3: B1 1>0")),
        partner: _dump(partner, PP2_DP2, _all_reduce(4, group)),
        culprit ^ 1: _dump(culprit ^ 1, PP2_DP2, _op("backward", "compute", waiting=False)),
    }  # fmt: skip
    report = analyze(dumps, 4, {r: {"coords": c} for r, c in PP2_DP2.items()})
    assert report.culprits == [culprit], format_report(report)
    assert report.waiting_on(culprit)[peer]["args"]["label"] == "step 3: B1 1>0"
    assert "pp recv from rank" in format_report(report)


@pytest.mark.parametrize("culprit", range(4))
def test_ring_send(culprit):
    """cp=4 ring: the culprit stopped before its K/V send; its successor waits in the receive from
    it, and the rest of the ring in theirs from their predecessors."""
    dumps = {
        r: _dump(r, CP4, _op("recv", "cp", peer=(r - 1) % 4, label=f"call 9 forward: kv{r} hop1"))
        for r in range(4)
        if r != culprit
    }
    report = analyze(dumps, 4, {r: {"coords": c} for r, c in CP4.items()})
    assert report.culprits == [culprit]
    assert list(report.waiting_on(culprit)) == [(culprit + 1) % 4]
    assert f"rank {culprit} (pp0 dp0 cp{culprit} tp0)" in format_report(report)


def test_a_cycle_is_a_deadlock():
    dumps = {
        0: _dump(0, CP4, _op("recv", "cp", peer=1, label="a")),
        1: _dump(1, CP4, _op("recv", "cp", peer=0, label="b")),
        2: _dump(2, CP4),
        3: _dump(3, CP4),
    }
    report = analyze(dumps, 4)
    assert report.culprits == [] and report.deadlock == [0, 1]
    assert format_report(report).startswith("deadlock: ranks 0, 1")


def test_members_in_different_collectives_are_reported():
    dumps = {0: _dump(0, CP4, _all_reduce(5)), 1: _dump(1, CP4, _all_reduce(6)),
             2: _dump(2, CP4, _all_reduce(5)), 3: _dump(3, CP4, _all_reduce(5))}  # fmt: skip
    report = analyze(dumps, 4)
    assert any("issued different collectives" in p for p in report.problems)


def test_dumps_and_metas_are_read_from_the_run(tmp_path):
    with pytest.raises(ValueError, match="holds no hang dumps"):
        load_dumps(tmp_path)
    for rank in range(4):
        path = trace_path(tmp_path, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"kind": "meta", "rank": rank, "world": 4,
                                    "coords": PP2_DP2[rank]}) + "\n")  # fmt: skip
        if rank != 1:
            hang_path(tmp_path, rank).parent.mkdir(parents=True, exist_ok=True)
            hang_path(tmp_path, rank).write_text(json.dumps(_dump(rank, PP2_DP2, _all_reduce(2))))
    (tmp_path / "trace" / "hang" / "rank00009.json").write_text("{cut")
    (tmp_path / "trace" / "hang" / "rank00008.json").write_text("[1, 2]")
    peerless = {**_dump(5, PP2_DP2 | {5: {}}, _op("recv", "pp")), "world": 4}
    (tmp_path / "trace" / "hang" / "rank00005.json").write_text(json.dumps(peerless))
    dumps, metas, world, problems = load_dumps(tmp_path)
    assert (sorted(dumps), world) == ([0, 2, 3], 4) and len(problems) == 3
    assert all("read as if the rank wrote none" in p for p in problems)
    report = analyze(dumps, world, metas)
    assert report.culprits == [1] and report.coords[1] == PP2_DP2[1]


def _recorder(enqueued: dict[str, int], *pending: tuple[str, int, str]) -> dict:
    """A Flight Recorder snapshot: collectives enqueued per group, and the pending ones."""
    ranks = {"3": [0, 1], "5": [2, 3], "0": [0, 1, 2, 3]}
    groups = {
        g: {"ranks": ranks[g], "desc": f"mesh_{g}", "enqueued": n} for g, n in enqueued.items()
    }
    return {
        "groups": groups,
        "in_flight": [{"group": g, "seq": k, "op": op} for g, k, op in pending],
    }


@pytest.mark.parametrize("keep_culprit_dump", [False, True])
def test_a_collective_only_the_flight_recorder_saw(keep_culprit_dump):
    """FSDP's reduction inside backward: no span shows a communication, the recorder does. Rank 1
    stopped in its backward before enqueueing collective #12 of group "3" (ranks 0, 1); rank 0
    waits in it; ranks 2 and 3 (group "5") wait in the next step's all-reduce over everyone."""
    backward = _op("backward", "compute", waiting=False)
    dumps = {
        0: {**_dump(0, PP2_DP2, backward), "flight_recorder": _recorder({"3": 12, "0": 3}, ("3", 12, "all_reduce"))},
        2: {**_dump(2, PP2_DP2, _all_reduce(4)), "flight_recorder": _recorder({"5": 12, "0": 4}, ("0", 4, "all_reduce"))},
        3: {**_dump(3, PP2_DP2, _all_reduce(4)), "flight_recorder": _recorder({"5": 12, "0": 4}, ("0", 4, "all_reduce"))},
    }  # fmt: skip
    if keep_culprit_dump:  # alive, stuck in its own backward: it enqueued 11 collectives in "3"
        dumps[1] = {**_dump(1, PP2_DP2, backward), "flight_recorder": _recorder({"3": 11, "0": 3})}
    report = analyze(dumps, 4)
    assert report.culprits == [1], report
    text = format_report(report, dumps)
    assert (
        "rank 0 (pp0 dp0 cp0 tp0) waits in all_reduce over ranks [0,1] #12 (from torch's flight recorder, process group mesh_3)"
        in text
    )
    assert report.waiters[2].waits_for == {0, 1}  # they wait for 0 (blocked) and 1 (the culprit)


def test_a_member_that_enqueued_the_collective_is_not_waited_for():
    dumps = {
        r: {**_dump(r, PP2_DP2, _all_reduce(9)), "flight_recorder": _recorder({"0": 40}, ("0", 40, "all_reduce"))}
        for r in (0, 1, 2)
    }  # fmt: skip
    dumps[3] = {**_dump(3, PP2_DP2), "flight_recorder": _recorder({"0": 39})}
    report = analyze(dumps, 4)
    assert report.culprits == [3] and all(report.waiters[r].waits_for == {3} for r in (0, 1, 2))
    del dumps[3]["flight_recorder"]  # no record of the group: unknown, said so, nobody blamed
    report = analyze(dumps, 4)
    assert report.culprits == [] and any("is unknown" in p for p in report.problems)


def test_the_report_shows_the_chain_and_a_live_culprits_training_stack():
    """pp=2 × dp=2: rank 2 is alive but stuck in its own forward; rank 0 waits for it, rank 1 waits
    for rank 0 behind it. The culprit's stack is its training thread's, not the watchdog's."""
    stacks = (
        "Current thread 0x2 (most recent call first):\n  File watchdog.py, line 38 in python_stacks\n\n"
        "Thread 0x1 (most recent call first):\n  File layers.py, line 9 in forward\n"
        "  File trainer.py, line 277 in _fit\n"
    )
    dumps = {
        0: _dump(0, PP2_DP2, _op("recv", "pp", peer=2, label="step 3: B0 1>0")),
        1: _dump(1, PP2_DP2, _op("recv", "pp", peer=0, label="step 3: F1 0>1")),
        2: _dump(2, PP2_DP2, _op("forward", "compute", waiting=False), stacks=stacks),
    }
    report = analyze(dumps, 3)
    text = format_report(report, dumps)
    assert report.culprits == [2] and "stuck in its own work" in text
    assert "File layers.py, line 9 in forward" in text and "python_stacks" not in text
    assert "waiting behind them:\n  rank 1 (pp0 dp1 cp0 tp0) waits in pp recv from rank 0" in text


# --------------------------------------------------------------------------- NCCL's recorder


def _torch_nccl_dump(enqueued: int, started: int, completed: int, timing: bool = True) -> dict:
    """What `_dump_nccl_trace` returns (torch's field names) for one rank of the world group
    (pg "0", ranks 0-3): collectives 1..`enqueued` queued by the host, the device through
    `completed`, and through `started` when torch tracks starts (else -1)."""
    entries = []
    for seq in range(max(1, completed - 2), enqueued + 1):
        state = "completed" if seq <= completed else "started" if seq <= started else "scheduled"
        entries.append({
            "record_id": seq, "pg_id": 0, "process_group": ("0", "default_pg"),
            "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq,
            "profiling_name": "nccl:all_reduce", "time_created_ns": 1000 * seq,
            "state": state if timing or state == "completed" else "scheduled",
            "time_discovered_started_ns": 1000 * seq + 5 if timing and seq <= started else None,
            "time_discovered_completed_ns": 1000 * seq + 9 if seq <= completed else None,
            "retired": seq <= completed, "is_p2p": False, "timeout_ms": 600_000,
        })  # fmt: skip
    return {
        "version": "2.10",
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"}},
        "pg_status": {"0": {"last_enqueued_collective": enqueued,
                            "last_started_collective": started if timing else -1,
                            "last_completed_collective": completed}},
        "entries": entries,
    }  # fmt: skip


def _nccl_recorder(*args, **kwargs) -> dict:
    from depthscale.observe.flight_recorder import reduce

    groups, pending = {}, []
    reduce(_torch_nccl_dump(*args, **kwargs), True, groups, pending)
    return {"groups": groups, "in_flight": [e for _, e in pending]}


def _nccl_dumps(recorders: dict[int, dict]) -> dict[int, dict]:
    """Every host is in its optimizer step (blocked reading the loss): no span shows a
    communication, as on NCCL, where a collective returns as soon as it is queued."""
    host = _op("optimizer", "compute", waiting=False)
    return {r: {**_dump(r, CP4, host), "flight_recorder": fr} for r, fr in recorders.items()}


def test_nccl_names_the_rank_whose_gpu_never_started_the_collective(monkeypatch):
    """The host ran ahead on every rank: all four enqueued all-reduces #40-42, so the enqueued
    counts blame nobody (the rule before). Ranks 0-2's GPUs started #40 and wait in it; rank 3's
    GPU is stuck in a kernel of its own and never started it: it is the culprit."""
    monkeypatch.delenv("TORCH_NCCL_ENABLE_TIMING", raising=False)
    dumps = _nccl_dumps({r: _nccl_recorder(42, 40, 39) for r in range(3)})
    dumps[3] = _nccl_dumps({3: _nccl_recorder(42, 39, 39)})[3]
    report = analyze(dumps, 4)
    assert report.culprits == [3], format_report(report, dumps)
    assert all(report.waiters[r].waits_for == {3} for r in range(3)) and 3 not in report.waiters
    text = format_report(report, dumps)
    assert "culprit: rank 3 (pp0 dp0 cp3 tp0) is not blocked in any communication" in text
    assert (
        "its GPU in the group of ranks [0,1,2,3]: enqueued #42, started #39, completed #39" in text
    )
    assert (
        "rank 0 (pp0 dp0 cp0 tp0) waits in all_reduce over ranks [0,1,2,3] #40 (from torch's "
        "flight recorder, process group default_pg, started on its GPU)" in text
    )
    # silent (no dump at all): named the same way
    del dumps[3]
    assert analyze(dumps, 4).culprits == [3]


def test_nccl_every_gpu_in_the_collective_is_nobodys_fault(monkeypatch):
    monkeypatch.delenv("TORCH_NCCL_ENABLE_TIMING", raising=False)
    dumps = _nccl_dumps({r: _nccl_recorder(42, 40, 39) for r in range(4)})
    report = analyze(dumps, 4)
    assert report.culprits == [] and not any(w.waits_for for w in report.waiters.values())
    assert any("NCCL or the network hangs" in p for p in report.problems), report.problems


def test_nccl_without_start_tracking_falls_back_to_what_was_enqueued(monkeypatch):
    """Without TORCH_NCCL_ENABLE_TIMING torch records no starts: a host that fell behind is still
    found by its enqueued count; hosts that all queued the collective are reported as unknown."""
    monkeypatch.delenv("TORCH_NCCL_ENABLE_TIMING", raising=False)
    monkeypatch.delenv("TORCH_NCCL_DESYNC_DEBUG", raising=False)
    recorders = {r: _nccl_recorder(42, 40, 39, timing=False) for r in range(4)}
    assert recorders[0]["groups"]["0"]["started"] is None
    report = analyze(_nccl_dumps(recorders), 4)
    assert report.culprits == [] and any("TORCH_NCCL_ENABLE_TIMING=1" in p for p in report.problems)
    recorders[3] = _nccl_recorder(39, 39, 39, timing=False)  # its host never queued #40
    report = analyze(_nccl_dumps(recorders), 4)
    assert report.culprits == [3] and report.waiters[0].waits_for == {3}
