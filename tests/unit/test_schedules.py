"""Pipeline schedules as pure data: every property is checked by simulating the action lists."""

import itertools

import pytest

from depthscale.parallel.pipeline.schedules import (
    Action,
    DeadlockError,
    Kind,
    Layout,
    build_schedule,
    format_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    simulate,
)

GRID = (
    [("gpipe", p, 1, m) for p, m in itertools.product([1, 2, 4], [1, 3, 8])]
    + [("1f1b", p, 1, m) for p, m in itertools.product([1, 2, 3, 4], [1, 2, 4, 8])]
    + [("1f1b", p, v, m) for p, v, m in itertools.product([2, 4], [2, 3], [4, 8, 12]) if m % p == 0]
)


@pytest.mark.parametrize("name,p,v,m", GRID)
def test_every_microbatch_visits_every_stage_forward_then_backward_once(name, p, v, m):
    schedule = build_schedule(name, p, v, m)
    layout = Layout(p, v)
    for kind in (Kind.F, Kind.B):
        units = [(a.microbatch, a.stage) for actions in schedule for a in actions if a.kind == kind]
        assert sorted(units) == sorted(itertools.product(range(m), range(layout.stages)))
    for r, actions in enumerate(schedule):
        assert all(a.stage in layout.stages_of(r) for a in actions)
    simulate(schedule)  # raises on ordering violations (B before F, stage order) and deadlock


@pytest.mark.parametrize("name,p,v,m", GRID)
def test_sends_match_receives(name, p, v, m):
    schedule = build_schedule(name, p, v, m)
    sends = {
        (a.kind.value[-1], a.microbatch, a.stage, r, a.peer)
        for r, actions in enumerate(schedule)
        for a in actions
        if a.kind in (Kind.SEND_F, Kind.SEND_B)
    }
    recvs = {
        (
            a.kind.value[-1],
            a.microbatch,
            a.stage - 1 if a.kind == Kind.RECV_F else a.stage + 1,
            a.peer,
            r,
        )
        for r, actions in enumerate(schedule)
        for a in actions
        if a.kind in (Kind.RECV_F, Kind.RECV_B)
    }
    assert sends == recvs
    hops = (p * v - 1) * m if p > 1 else 0
    assert len(sends) == 2 * hops


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 2), (3, 6)])
def test_peak_in_flight(p, m):
    assert simulate(gpipe(p, m)).peak_in_flight == [m] * p
    assert simulate(one_f_one_b(p, m)).peak_in_flight == [min(p - r, m) for r in range(p)]


@pytest.mark.parametrize(
    "p,v,m", [(2, 1, 8), (4, 1, 8), (4, 2, 8), (4, 2, 16), (2, 3, 6), (4, 4, 16)]
)
def test_bubble_matches_theory(p, v, m):
    """With backward = 2× forward and no latency the simulated bubble is exactly (P−1)/(V·M)."""
    timeline = simulate(interleaved_1f1b(p, v, m), forward_cost=1.0, backward_cost=2.0)
    assert timeline.bubble_ratio(1.0, 2.0) == pytest.approx((p - 1) / (v * m))


def test_interleaving_cuts_the_bubble():
    plain = simulate(one_f_one_b(4, 8)).makespan
    interleaved = simulate(interleaved_1f1b(4, 2, 8), forward_cost=0.5, backward_cost=1.0).makespan
    assert interleaved < plain


def test_deadlock_is_detected():
    bad = [
        [Action(Kind.RECV_B, 0, 0, 1), Action(Kind.F, 0, 0), Action(Kind.SEND_F, 0, 0, 1)],
        [
            Action(Kind.RECV_F, 0, 1, 0),
            Action(Kind.F, 0, 1),
            Action(Kind.B, 0, 1),
            Action(Kind.SEND_B, 0, 1, 0),
        ],
    ]
    with pytest.raises(DeadlockError, match="rank 0|0:"):
        simulate(bad)


def test_bad_arguments():
    with pytest.raises(ValueError, match="divisible by the pipeline ranks"):
        interleaved_1f1b(4, 2, 6)
    with pytest.raises(ValueError, match="allowed: 'gpipe', '1f1b'"):
        build_schedule("zb", 2, 1, 4)


def test_format_is_readable():
    text = format_schedule(one_f_one_b(2, 2))
    assert text.splitlines() == ["rank 0: F0.0 F1.0 B0.0 B1.0", "rank 1: F0.1 B0.1 F1.1 B1.1"]


@pytest.mark.parametrize("p,v,m", [(2, 1, 3), (4, 2, 5), (3, 3, 1)])
def test_forward_only_schedule_runs(p, v, m):
    from depthscale.parallel.pipeline.schedules import forward_only

    schedule = forward_only(p, v, m)
    assert all(
        a.kind in (Kind.F, Kind.SEND_F, Kind.RECV_F) for actions in schedule for a in actions
    )
    assert sum(a.kind == Kind.F for actions in schedule for a in actions) == p * v * m
    simulate(schedule)


def test_compute_phases_split_warmup_steady_cooldown():
    """1F1B, 2 ranks, 4 micro-batches: rank 0 runs F F | B F B F | B B (its first backward
    starts the steady state, its last forward ends it); rank 1 F | B F B F B F | B; a
    forward-only schedule is all warm-up."""
    from depthscale.parallel.pipeline.runtime import compute_phases

    schedule = one_f_one_b(2, 4)
    assert compute_phases(schedule[0]) == ["warmup"] * 2 + ["steady"] * 4 + ["cooldown"] * 2
    assert compute_phases(schedule[1]) == ["warmup"] + ["steady"] * 6 + ["cooldown"]
    from depthscale.parallel.pipeline.schedules import forward_only

    assert set(compute_phases(forward_only(2, 1, 4)[0])) == {"warmup"}


def test_lighter_end_stages_give_their_layers_to_the_middle():
    """`split_layers(..., ends_fewer)`: Llama 3 405B's 126 layers on 128 one-layer stages leave
    the first and last empty; otherwise the ends hold `ends_fewer` layers fewer than a balanced
    split of n + 2·ends_fewer, and an end that cannot give them up is refused."""
    from depthscale.parallel.pipeline.schedules import split_layers

    llama = [len(r) for r in split_layers(126, 128, 1)]
    assert llama[0] == llama[-1] == 0 and set(llama[1:-1]) == {1}
    assert [len(r) for r in split_layers(10, 4, 1)] == [2, 3, 3, 2]
    assert [len(r) for r in split_layers(10, 4)] == [3, 3, 2, 2]
    ranges = split_layers(30, 6, 2)
    assert ranges[0].start == 0 and ranges[-1].stop == 30
    assert all(a.stop == b.start for a, b in zip(ranges, ranges[1:]))
    with pytest.raises(ValueError, match="fewer than 2 layers to give up"):
        split_layers(2, 4, 2)
