"""Ring-attention tiles on the fused CPU kernel against the fp64 reference, and the plan's tiles:
which carry a mask at all.

Tolerance: a tile's output, LSE and gradients are chains of sums over the tile's keys (scores over
d, softmax and output over Tk, dK/dV over the rows), so two fp32 evaluations differ by at most
`fp32_sum_bound` of that chain's length relative to the values' magnitude (tests/tolerances.py)."""

from __future__ import annotations

import pytest
import torch

from depthscale.model import attention_tiles
from depthscale.model.attention_dispatch import TilePolicy
from depthscale.model.layers import attention_mask
from depthscale.parallel.ring_schedule import RingPlan, Span
from depthscale.parallel.sequence_layout import positions_for
from tolerances import check, fp32_sum_bound, scaled_err


def _case(seed: int, B=2, Hkv=2, G=3, Tq=24, Tk=40, d=16):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(B, Hkv * G, Tq + 8, d, generator=g)
    q = base[:, :, 4 : 4 + Tq]  # a strided view, as the ring's row selections are
    kv = torch.randn(2, B, Hkv, Tk + 6, d, generator=g)[:, :, :, 3 : 3 + Tk]
    do = torch.randn(B, Hkv * G, Tq, d, generator=g)
    return q, kv[0], kv[1], do


def _masks(Tq: int, Tk: int) -> dict[str, tuple[attention_tiles.TileMask, torch.Tensor | None]]:
    q_pos, k_pos = torch.arange(Tq), torch.arange(Tk)
    causal = attention_mask(q_pos, k_pos, 0)
    band = attention_mask(q_pos + Tk - Tq, k_pos, 9)  # a window's edge: neither dense nor causal
    bias = attention_tiles.additive_bias(band)
    return {
        "dense": (attention_tiles.TileMask(False, None, None), None),
        "causal": (attention_tiles.TileMask(True, None, causal), causal),
        "band": (attention_tiles.TileMask(False, bias, band), band),
    }


@pytest.mark.parametrize("kind", ["dense", "causal", "band"])
def test_fused_tile_matches_the_reference(kind):
    q, k, v, do = _case(0)
    mask, visible = _masks(q.shape[2], k.shape[2])[kind]
    scale = q.shape[-1] ** -0.5
    want_out, want_lse = attention_tiles.reference_forward(
        q.double(), k.double(), v.double(), visible, scale
    )
    out, lse = attention_tiles.forward(q, k, v, mask, scale)
    bound = fp32_sum_bound(k.shape[2] + q.shape[-1])
    check(scaled_err(out, want_out), bound, f"{kind} out")
    check(scaled_err(lse, want_lse), bound, f"{kind} lse")
    # the backward from the tile's own (out, lse) is the ordinary attention gradient
    want = attention_tiles.reference_backward(
        do.double(), q.double(), k.double(), v.double(), want_out, want_lse, visible, scale
    )
    got = attention_tiles.backward(do, q, k, v, out, lse, mask, scale)
    chain = 2 * (k.shape[2] + q.shape[-1]) + q.shape[2] * q.shape[1] // k.shape[1]
    for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert a.shape == b.shape, name
        check(scaled_err(a, b), fp32_sum_bound(chain), f"{kind} {name}")


def test_a_band_tile_on_the_cpu_kernel_is_its_window():
    """A square band tile (`TileMask.window`, what flash's window op takes on CUDA) run on CPU's
    flash kernel (as a bias) gives the reference's result under the same band."""
    q, k, v, do = _case(2, Tq=32, Tk=32)
    mask = attention_tiles.TileMask(False, None, None, (5, 2))
    band = attention_tiles.visible(mask, 32, 32, q.device)
    offset = torch.arange(32)[:, None] - torch.arange(32)
    assert torch.equal(band, (offset <= 5) & (offset >= -2))
    scale = q.shape[-1] ** -0.5
    want = attention_tiles.reference_forward(q.double(), k.double(), v.double(), band, scale)
    got = attention_tiles.forward(q, k, v, mask, scale)
    bound = fp32_sum_bound(k.shape[2] + q.shape[-1])
    for a, b, name in zip(got, want, ("out", "lse"), strict=True):
        check(scaled_err(a, b), bound, f"band {name}")
    grads = attention_tiles.backward(do, q, k, v, *got, mask, scale)
    ref = attention_tiles.reference_backward(
        do.double(), q.double(), k.double(), v.double(), *want, band, scale
    )
    chain = 2 * (k.shape[2] + q.shape[-1]) + q.shape[2] * q.shape[1] // k.shape[1]
    for a, b in zip(grads, ref, strict=True):
        check(scaled_err(a, b), fp32_sum_bound(chain), "band gradient")


def test_reference_gradients_are_autograds():
    """The reference backward (used off CPU) against autograd through the reference forward."""
    q, k, v, do = (t.double() for t in _case(1))
    _, band = _masks(q.shape[2], k.shape[2])["band"]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = attention_tiles.reference_forward(*leaves, band, 0.25)
    out.backward(do)
    got = attention_tiles.reference_backward(do, q, k, v, out.detach(), lse.detach(), band, 0.25)
    for a, leaf in zip(got, leaves, strict=True):
        torch.testing.assert_close(a, leaf.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "policy", [TilePolicy(), TilePolicy(whole=True), TilePolicy(whole=True, window=True)]
)
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("window", [0, 24, 8])
def test_causal_tiles_need_no_mask_and_cover_each_visible_pair_once(layout, window, policy):
    """Per rank and step, the plan's tiles cover exactly the visible (query, key) pairs, each once,
    under every tile policy; without a window every tile is dense or top-left causal, so no mask
    is built at all; whole steps take one tile each without a window (and with one, contiguous,
    on the window op)."""
    cp, T, kv_tile = 2, 64, 16
    pos = [positions_for(T, r, cp, layout) for r in range(cp)]
    for rank in range(cp):
        span = Span.of(window, True, None)
        plan = RingPlan.of(pos, rank, span, kv_tile, torch.device("cpu"), policy)
        for step in range(cp):
            if not plan.holds(step):
                continue
            j = plan.owner(step)
            keys = pos[j][plan.payload(j, step)]
            covered = torch.zeros(pos[rank].numel(), keys.numel(), dtype=torch.int)
            for tile in plan.tiles(step):
                mask = plan.tile_mask(tile)
                if window == 0:
                    assert mask.bias is None
                rows = tile.rows.take(torch.arange(pos[rank].numel()), 0)
                cols = tile.cols.take(torch.arange(keys.numel()), 0)
                visible = attention_mask(tile.q_pos, tile.k_pos, window)
                if mask.causal:
                    assert torch.equal(visible, torch.ones_like(visible).tril())
                elif mask.window is not None:
                    band = attention_tiles.visible(mask, *visible.shape, visible.device)
                    assert torch.equal(visible, band)
                elif mask.bias is None:
                    assert visible.all()
                else:
                    assert torch.equal(mask.bias == 0, visible)
                covered[rows[:, None], cols[None, :]] += visible.int()
            want = attention_mask(pos[rank], keys, window).int()
            assert torch.equal(covered, want), (rank, step)
            whole_steps = window == 0 or (layout == "contiguous" and policy.window)
            if policy.whole and whole_steps:
                assert len(plan.tiles(step)) == 1, (rank, step)
