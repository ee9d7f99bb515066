"""Real gloo runs, recorded and replayed under NCCL's rules (`depthscale.parallel.nccl_rules`).

Every point-to-point message of a pipeline step and of ring attention (forward and backward) is
recorded on every rank (`p2p.recording`) and replayed as NCCL would run it: no tags, pairing by
posting order per pair, groups atomic, a unit holding its stream until its partner runs. The replay
must find no deadlock and pair every message as labelled. The pipeline's recorded posts must also
be exactly the pure program `p2p_order.rank_program` builds (which test_p2p_order checks for more
configurations without processes). Gloo itself already runs tag-free: depthscale posts every
message with tag 0, so these runs and the whole dist suite pair messages in posting order.
"""

import pytest
import torch
import torch.distributed as dist

from depthscale.config import ModelConfig
from depthscale.model.transformer import Transformer
from depthscale.parallel import p2p
from depthscale.parallel.context_parallel import (
    RingStats,
    positions_for,
    ring_attention,
    shard_sequence,
)
from depthscale.parallel.nccl_rules import replay
from depthscale.parallel.pipeline.depth_cache import DepthCache
from depthscale.parallel.pipeline.p2p_order import Post, label, rank_program
from depthscale.parallel.pipeline.runtime import PipelineRuntime
from depthscale.parallel.pipeline.schedules import interleaved_1f1b
from depthscale.parallel.pipeline.stage import build_stages, split_layers

SEQ, DIM = 8, 16


def _pipeline_cfg(n_layers: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=64,
        dim=DIM,
        n_layers=n_layers,
        n_heads=2,
        n_kv_heads=2,
        max_seq_len=SEQ,
        residual="block",
        attnres_block_size=3,
    )


def _pipeline_traces(configs):
    """For each (virtual, microbatches, cache, layers): this rank's recorded events, and whether its posts
    are exactly the pure program's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for virtual, micro, cache, n_layers in configs:
        cfg = _pipeline_cfg(n_layers)
        torch.manual_seed(0)
        model = Transformer(cfg)
        stages = build_stages(model, rank, world, virtual)
        depth_cache = DepthCache(cfg, split_layers(n_layers, world * virtual), world, cache)
        schedule = interleaved_1f1b(world, virtual, micro)
        runtime = PipelineRuntime(stages, schedule, dist.group.WORLD, depth_cache)
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, 64, (micro, SEQ), generator=g)
        labels = torch.randint(0, 64, (micro, SEQ), generator=g)
        with p2p.recording() as events:
            _, stats = runtime.step(
                list(tokens.chunk(micro)),
                list(labels.chunk(micro)),
                (1, SEQ, DIM),
                torch.float32,
                torch.device("cpu"),
            )
        planned = [
            [("send" if a.kind.startswith("SEND") else "recv", a.peer, label(a)) for a in s.actions]
            for s in rank_program(schedule, rank, runtime._empty_hop)
            if isinstance(s, Post)
        ]
        posted = [
            [(kind, peer, name.split(": ", 1)[1]) for kind, peer, name, _ in e["ops"]]
            for e in events
            if "post" in e
        ]
        out.append((events, posted == planned, stats.send_bytes_live))
    return out


def _pipeline_configs(p: int) -> list[tuple[int, int, bool, int]]:
    """Every listed (virtual, microbatches), cache on and off, a layer per stage; and stages without
    layers, whose cached hops carry nothing and are left out at both ends.

    At p = 8 (8 processes on 2 cores: 4p micro-batches took over half of the dist suite's
    costliest case) up to 2p, which already runs a steady phase between a full warm-up and
    cool-down; 4p at p = 8 only lengthens it, and its programs replay in test_p2p_order."""
    counts = (p, 2 * p) if p >= 8 else (p, 2 * p, 4 * p)
    every = [(v, m, c, p * v) for v in (1, 2, 3) for m in counts for c in (True, False)]
    return every + [(2, 2 * p, True, 2), (3, p, True, 1)]


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_pipeline_steps_are_correct_under_nccl_rules(dist_pool, world):
    configs = _pipeline_configs(world)
    results = dist_pool(world).run(_pipeline_traces, configs)
    for i, config in enumerate(configs):
        traces = [r[i][0] for r in results]
        report = replay(traces)
        assert report.ok, f"pp={world} (virtual, microbatches, cache, layers)={config}:\n{report}"
        assert report.messages > 0
        assert all(r[i][1] for r in results), f"{config}: posts differ from p2p_order's program"
        assert all(r[i][2] == 0 for r in results), f"{config}: send buffers left at step end"


B, H, HKV, HD = 1, 2, 1, 4


def _ring_cases(world: int) -> list[tuple[str, int, int, bool]]:
    """(mode, T, window, causal): causal zigzag, windows (halo and zigzag), bidirectional, padded."""
    T = 8 * world
    return [
        ("zigzag", T, 0, True),
        ("contiguous", T, 3, True),
        ("zigzag", T, 5, True),
        ("contiguous", T, 0, False),
        ("zigzag", T - 2, 0, True),
        ("contiguous", T - 3, 4, False),
    ]


def _ring_traces(cases):
    """Per case: this rank's recorded events (forward and backward of one ring attention), the
    peak bytes of send buffers alive at once, one local K/V block's bytes, and the bytes left."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for mode, T, window, causal in cases:
        n_chunks = 2 * world if mode == "zigzag" else world
        padded_T = T + (-T % n_chunks)
        g = torch.Generator().manual_seed(0)
        full = [torch.randn(B, h, padded_T, HD, generator=g) for h in (H, HKV, HKV, H)]
        q, k, v, dout = [shard_sequence(t, rank, world, 2, mode) for t in full]
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        pos = positions_for(padded_T, rank, world, mode)
        stats = RingStats()
        with p2p.recording() as events:
            y = ring_attention(
                *leaves, pos, pos, window, dist.group.WORLD, stats, causal=causal, seq_len=T
            )
            y.backward(dout)
        block = 2 * k.numel() * k.element_size()
        out.append((events, stats.peak_send_bytes_live, block, stats.send_bytes_live))
    return out


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_ring_attention_is_correct_under_nccl_rules(dist_pool, world):
    cases = _ring_cases(world)
    results = dist_pool(world).run(_ring_traces, cases)
    for i, case in enumerate(cases):
        report = replay([r[i][0] for r in results])
        assert report.ok, f"cp={world} {case}:\n{report}"
        for rank, (_, peak, block, left) in enumerate(r[i] for r in results):
            # double buffering: the K/V block going out and (backward) the dK/dV going out
            assert peak <= 2 * block, f"cp={world} {case} rank {rank}: {peak} B > 2 blocks"
            assert left == 0, f"cp={world} {case} rank {rank}: {left} B still unsent"
