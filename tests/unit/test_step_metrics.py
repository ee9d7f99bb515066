"""`HostVote`: the stop flag agreed every step in one number, the busy rows gathered every
`gather_every(world)` steps as each rank's median, so what a step sends does not grow with the
world. Simulated ranks in one process: a stand-in for gloo's collectives completes each call once
every rank has posted it."""

from __future__ import annotations

import statistics

import pytest
import torch
import torch.distributed as dist

from depthscale.train.step_metrics import ROWS_PER_STEP, HostVote, gather_every

PHASES = 4


class _Work:
    def __init__(self, finish) -> None:
        self.finish = finish

    def wait(self) -> None:
        self.finish()


class _World:
    """Collectives among `n` simulated ranks, each a `_Member` passed to HostVote as its group.
    Records, per call, how many numbers each rank sent and received."""

    def __init__(self, n: int, lone: bool = False) -> None:
        self.n, self.lone = n, lone
        self.posts: dict[int, dict[int, torch.Tensor]] = {}
        self.traffic: list[tuple[str, int, int]] = []  # (op, sent, received) of rank 0

    def post(self, member, op: str, tensor: torch.Tensor, finish) -> _Work:
        call = member.calls
        member.calls += 1
        self.posts.setdefault(call, {})[member.rank] = tensor.clone()
        if member.rank == 0:
            received = tensor.numel() * (self.n if op == "all_gather" else 1)
            self.traffic.append((op, tensor.numel(), received))
        return _Work(lambda: finish(self._peers(call, tensor)))

    def _peers(self, call: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        if self.lone:  # only rank 0 simulated: the others send what it sends
            return [tensor] * self.n
        return [self.posts[call][r] for r in range(self.n)]


class _Member:
    def __init__(self, world: _World, rank: int) -> None:
        self.world, self.rank, self.calls = world, rank, 0


@pytest.fixture
def fake_collectives(monkeypatch):
    def all_gather(out, tensor, group, async_op):
        def finish(peers):
            for o, p in zip(out, peers):
                o.copy_(p)

        return group.world.post(group, "all_gather", tensor, finish)

    def all_reduce(tensor, group, async_op):
        return group.world.post(
            group, "all_reduce", tensor, lambda peers: tensor.copy_(torch.stack(peers).sum(0))
        )

    monkeypatch.setattr(dist, "all_gather", all_gather)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)


def _busy(step: int, rank: int) -> list[float]:
    return [step * 100.0 + rank * 10.0 + phase for phase in range(PHASES)]


@pytest.mark.parametrize("every", [1, 3])
def test_rows_are_medians_one_step_late_and_stop_agreed_a_step_late(fake_collectives, every):
    n, steps, stop_at = 3, 9, 5
    world = _World(n)
    votes = [HostVote(n, r, every=every, group=_Member(world, r)) for r in range(n)]
    for step in range(1, steps + 1):
        answers = [
            v.exchange(step == stop_at and r == 1, _busy(step, r)) for r, v in enumerate(votes)
        ]
        assert all(a == answers[0] for a in answers), step  # every rank reads the same
        stopped, rows = answers[0]
        assert stopped == (step == stop_at + 1), step
        last = step - 1  # the step the rows end with
        if last >= every and last % every == 0:
            window = range(last - every + 1, last + 1)
            expected = [
                [statistics.median(_busy(s, r)[p] for s in window) for p in range(PHASES)]
                for r in range(n)
            ]
            assert rows == expected, step
        else:
            assert rows is None, step
    for v in votes:
        v.close()


def test_one_process_agrees_with_itself_at_once():
    vote = HostVote(1, 0)
    assert vote.exchange(False, [1.0]) == (False, None)
    assert vote.exchange(True, [2.0]) == (True, [[1.0]])


@pytest.mark.parametrize("world", [2, 64, 512, 4096])
def test_what_a_step_sends_does_not_grow_with_the_world(fake_collectives, world):
    """Each step: one number for the stop flag, or every `gather_every(world)` steps one median
    row per rank; amortised, at most ROWS_PER_STEP rows a step arrive on a rank (the old vote
    all-reduced world × phases numbers every step: 16,384 at 4096 ranks)."""
    every = gather_every(world)
    assert every == max(1, -(-world // ROWS_PER_STEP))
    fake = _World(world, lone=True)
    vote = HostVote(world, 0, group=_Member(fake, 0))
    steps = 4 * every
    for step in range(1, steps + 1):
        vote.exchange(False, _busy(step, 0))
    vote.close()
    gathers = [t for t in fake.traffic if t[0] == "all_gather"]
    flags = [t for t in fake.traffic if t[0] == "all_reduce"]
    assert len(gathers) == 4 and len(flags) == steps - 4
    assert all(sent == 1 + PHASES for _, sent, _ in gathers)
    assert all((sent, received) == (1, 1) for _, sent, received in flags)
    received_per_step = sum(received for _, _, received in fake.traffic) / steps
    assert received_per_step <= ROWS_PER_STEP * (1 + PHASES) + 1
