"""Fault tests: the checkpoint and recovery drills. Multi-process cases use the gloo worker pool
of tests/dist (its harness is imported from there)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "dist"))

from harness import DistPool  # noqa: E402

_pools: dict[int, DistPool] = {}


@pytest.fixture(scope="session")
def dist_pool():
    """`dist_pool(n)`: a session-wide pool of n gloo workers (started on first use)."""

    def get(world_size: int) -> DistPool:
        if world_size not in _pools:
            _pools[world_size] = DistPool(world_size)
        return _pools[world_size]

    yield get
    for pool in _pools.values():
        pool.close()
    _pools.clear()
