"""Interleaved-pipeline memory with the practices that bound it (issue #42, mechanism 3): lighter
end stages (`parallel.pp_ends_fewer_layers`, layouts' `ends`), stage outputs freed once sent
(Megatron), and attention without a score matrix (fused kernels) — on Llama 3 405B's layout, 126
layers on 16 ranks × 8 one-layer stages at 8K tokens without recompute, which was trained on 80 GB
GPUs and which the planner used to reject."""

from __future__ import annotations

import pytest

from depthscale.plan import activations
from depthscale.plan.estimate import Workload, estimate
from depthscale.plan.frameworks import MEGASCALE
from depthscale.plan.hardware import PRESETS
from depthscale.plan.layout import Layout, parse_layout
from depthscale.plan.pipeline import peak_in_flight, peak_weighted
from depthscale.plan.search import _stage_splits

H100 = PRESETS["h100"]
LLAMA_405B = dict(dim=16384, n_heads=128, kv_heads=8, ffn_dim=53248, vocab=128256)


def _llama(n_layers: int):
    from depthscale.shape import ModelShape

    return ModelShape(n_layers, tie_embeddings=False, **LLAMA_405B)


def _layout(**kw) -> Layout:
    return Layout(tp=8, pp=16, v=8, dp_replicate=128, micro_batch=1, zero1=True, **kw)


@pytest.mark.parametrize(("p", "v", "m"), [(2, 1, 4), (4, 2, 8), (4, 4, 16), (3, 2, 12)])
def test_the_weighted_walk_counts_what_the_schedule_keeps(p, v, m):
    """With every unit weighing 1 the walk is the schedule's in-flight peak (which the runtime's
    own peak equals: tests/dist/test_pipeline_in_flight.py); a chunk weighing nothing removes
    exactly its units."""
    for rank in range(p):
        assert peak_weighted(p, v, m, rank, (1.0,) * v) == peak_in_flight(p, v, m)[rank]
    if v > 1:  # the first rank's peak holds units of its first chunk
        assert peak_weighted(p, v, m, 0, (0.0,) + (1.0,) * (v - 1)) < peak_in_flight(p, v, m)[0]


def test_llama3_405b_layout_fits_with_the_practices_that_bound_it():
    spec = _llama(126)
    w = Workload(spec, 8192, 2048)  # 16M tokens: 16 micro-batches per pipeline
    gpus = 16384
    even = estimate(w, H100, _layout(), MEGASCALE, gpus)
    assert not even.ok and "does not divide 126 layers" in even.reason
    light = estimate(w, H100, _layout(ends=1), MEGASCALE, gpus)
    # every micro-batch of every chunk is in flight on the first rank at its peak (16 · 8 = 128
    # units), but chunk 0's 16 units hold no layer: 112 layers' activations, each Table 2's
    # 34·s·b·h/t (a fused kernel keeps no scores), and no received or sent state besides
    layer = activations.megatron(spec, 1, 8192, 8, True, "none", flash=True)
    assert light.peak_in_flight[0] == 128
    assert light.memory["activations"] == pytest.approx(112 * layer)
    assert light.memory["pipeline"] == 0.0
    assert light.reason.startswith("OOM by 0.") and light.tokens_per_s > 0  # would run
    bf16 = MEGASCALE.with_reduce_dtype("bfloat16")  # Megatron's bf16 gradient buffer
    fits = estimate(w, H100, _layout(ends=1), bf16, gpus)
    assert fits.ok, fits.reason


def test_lighter_ends_are_layouts_the_search_and_the_parser_know():
    assert (8, 1) in _stage_splits(126, 16) and (8, 0) not in _stage_splits(126, 16)
    assert _stage_splits(128, 16) == [(1, 0), (2, 0), (4, 0), (8, 0)]
    lay = parse_layout("tp=8,pp=16,v=8,ends=1")
    assert lay.ends == 1 and "ends=1" in lay.label()
    spec = _llama(10)
    bad = estimate(
        Workload(spec, 8192, 64), H100, Layout(pp=2, ends=1, micro_batch=1), MEGASCALE, 2
    )
    assert not bad.ok and "needs pp×v >= 3" in bad.reason
