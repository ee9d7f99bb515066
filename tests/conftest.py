import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

# Triton reads TRITON_INTERPRET once, when it is first imported, and torch modules some tests use
# import it at collection time (torch._dynamo, CommDebugMode): choose the interpreter here, before
# any test module is collected, so the Triton kernel tests run interpreted wherever there is no GPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Strict kernel dispatch for the whole suite, its worker processes and the CLI runs it starts: a read
# that misses an available fused kernel raises instead of silently running the PyTorch ops
# (depthscale/model/kernel_dispatch.py). Tests of the fallback itself turn it off locally. Only
# where the CPU kernels can build (a C++ compiler and ninja, the check of the `cpu_ops` fixture in
# tests/unit/conftest.py): without a toolchain every CPU read misses its kernel ("CPU kernels not
# built") and the suite runs, and tests, the fallback.
if shutil.which(os.environ.get("CXX", "c++")) and shutil.which("ninja"):
    os.environ.setdefault("DEPTHSCALE_STRICT_KERNELS", "1")


def _intra_op_threads() -> int:
    """$OMP_NUM_THREADS when set (a stress run varies it: 1, 2, 4, and thread counts change how some
    kernels split their reductions); otherwise at most 2: tests run on 2 cores next to
    multi-process cases. tests/dist/harness.py does the same for its workers (default 1)."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, min(2, os.cpu_count() or 1))


torch.set_num_threads(_intra_op_threads())


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Tokenizer/corpus caches go to a per-session temp dir, never the user's ~/.cache."""
    cache = tmp_path_factory.getbasetemp() / "depthscale-cache"
    monkeypatch.setenv("DEPTHSCALE_CACHE", str(cache))
    torch.manual_seed(0)


# The gloo worker pools (tests/dist/harness.py), one per world size for the whole session, shared
# by every directory that runs multi-process cases (tests/dist, tests/faults). Idle workers poll
# (each takes ~9 % of a core): the cases that use a pool run first, and the pools close after the
# last of them, so the e2e, fault and unit cases after them get the whole machine.
sys.path.insert(0, str(Path(__file__).resolve().parent / "dist"))
_pools: dict = {}
_last_pool_case: str | None = None


def _uses_pool(item: pytest.Item) -> bool:
    return "dist_pool" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not torch.cuda.is_available():  # deselected, not skipped: CI allows no skipped test
        cuda_only = [item for item in items if item.get_closest_marker("cuda")]
        if cuda_only:
            config.hook.pytest_deselected(items=cuda_only)
            items[:] = [item for item in items if not item.get_closest_marker("cuda")]
    items.sort(key=lambda item: not _uses_pool(item))  # stable: each group keeps its order


def pytest_collection_finish(session: pytest.Session) -> None:
    """The last case that uses a pool, among those that will run (after `-m`/`-k` deselection)."""
    global _last_pool_case
    users = [item.nodeid for item in session.items if _uses_pool(item)]
    _last_pool_case = users[-1] if users else None


def _close_pools() -> None:
    for pool in _pools.values():
        pool.close()
    _pools.clear()


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if item.nodeid == _last_pool_case:
        _close_pools()


@pytest.fixture(scope="session")
def dist_pool():
    """`dist_pool(n)`: a session-wide pool of n gloo workers (started on first use, shared)."""
    from harness import DistPool

    def get(world_size: int) -> DistPool:
        if world_size not in _pools:
            _pools[world_size] = DistPool(world_size)
        return _pools[world_size]

    yield get
    _close_pools()
