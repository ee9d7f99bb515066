"""When the pipeline posts its messages (`p2p_order`): every rank's program, for every listed
layout, schedule and cache setting, replays under NCCL's rules without a deadlock and with every
message paired as intended — checked here without processes; tests/dist/test_nccl_rules.py shows
the runtime posts exactly these groups, and replays what it really waits on."""

import pytest

from depthscale.config import ModelConfig
from depthscale.parallel.nccl_rules import replay
from depthscale.parallel.pipeline.depth_cache import DepthCache
from depthscale.parallel.pipeline.p2p_order import (
    Post,
    Run,
    label,
    message_order,
    program_trace,
    rank_program,
    upstream,
)
from depthscale.parallel.pipeline.schedules import (
    Kind,
    forward_only,
    gpipe,
    interleaved_1f1b,
)


def _skip(p: int, v: int, n_layers: int, cache: bool):
    from depthscale.parallel.pipeline.stage import split_layers

    cfg = ModelConfig(
        vocab_size=64,
        dim=16,
        n_layers=n_layers,
        n_heads=2,
        n_kv_heads=2,
        max_seq_len=8,
        residual="block",
        attnres_block_size=2,
    )
    dc = DepthCache(cfg, split_layers(n_layers, p * v), p, enabled=cache)
    return lambda a: dc.hop_size(upstream(a), a.microbatch) == 0


CONFIGS = [(p, v, m) for p in (2, 3, 4, 8) for v in (1, 2, 3) for m in (p, 2 * p, 4 * p)]


@pytest.mark.parametrize("p,v,m", CONFIGS)
def test_interleaved_1f1b_programs_pass_nccl_rules(p, v, m):
    schedule = interleaved_1f1b(p, v, m)
    for n_layers in (p * v, 2):  # a layer per stage; stages without layers (empty cached hops)
        for cache in (True, False):
            report = replay(program_trace(schedule, _skip(p, v, n_layers, cache)))
            assert report.ok, f"p={p} v={v} m={m} layers={n_layers} cache={cache}\n{report}"


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_gpipe_and_forward_only_programs_pass_nccl_rules(p):
    for m in (p, 2 * p, 4 * p):
        assert replay(program_trace(gpipe(p, m))).ok
        for v in (1, 2, 3):
            assert replay(program_trace(forward_only(p, v, m))).ok


def test_empty_hops_are_left_out_at_both_ends():
    schedule = interleaved_1f1b(2, 3, 4)
    skip = _skip(2, 3, 1, True)
    skipped = [
        a
        for actions in schedule
        for a in actions
        if a.kind.startswith(("SEND", "RECV")) and skip(a)
    ]
    assert skipped, "this layout was chosen to have empty hops"
    posted = {
        label(a)
        for r in range(2)
        for s in rank_program(schedule, r, skip)
        if isinstance(s, Post)
        for a in s.actions
    }
    assert not posted & {label(a) for a in skipped}
    assert replay(program_trace(schedule, skip)).ok


def test_both_ends_of_every_pair_post_in_the_same_order():
    schedule = interleaved_1f1b(4, 2, 8)
    orders = message_order(schedule)
    for r in range(4):
        for peer in range(4):
            sent = [label(a) for a in orders[r] if a.kind.startswith("SEND") and a.peer == peer]
            got = [label(a) for a in orders[peer] if a.kind.startswith("RECV") and a.peer == r]
            assert sent == got


def test_receives_are_posted_before_their_compute_and_sends_after_it():
    schedule = interleaved_1f1b(4, 2, 8)
    for r in range(4):
        seen, posted = set(), set()
        for step in rank_program(schedule, r):
            if isinstance(step, Run):
                a = step.action
                need = Kind.RECV_F if a.kind == Kind.F else Kind.RECV_B
                if any(
                    x.kind == need and (x.microbatch, x.stage) == (a.microbatch, a.stage)
                    for x in schedule[r]
                ):
                    assert (need, a.microbatch, a.stage) in posted, a
                seen.add((a.kind, a.microbatch, a.stage))
            else:
                for a in step.actions:
                    if a.kind in (Kind.SEND_F, Kind.SEND_B):
                        producer = Kind.F if a.kind == Kind.SEND_F else Kind.B
                        assert (producer, a.microbatch, a.stage) in seen, a
                    posted.add((a.kind, a.microbatch, a.stage))


def test_the_old_lookahead_order_is_caught():
    """Receives posted two actions ahead, each message alone (what the runtime did before): the
    replay finds the cycle the issue describes for pp=2, V=1, M=4."""
    schedule = interleaved_1f1b(2, 1, 4)
    traces = []
    for actions in schedule:
        events, posted = [], {}
        for i, a in enumerate(actions):
            for ahead in actions[i : i + 3]:
                key = (ahead.kind, ahead.microbatch, ahead.stage)
                if ahead.kind.startswith("RECV") and key not in posted:
                    posted[key] = len(events)
                    events.append(
                        {
                            "post": len(events),
                            "ops": [["recv", ahead.peer, label(ahead), 1]],
                            "group": [0, 1],
                            "batched": False,
                        }
                    )
            if a.kind.startswith("RECV"):
                events.append({"wait": posted[(a.kind, a.microbatch, a.stage)]})
            elif a.kind.startswith("SEND"):
                events.append(
                    {
                        "post": len(events),
                        "ops": [["send", a.peer, label(a), 1]],
                        "group": [0, 1],
                        "batched": False,
                    }
                )
        traces.append(events)
    assert replay(traces).deadlock
