"""`HostVote` over real gloo ranks: the flag every step, the median rows every `every` steps."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from depthscale.train.step_metrics import HostVote


def _vote(every: int, node: int | None = None) -> list:
    from depthscale.parallel import startup

    rank = dist.get_rank()
    vote = HostVote(dist.get_world_size(), rank, every=every, node=node)
    with startup.count_synchronizations() as counts:
        seen = [
            vote.exchange(step == 3 and rank == 2, [step + rank / 10, 0.5])
            for step in (1, 2, 3, 4, 5)
        ]
        vote.close()
    return seen, counts.new_groups


@pytest.mark.parametrize("node", [None, 2])
def test_stop_and_rows_over_gloo(dist_pool, node):
    """One level over the world's gloo group (one node), and in two levels with two ranks a node:
    the same agreement at the same steps; the two-level vote makes only groups of its node and
    of the nodes' first ranks, none over the world."""
    for rank, (seen, groups) in enumerate(dist_pool(4).run(_vote, 2, node)):
        if node:
            mine = [[rank - rank % 2, rank - rank % 2 + 1], [0, 2] if rank % 2 == 0 else [rank]]
            assert groups == [(members, True) for members in mine], rank
        else:
            assert groups == [], rank  # the gloo world group itself
        assert [stop for stop, _ in seen] == [False, False, False, True, False]
        rows = [rows for _, rows in seen]
        assert rows[:2] == [None, None] and rows[3] is None
        for got, middle in ((rows[2], 1.5), (rows[4], 3.5)):  # the medians of steps 1-2, 3-4
            expected = [[middle + r / 10, 0.5] for r in range(4)]
            assert got == [pytest.approx(row, rel=1e-12) for row in expected]
