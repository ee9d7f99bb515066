"""Merging per-rank trace files: clock alignment under injected skew, one arrow per message, the
format's rules, damaged files."""

from __future__ import annotations

import json
import random

import pytest

from depthscale.errors import DepthscaleError
from depthscale.observe.spans import trace_path
from depthscale.observe.timeline import (
    align_clocks,
    match_messages,
    pipeline_bubble,
    read_rank_files,
    write_timeline,
)
from depthscale.observe.trace_format import check_trace
from depthscale.observe.trace_report import run_report

MS = 1_000_000


def _span(name, cat, ts, dur, step, **args):
    return {
        "kind": "span",
        "name": name,
        "cat": cat,
        "ts": ts,
        "dur": dur,
        "step": step,
        "args": args,
    }


def _run(tmp_path, skew_ms: dict[int, float], seed: int = 0, steps: int = 5, micro: int = 4):
    """A pp=2 × dp=2 run on one true clock: each forward on stage 0 sends its activations to
    stage 1 (latency 40-200 µs), each backward on stage 1 sends the gradient back. Each rank then
    writes its timestamps shifted by its skew, and a clock record as the ping-pong would measure
    it (a round trip of 0.05-2 ms brackets the true offset)."""
    rng = random.Random(seed)
    spans = {r: [] for r in range(4)}
    t = 0
    for step in range(1, steps + 1):
        for dp in range(2):
            s0, s1, free = dp, 2 + dp, t  # stage 0's rank, stage 1's, when stage 0 is free
            for mb in range(micro):
                group = {"bytes": 64, "group": f"{s0},{s1}"}
                f = free
                spans[s0].append(_span("forward", "compute", f, 2 * MS, step, mb=mb))
                label, latency = f"step {step}: F{mb} 0>1", rng.randint(40_000, 200_000)
                spans[s0].append(
                    _span("send", "pp", f + 2 * MS, latency, step, peer=s1, label=label, **group)
                )
                arrive = f + 2 * MS + latency
                spans[s1].append(
                    _span("recv", "pp", f, arrive - f, step, peer=s0, label=label, **group)
                )
                spans[s1].append(_span("forward", "compute", arrive, 3 * MS, step, mb=mb))
                spans[s1].append(_span("backward", "compute", arrive + 3 * MS, 4 * MS, step, mb=mb))
                sent = arrive + 7 * MS
                label, back = f"step {step}: B{mb} 1>0", rng.randint(40_000, 200_000)
                spans[s1].append(
                    _span("send", "pp", sent, back, step, peer=s0, label=label, **group)
                )
                spans[s0].append(
                    _span("recv", "pp", f + 2 * MS, sent + back - f - 2 * MS, step, peer=s1,
                          label=label, **group)
                )  # fmt: skip
                spans[s0].append(_span("backward", "compute", sent + back, 4 * MS, step, mb=mb))
                free = sent + back + 4 * MS
            t = max(t, free, sent + back) + MS
    for rank in range(4):
        skew = round(skew_ms.get(rank, 0) * MS)
        rtt = rng.randint(50_000, 2 * MS)
        lead = rng.randint(0, rtt)  # where in the round trip the peer read its clock
        lo, hi = -skew - lead, -skew + (rtt - lead)
        clock = {"kind": "clock", "offset_ns": (lo + hi) // 2, "lo_ns": lo, "hi_ns": hi,
                 "rtt_ns": rtt} if rank else {"kind": "clock", "offset_ns": 0, "lo_ns": 0,
                                              "hi_ns": 0, "rtt_ns": 0}  # fmt: skip
        meta = {"kind": "meta", "rank": rank, "world": 4, "host": "h",
                "coords": {"pp": rank // 2, "dp": rank % 2, "cp": 0, "tp": 0},
                "dims": {"pp": 2, "dp": 2, "cp": 1, "tp": 1, "pp_virtual": 1,
                         "microbatches": micro}}  # fmt: skip
        lines = [meta, clock] + [
            {**s, "ts": s["ts"] + skew} for s in sorted(spans[rank], key=lambda s: s["ts"])
        ]
        path = trace_path(tmp_path, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return steps * 2 * micro * 2  # messages


@pytest.mark.parametrize("seed", range(6))
def test_skew_is_undone_to_a_millisecond_and_no_arrow_points_back(tmp_path, seed):
    rng = random.Random(seed)
    skew = {r: rng.choice([-1, 1]) * rng.uniform(10, 50) for r in (1, 2, 3)}
    messages = _run(tmp_path, skew, seed)
    out, summary = write_timeline(tmp_path)
    for rank, ms in skew.items():
        assert abs(summary.offsets_ns[rank] + ms * MS) <= MS, (rank, summary.offsets_ns)
    assert summary.backward_flows == 0 and not summary.unmatched
    assert summary.flows == {"pp": messages}
    trace = json.loads(out.read_text())
    assert check_trace(trace) == []
    starts = [e for e in trace["traceEvents"] if e["ph"] == "s"]
    ends = {e["id"]: e for e in trace["traceEvents"] if e["ph"] == "f"}
    assert len(starts) == messages
    assert all(ends[s["id"]]["ts"] > s["ts"] for s in starts)
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}  # fmt: skip
    assert names[3] == "rank 3 · pp1 dp1 cp0 tp0 · h"


def test_the_skew_is_large_enough_to_matter_and_messages_alone_pin_it(tmp_path):
    """The check is not vacuous: on the raw clocks, arrows point back in time. And messages in
    both directions between two ranks bound their relative offset to the message latencies, so
    even without the ping-pong records the merge recovers rank 2's skew (ranks 1 and 3 share
    theirs, and are aligned with each other)."""
    _run(tmp_path, {1: -50, 2: 50, 3: -50})
    ranks = read_rank_files(tmp_path)
    pairs, _ = match_messages(ranks)
    assert any(r["ts"] + r["dur"] < s["ts"] for _, s, _, r in pairs)
    for t in ranks.values():
        t.clock = {}
    offsets = align_clocks(ranks, pairs)
    assert abs(offsets[2] + 50 * MS) <= MS and offsets[1] == offsets[3]


def test_a_killed_run_merges_and_names_what_is_missing(tmp_path):
    _run(tmp_path, {})
    path = trace_path(tmp_path, 2)
    text = path.read_text()
    path.write_text(text[: text.rindex('{"kind"') + 25])  # the writer died mid-line
    _, summary = write_timeline(tmp_path)
    assert len(summary.unmatched) == 1 and "never" in summary.unmatched[0]


def test_damaged_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="holds no rank"):
        read_rank_files(tmp_path)
    _run(tmp_path, {})
    path = trace_path(tmp_path, 1)
    lines = path.read_text().splitlines()
    lines[3] = "{not json"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"rank00001.jsonl:4 is not a JSON record"):
        read_rank_files(tmp_path)
    lines[3] = json.dumps(
        {"kind": "span", "name": "recv", "cat": "pp", "ts": 1, "dur": 2, "step": 1}
    )
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"rank00001.jsonl:4: a span needs"):
        read_rank_files(tmp_path)
    path.write_text("[]\n")
    with pytest.raises(ValueError, match=r"rank00001.jsonl:1: the first record must be the meta"):
        read_rank_files(tmp_path)


def test_bubble_is_measured_per_stage_beside_the_schedule(tmp_path):
    _run(tmp_path, {}, micro=4)
    bubble = pipeline_bubble(read_rank_files(tmp_path))
    assert set(bubble) == {0, 1}
    assert all(b["theory"] == pytest.approx(1 / 4) for b in bubble.values())
    assert all(b["measured"] > 0 for b in bubble.values())


def test_check_trace_finds_what_perfetto_would_reject():
    good = [
        {"ph": "X", "name": "a", "pid": 0, "tid": 0, "ts": 0.0, "dur": 10.0},
        {"ph": "X", "name": "b", "pid": 1, "tid": 0, "ts": 5.0, "dur": 10.0},
        {"ph": "s", "id": 1, "cat": "pp", "name": "m", "pid": 0, "tid": 0, "ts": 1.0},
        {"ph": "f", "bp": "e", "id": 1, "cat": "pp", "name": "m", "pid": 1, "tid": 0, "ts": 9.0},
    ]
    assert check_trace({"traceEvents": good}) == []
    back = [*good[:3], {**good[3], "ts": 0.5}]
    assert any("before it starts" in p for p in check_trace({"traceEvents": back}))
    outside = [*good[:3], {**good[3], "ts": 30.0}]
    assert any("in no slice" in p for p in check_trace({"traceEvents": outside}))
    crossing = [*good, {"ph": "X", "name": "c", "pid": 0, "tid": 0, "ts": 5.0, "dur": 10.0}]
    assert any("overlaps" in p for p in check_trace({"traceEvents": crossing}))
    assert any("needs one" in p for p in check_trace({"traceEvents": good[:3]}))


def test_the_report_draws_the_last_finished_step_and_refuses_another(tmp_path, capsys):
    _run(tmp_path, {1: 20, 2: -20}, steps=3)
    for rank in range(4):  # each rank's step spans (written at the end of each step)
        path = trace_path(tmp_path, rank)
        records = [json.loads(line) for line in path.read_text().splitlines()]
        for step in (1, 2, 3) if rank != 3 else (1, 2):  # rank 3 was killed in step 3
            mine = [r for r in records if r.get("step") == step]
            begin = min(r["ts"] for r in mine)
            end = max(r["ts"] + r["dur"] for r in mine)
            records.append(_span("step", "step", begin, end - begin, step))
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert run_report("timeline", tmp_path, None) == 0
    out = capsys.readouterr().out
    assert "wrote " in out and "step 2 of every rank" in out
    picture = tmp_path / "trace" / "timeline.png"
    assert picture.read_bytes()[:4] == b"\x89PNG" and picture.stat().st_size > 10_000
    with pytest.raises(
        DepthscaleError, match=r"--step 3 is not a step every rank finished \(1 to 2\)"
    ):
        run_report("timeline", tmp_path, None, step=3)


def test_ranks_sharing_a_host_take_its_measured_offset(tmp_path):
    """Rank 0 measures one rank per host; the others say whose clock they share."""
    from depthscale.parallel.clock_sync import measured_ranks

    assert measured_ranks([0, 1, 2, 3, 0, 1, 2, 3], [False] * 8) == [0, 4]
    assert measured_ranks([0, 1, 2, 3, 0, 1, 2, 3], [False, False, True] + [False] * 5) == [0, 2, 4]
    assert measured_ranks([0, 1, 0, 1], [False, False, True, False]) == [0, 2, 3]  # its leader's
    _run(tmp_path, {2: 40, 3: 40})
    path = trace_path(tmp_path, 3)
    lines = path.read_text().splitlines()
    lines[1] = json.dumps({"kind": "clock", "same_clock_as": 2})
    path.write_text("\n".join(lines) + "\n")
    ranks = read_rank_files(tmp_path)
    offsets = align_clocks(ranks, [])  # the ping-pong intervals alone
    assert offsets[3] == offsets[2] and abs(offsets[2] + 40 * MS) <= MS


def test_a_trace_without_spans_falls_back_to_the_newest_archived_attempt(tmp_path, capsys):
    """RUN/trace as a start that trained nothing left it before starts kept their hands off (meta
    lines only, the real trace archived): the timeline is the archived attempt's, and says so."""
    _run(tmp_path, {1: 20}, steps=2)
    trace = tmp_path / "trace"
    archived = trace / "archive" / "20261128-035050"
    archived.mkdir(parents=True)
    for path in sorted(trace.glob("rank*.jsonl")):
        path.rename(archived / path.name)
        path.write_text(json.dumps({"kind": "meta", "rank": int(path.stem[4:]), "world": 4}) + "\n")
    assert run_report("timeline", tmp_path, None) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        f"reading an earlier attempt, archived when the run was started again: {archived}"
    )
    assert f"wrote {archived / 'timeline.json'}: 4 ranks" in out
    assert "pipeline stage 1: idle/compute" in out  # the archived spans, merged
