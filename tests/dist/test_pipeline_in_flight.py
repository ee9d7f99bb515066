"""The planner's in-flight model (`plan.pipeline.peak_in_flight`) against what the pipeline runtime
keeps alive: on real gloo ranks, the most (micro-batch, chunk) units whose forward ran and whose
backward has not — each holding its chunk's activations — equals the prediction on every rank, for
pp ∈ {2, 4}, v ∈ {1, 2, 4}, with and without the AttnRes cross-stage cache (issue #42: the memory
the planner charges an interleaved pipeline is the runtime's, not an estimate of it)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from depthscale.config import ModelConfig
from depthscale.model.transformer import Transformer
from depthscale.parallel.pipeline.depth_cache import DepthCache
from depthscale.parallel.pipeline.runtime import PipelineRuntime
from depthscale.parallel.pipeline.schedules import build_schedule
from depthscale.parallel.pipeline.stage import build_stages, split_layers
from depthscale.plan.pipeline import peak_in_flight

SEQ = 8

# a 4-rank pool per pp = 4 case, 2 ranks per pp = 2 case (~20 s): CI runs it with the slow drills
pytestmark = pytest.mark.slow


def _peak_units(virtual: int, micro: int, cache: bool) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = ModelConfig(vocab_size=32, dim=16, n_layers=world * virtual, n_heads=2,
                      max_seq_len=SEQ, residual="block", attnres_block_size=2)  # fmt: skip
    torch.manual_seed(0)
    model = Transformer(cfg)
    stages = build_stages(model, rank, world, virtual)
    depth_cache = DepthCache(cfg, split_layers(cfg.n_layers, world * virtual), world, enabled=cache)
    schedule = build_schedule("1f1b", world, virtual, micro)
    runtime = PipelineRuntime(stages, schedule, dist.group.WORLD, depth_cache)
    tokens = torch.randint(0, 32, (micro, SEQ), generator=torch.Generator().manual_seed(1))
    _, stats = runtime.step(
        list(tokens.chunk(micro)), list(tokens.chunk(micro)), (1, SEQ, cfg.dim),
        torch.float32, torch.device("cpu"),
    )  # fmt: skip
    return stats.peak_units


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("virtual", [1, 2, 4])
@pytest.mark.parametrize("cache", [True, False])
def test_runtime_peak_in_flight_is_the_planners(dist_pool, pp, virtual, cache):
    micro = 2 * pp  # past the warm-up: the steady state holds the peak
    peaks = dist_pool(pp).run(_peak_units, virtual, micro, cache)
    assert tuple(peaks) == peak_in_flight(pp, virtual, micro)
