"""The CPU traffic model of the AttnRes Triton read (`benchmarks/attnres_traffic.py`): what it
claims about the kernels, and that the claim follows from their launch plans, not from numbers
of its own."""

import importlib.util
import sys
from pathlib import Path

import pytest

from depthscale.kernels import attnres_triton_config as config

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "attnres_traffic.py"


@pytest.fixture(scope="module")
def traffic():
    spec = importlib.util.spec_from_file_location("attnres_traffic", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_forward_reads_each_source_once_at_every_modelled_shape(traffic):
    """Forward ≤ 1.15× the minimum (m + S)·2d at every shape, under the conservative occupancy
    (most programs resident, longest reuse distance)."""
    result = traffic.model()
    assert result["within_limits"]["forward"], result["worst_ratio"]
    for shape in result["shapes"]:
        forward = shape["forward"]
        assert 1.0 <= forward["ratio"] <= traffic.FORWARD_LIMIT, shape
        assert forward["detail"]["sources_reread"] == 0, shape


def test_the_model_follows_the_launch_plan(traffic, monkeypatch):
    """An L2 too small for the reuse distance makes the weighted sum's re-read HBM traffic (the
    old two-pass cost, (2m + S)/(m + S)); the scratch grows with the plan's logits parts."""
    d, S, m = 4096, 1, 16
    plan = config.read_forward_launch(traffic.TOKENS, d, m, S, "bf16")
    fits = traffic.forward(d, S, m)
    monkeypatch.setattr(traffic, "L2_BYTES", 1 << 20)
    spills = traffic.forward(d, S, m)
    extra = m * d * 2
    assert spills.bytes_per_token == pytest.approx(fits.bytes_per_token + extra)
    assert spills.ratio > (2 * m + S) / (m + S) - 1e-9
    parts = fits.detail["scratch_partials_written"]
    assert parts == plan.n_parts * m * (plan.variant.meta["S_PAD"] + 1) * 4


def test_backward_reads_sources_and_upstream_once_at_every_modelled_shape(traffic):
    """Backward ≤ 1.6× the minimum (2m + S)·2d at every shape, under the conservative occupancy:
    the gradient items' re-read of a block's sources and upstream gradients is in L2."""
    result = traffic.model()
    assert result["within_limits"]["backward"], result["worst_ratio"]
    for shape in result["shapes"]:
        backward = shape["backward"]
        assert 1.0 <= backward["ratio"] <= traffic.BACKWARD_LIMIT, shape
        assert backward["detail"]["reread"] == 0, shape


def test_the_backward_model_follows_the_launch_plan(traffic, monkeypatch):
    """An L2 too small for the reuse distance makes the gradient items' re-read HBM traffic (the
    old two-pass cost, (3m + 2S)/(2m + S)); the block's tokens, the lanes and the scratch are the
    launch plan's."""
    d, S, m = 8192, 32, 16
    plan = config.read_backward_launch(traffic.TOKENS, d, m, S, "bf16")
    fits = traffic.backward(d, S, m)
    assert fits.detail["block_tokens"] == plan.block_n and plan.block_n * plan.block_bytes
    assert fits.detail["dw_lanes_count"] == plan.n_lanes
    rows = 2 * plan.variant.meta["S_PAD"] + 1
    assert fits.detail["scratch_partials_written"] == plan.n_parts * m * rows * 4
    monkeypatch.setattr(traffic, "L2_BYTES", 1 << 20)
    spills = traffic.backward(d, S, m)
    assert spills.bytes_per_token == pytest.approx(fits.bytes_per_token + (m + S) * d * 2)
    assert spills.ratio > (3 * m + 2 * S) / (2 * m + S) - 1e-9
    assert fits.minimum_per_token == (2 * m + S) * d * 2
