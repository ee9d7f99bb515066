import pytest
from harness import DistPool

_pools: dict[int, DistPool] = {}


@pytest.fixture(scope="session")
def dist_pool():
    """`dist_pool(n)`: a session-wide pool of n gloo workers (started on first use, shared by tests)."""

    def get(world_size: int) -> DistPool:
        if world_size not in _pools:
            _pools[world_size] = DistPool(world_size)
        return _pools[world_size]

    yield get
    for pool in _pools.values():
        pool.close()
    _pools.clear()


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/dist/" in str(item.fspath):
            item.add_marker(pytest.mark.dist)
