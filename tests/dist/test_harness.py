"""The harness itself: real processes, real collectives, errors surface with the failing rank."""

import pytest
import torch
import torch.distributed as dist

from depthscale.errors import ConfigError
from depthscale.parallel.mesh import ParallelDims


def _all_reduce_rank():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


def _fail_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    return "ok"


def _mesh_groups():
    mesh = ParallelDims(dp_shard=2, tp=2).validate(4).build_mesh("cpu")
    return mesh["dp_shard"].get_local_rank(), mesh["tp"].get_local_rank()


def test_collectives_across_real_processes(dist_pool):
    results = dist_pool(4).run(_all_reduce_rank)
    assert results == [(r, 4, 6.0) for r in range(4)]


def test_failure_names_rank_and_pool_recovers(dist_pool):
    pool = dist_pool(2)
    with pytest.raises(AssertionError, match="boom on rank 1"):
        pool.run(_fail_on_rank_1)
    assert pool.run(_all_reduce_rank) == [(0, 2, 1.0), (1, 2, 1.0)]


def test_mesh_puts_tp_innermost(dist_pool):
    assert dist_pool(4).run(_mesh_groups) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_layout_must_match_world_size():
    with pytest.raises(ConfigError, match=r"needs 4 processes but the world size is 2"):
        ParallelDims(dp_shard=2, tp=2).validate(2)
