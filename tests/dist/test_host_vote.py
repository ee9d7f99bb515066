"""`HostVote` over real gloo ranks: the flag every step, the median rows every `every` steps."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from depthscale.train.step_metrics import HostVote


def _vote(every: int) -> list:
    rank = dist.get_rank()
    vote = HostVote(dist.get_world_size(), rank, every=every)
    seen = [
        vote.exchange(step == 3 and rank == 2, [step + rank / 10, 0.5]) for step in (1, 2, 3, 4, 5)
    ]
    vote.close()
    return seen


def test_stop_and_rows_over_gloo(dist_pool):
    for seen in dist_pool(4).run(_vote, 2):
        assert [stop for stop, _ in seen] == [False, False, False, True, False]
        rows = [rows for _, rows in seen]
        assert rows[:2] == [None, None] and rows[3] is None
        for got, middle in ((rows[2], 1.5), (rows[4], 3.5)):  # the medians of steps 1-2, 3-4
            expected = [[middle + r / 10, 0.5] for r in range(4)]
            assert got == [pytest.approx(row, rel=1e-12) for row in expected]
