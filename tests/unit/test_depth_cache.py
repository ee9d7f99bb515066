"""Cross-stage cache traffic against the paper's formulas (Attention Residuals, Eq. 7-8)."""

import pytest

from depthscale.config import ModelConfig
from depthscale.parallel.pipeline.depth_cache import DepthCache
from depthscale.parallel.pipeline.stage import split_layers


def blocks_sent(p, v, n_layers, block_size, cache):
    cfg = ModelConfig(
        vocab_size=64,
        dim=32,
        n_layers=n_layers,
        n_heads=4,
        residual="block",
        attnres_block_size=block_size,
        tie_embeddings=False,
    )
    dc = DepthCache(cfg, split_layers(n_layers, p * v), p, enabled=cache)
    per_hop = dc.blocks_per_hop()
    # b_0 (the embedding) is not a produced block: the paper counts it apart ("sent once per rank")
    b0_sends = sum(1 for u in range(len(per_hop)) if dc.cached(u) == 0)
    return sum(per_hop) - b0_sends, per_hop


@pytest.mark.parametrize(
    "p,v,n_layers,block_size",
    [
        (2, 2, 8, 2),
        (2, 2, 8, 4),
        (4, 2, 8, 2),
        (4, 2, 16, 4),
        (2, 3, 12, 4),
        (4, 4, 16, 2),
        (4, 1, 8, 2),
    ],
)
def test_traffic_matches_formulas(p, v, n_layers, block_size):
    c = p * v
    n_p = (2 * n_layers // c) // block_size  # blocks produced per chunk
    naive, _ = blocks_sent(p, v, n_layers, block_size, cache=False)
    assert naive == c * (c - 1) // 2 * n_p  # Eq. 7
    cached, per_hop = blocks_sent(p, v, n_layers, block_size, cache=True)
    paper = p * (p - 1) // 2 * n_p + (v - 1) * p * p * n_p  # Eq. 8
    # The receiver also holds the blocks its own previous chunk produced, so each steady hop carries
    # (P-1)·N_p new blocks instead of P·N_p: exactly P(P-1)/2·N_p + (V-1)·P(P-1)·N_p.
    assert cached == p * (p - 1) // 2 * n_p + (v - 1) * p * (p - 1) * n_p <= paper
    if v > 1:
        assert max(per_hop) < max(
            blocks_sent(p, v, n_layers, block_size, cache=False)[1]
        )  # peak O(P), not O(C)
