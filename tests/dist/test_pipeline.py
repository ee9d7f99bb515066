"""Pipeline parallelism vs one process: same loss and gradients, with and without the depth cache."""


import pytest
import torch
import torch.distributed as dist

from depthscale.config import ModelConfig
from depthscale.model.transformer import Transformer, cross_entropy
from depthscale.parallel.pipeline.depth_cache import DepthCache
from depthscale.parallel.pipeline.runtime import PipelineRuntime
from depthscale.parallel.pipeline.schedules import build_schedule
from depthscale.parallel.pipeline.stage import build_stages, split_layers

MICRO, SEQ = 4, 16


def _cfg(residual, n_layers):
    return ModelConfig(
        vocab_size=64,
        dim=32,
        n_layers=n_layers,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=SEQ,
        tie_embeddings=False,
        residual=residual,
        attnres_block_size=3,
    )


def _reference(cfg, tokens, labels):
    torch.manual_seed(0)
    model = Transformer(cfg)
    total = 0.0
    for x, y in zip(tokens.chunk(MICRO), labels.chunk(MICRO)):
        loss = cross_entropy(model(x), y) / MICRO
        loss.backward()
        total += loss.item()
    return model, total


def _pipeline_parity(residual, n_layers, virtual, schedule, cache):
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = _cfg(residual, n_layers)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (MICRO, SEQ), generator=g)
    labels = torch.randint(0, 64, (MICRO, SEQ), generator=g)
    ref, ref_loss = _reference(cfg, tokens, labels)
    torch.manual_seed(0)
    model = Transformer(cfg)
    stages = build_stages(model, rank, world, virtual)
    depth_cache = DepthCache(cfg, split_layers(n_layers, world * virtual), world, enabled=cache)
    actions = build_schedule(schedule, world, virtual, MICRO)[rank]
    runtime = PipelineRuntime(stages, actions, dist.group.WORLD, depth_cache)
    loss, stats = runtime.step(
        list(tokens.chunk(MICRO)),
        list(labels.chunk(MICRO)),
        (1, SEQ, cfg.dim),
        torch.float32,
        torch.device("cpu"),
    )
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        worst = max(worst, (p.grad - ref_params[name].grad).abs().max().item())
    return (loss.item() if loss is not None else None), ref_loss, worst, stats.bytes_sent


CASES = [
    ("standard", 4, 1, "1f1b", 2),
    ("block", 4, 1, "1f1b", 2),
    ("full", 4, 1, "1f1b", 2),
    ("block", 8, 2, "1f1b", 2),
    ("standard", 8, 2, "1f1b", 2),
    ("full", 4, 2, "1f1b", 2),
    ("block", 4, 1, "gpipe", 2),
    ("block", 4, 1, "1f1b", 4),
    ("block", 8, 2, "1f1b", 4),
]


@pytest.mark.parametrize("residual,n_layers,virtual,schedule,world", CASES)
@pytest.mark.parametrize("cache", [True, False])
def test_pipeline_matches_single_process(
    dist_pool, residual, n_layers, virtual, schedule, world, cache
):
    results = dist_pool(world).run(_pipeline_parity, residual, n_layers, virtual, schedule, cache)
    last = results[-1]
    assert last[0] == pytest.approx(last[1], abs=1e-6)
    for _, _, worst, _ in results:
        assert worst < 1e-6
