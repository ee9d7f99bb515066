"""The pipeline's makespan and in-flight micro-batches, from the schedule code that runs.

`parallel/pipeline/schedules.py` builds the per-rank action lists the runtime executes; here they
are simulated with the planner's per-stage costs. A long run of micro-batches is simulated up to
a few rounds of P and extended linearly: past warm-up every round of P micro-batches adds the
same steady-state time (`tests/unit/test_plan_pipeline.py` checks it against full simulations).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from depthscale.parallel.pipeline.schedules import Kind, interleaved_1f1b, simulate, split_layers
from depthscale.plan.layout import Layout
from depthscale.shape import ModelShape

_SIMULATED_ROUNDS = 1
"""Micro-batches simulated before extrapolating: this many rounds of P beyond the warm-up."""


@dataclass(frozen=True)
class PipelineTime:
    makespan: float
    peak_in_flight: tuple[int, ...]
    """Per pipeline rank: the most (micro-batch, chunk) units whose forward ran, backward not."""
    busy: tuple[float, ...]
    """Per rank: compute time (the rest of the makespan is bubble)."""

    @property
    def bubble(self) -> float:
        """Idle fraction of the busiest rank's makespan."""
        return 1 - max(self.busy) / self.makespan if self.makespan else 0.0


def peak_in_flight(p: int, v: int, m: int) -> tuple[int, ...]:
    """Per rank, the most units in flight under `interleaved_1f1b`: its warm-up forwards plus the
    steady state's one (the schedule's own counts; tests compare with the simulation)."""
    total = m * v
    if v == 1:
        return tuple(min(p - r, m) for r in range(p))
    return tuple(min((p - r - 1) * 2 + (v - 1) * p + 1, total) for r in range(p))


def chunk_layers(s: ModelShape, lay: Layout) -> list[range]:
    """Every model chunk's layers, as the runtime splits them (`split_layers`, lighter ends)."""
    return split_layers(s.n_layers, lay.pp * lay.v, lay.ends)


@lru_cache(maxsize=4096)
def peak_weighted(p: int, v: int, m: int, rank: int, weights: tuple[float, ...]) -> float:
    """The most a rank's live (micro-batch, chunk) units hold at once under `interleaved_1f1b`,
    its chunk c's unit holding `weights[c]` (chunks differ: lighter end stages, the embedding on
    the first) — walked along the rank's own order. Past a few rounds the steady state repeats
    the same peak, so long runs are walked that far."""
    m = min(m, p * (v + 2))
    alive = peak = 0.0
    for a in interleaved_1f1b(p, v, m)[rank]:
        if a.kind == Kind.F:
            alive += weights[a.stage // p]
            peak = max(peak, alive)
        elif a.kind == Kind.B:
            alive -= weights[a.stage // p]
    return peak


def closed_form(p: int, v: int, m: int, f: float, b: float, latency: float) -> PipelineTime:
    """The makespan of uniform stages without simulating: m·v·(f+b) of work and the (P−1)·(f+b)
    ramp (bubble (P−1)/(V·M)), plus a message latency per stage boundary each way. The search
    ranks with it and simulates its best candidates."""
    busy = m * v * (f + b)
    ramp = (p - 1) * (f + b + 2 * latency)
    return PipelineTime(busy + ramp, peak_in_flight(p, v, m), (busy,) * p)


@lru_cache(maxsize=4096)
def _simulated(p: int, v: int, m: int, f: tuple, b: tuple, latency: float) -> PipelineTime:
    tl = simulate(interleaved_1f1b(p, v, m), list(f), list(b), latency)
    busy = tuple(sum(e - s for s, e, _ in ev) for ev in tl.events)
    return PipelineTime(tl.makespan, tuple(tl.peak_in_flight), busy)


def pipeline_time(
    p: int,
    v: int,
    m: int,
    forward: list[float],
    backward: list[float],
    latency: float = 0.0,
) -> PipelineTime:
    """Makespan of one step of interleaved 1F1B (P ranks, V chunks each, M micro-batches) with
    per-stage forward/backward times and a per-message latency on the critical path."""
    if len(set(forward)) == 1 and len(set(backward)) == 1 and forward[0] not in (0.0, 1.0):
        # uniform stages: simulate in units of the forward time (shared across layouts)
        unit = forward[0]
        ratio, lat = round(backward[0] / unit, 2), round(latency / unit, 3)
        t = pipeline_time(p, v, m, [1.0] * len(forward), [ratio] * len(forward), lat)
        return PipelineTime(t.makespan * unit, t.peak_in_flight, tuple(x * unit for x in t.busy))
    f, b = tuple(forward), tuple(backward)
    cap = p * (2 * v + _SIMULATED_ROUNDS)
    if m <= cap + p:
        return _simulated(p, v, m, f, b, latency)
    base = _simulated(p, v, cap, f, b, latency)
    nxt = _simulated(p, v, cap + p, f, b, latency)
    rounds = (m - cap) / p
    makespan = base.makespan + rounds * (nxt.makespan - base.makespan)
    busy = tuple(x + rounds * (y - x) for x, y in zip(base.busy, nxt.busy, strict=True))
    return PipelineTime(makespan, nxt.peak_in_flight, busy)


def hop_tensors(s: ModelShape, lay: Layout) -> list[int]:
    """[tokens × d] tensors each forward hop carries: the hidden state, or the AttnRes depth
    state — partial sum plus the blocks the receiver lacks (Eq. 7–8 with the cache)."""
    chunks = lay.pp * lay.v
    if lay.pp == 1:
        return []
    if not s.attnres:
        return [1] * (chunks - 1)
    bl = s.blocks
    k, partial = [], []
    for stage in chunk_layers(s, lay):
        done = stage.stop * s.sublayers_per_layer
        ends = sum(1 for i in range(done) if i == len(bl) - 1 or bl[i + 1] != bl[i])
        k.append(1 + ends)
        partial.append(done < len(bl) and bl[done] == bl[done - 1])
    out = []
    for u in range(chunks - 1):
        prev = u + 1 - lay.pp
        cached = k[prev] if lay.cache and prev >= 0 else 0
        out.append(int(partial[u]) + k[u] - cached)
    return out
