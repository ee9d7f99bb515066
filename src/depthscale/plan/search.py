"""Every layout of a job, predicted and ranked; each rejected one with the constraint it breaks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from depthscale.plan.activations import RECOMPUTE_MODES
from depthscale.plan.estimate import Estimate, Workload, check, estimate
from depthscale.plan.frameworks import Framework
from depthscale.plan.hardware import Cluster
from depthscale.plan.layout import Layout
from depthscale.plan.muon_states import MuonPlan
from depthscale.shape import Degrees, ModelShape

MICRO_BATCHES = (1, 2, 4, 8)
MAX_VIRTUAL = 8
MIN_CP_CHUNK = 128
"""Tokens in each of a cp rank's two zigzag chunks, at least: one attention tile of the fused
kernels (below it a ring step is launch-bound). So cp is bounded by the sequence — up to
seq / 256 — and by the mesh, not by a constant: 128K tokens may take cp = 512."""


def max_cp(seq: int) -> int:
    """The largest cp a sequence of `seq` tokens is cut over (zigzag: 2·cp chunks of at least
    MIN_CP_CHUNK tokens); 1 for sequences too short to cut."""
    return max(1, seq // (2 * MIN_CP_CHUNK))


@dataclass
class SearchResult:
    ranked: list[Estimate]
    """Layouts that fit, fastest first."""
    rejected: list[Estimate]
    """Layouts that do not, each with `reason`."""
    considered: int


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _powers_of_two(limit: int) -> list[int]:
    out, k = [], 1
    while k <= limit:
        out.append(k)
        k *= 2
    return out


def layouts(w: Workload, c: Cluster, fw: Framework, gpus: int) -> Iterator[Layout]:
    """Candidate layouts: tp a power of two up to a node, pp dividing the layers (or, with the end
    stages one layer lighter, the layers + 2), v up to MAX_VIRTUAL, cp a power of two, the rest
    data parallel — FSDP over the node's remaining GPUs (HSDP across nodes), whole-world FSDP or
    plain replicas (ours), replicas with or without
    the distributed optimizer (Megatron) — times micro-batch sizes and recompute modes, and for
    an MoE model the expert-parallel splits of dp_shard. cp is bounded by the sequence
    (`max_cp`) and the GPUs left beside tp."""
    s = w.spec
    for tp in _powers_of_two(min(c.gpus_per_node, gpus)):
        for cp in _powers_of_two(min(max_cp(w.seq), gpus // tp)):
            for pp in sorted(set(_divisors(s.n_layers)) | set(_divisors(s.n_layers + 2))):
                if tp * cp * pp > gpus or gpus % (tp * cp * pp):
                    continue
                dp = gpus // (tp * cp * pp)
                for shard, rep, zero1 in _dp_splits(c, fw, tp, cp, dp):
                    for ep in _expert_splits(s, shard):
                        for v, ends in _stage_splits(s.n_layers, pp):
                            for mb in MICRO_BATCHES:
                                for rc in RECOMPUTE_MODES:
                                    if rc == "sublayer" and not fw.ours:
                                        continue
                                    yield Layout(
                                        tp, pp, v, cp, shard, rep, mb, rc, True, False, zero1,
                                        ep=ep, ends=ends,
                                    )  # fmt: skip


def _dp_splits(c: Cluster, fw: Framework, tp: int, cp: int, dp: int) -> list[tuple]:
    if not fw.ours:
        return [(1, dp, False), (1, dp, True)] if dp > 1 else [(1, 1, False)]
    splits = {(dp, 1), (1, dp)}
    in_node = max(1, c.gpus_per_node // (tp * cp))
    if dp % in_node == 0:
        splits.add((in_node, dp // in_node))
    return [(s, r, False) for s, r in sorted(splits)]


def _stage_splits(n_layers: int, pp: int) -> list[tuple[int, int]]:
    """(virtual stages, ends) of a pipeline of pp ranks: every v up to MAX_VIRTUAL whose pp·v
    stages split the layers evenly, and those that do so once the first and last stage give up
    one layer each (Llama 3 405B: 126 layers on 16 × 8 stages)."""
    if pp == 1:
        return [(1, 0)]
    even = [(v, 0) for v in range(1, MAX_VIRTUAL + 1) if n_layers % (pp * v) == 0]
    light = [
        (v, 1)
        for v in range(1, MAX_VIRTUAL + 1)
        if pp * v >= 3 and n_layers % (pp * v) and (n_layers + 2) % (pp * v) == 0
    ]
    return even + light


def _expert_splits(s: ModelShape, dp_shard: int) -> list[int]:
    """Expert parallelism's candidates for an MoE model: every power of two dividing both
    dp_shard and the experts (1: experts sharded by FSDP like any weight)."""
    if not s.moe:
        return [1]
    return [
        ep
        for ep in _powers_of_two(dp_shard)
        if not Degrees(dp_shard=dp_shard, ep=ep).expert_rule(s.n_experts)
    ]


def _regathers(lay: Layout, fw: Framework) -> bool:
    """Whether the layout has a zero3 twin: a pipeline of ours under FSDP."""
    return fw.ours and lay.pp > 1 and lay.shard > 1 and not lay.zero3


SIMULATED = 8
"""Candidates whose pipelines are simulated after the closed-form pass ranks every layout."""


def search(
    w: Workload,
    c: Cluster,
    fw: Framework,
    gpus: int,
    simulated: int = SIMULATED,
    muon: Callable[[Layout], MuonPlan | None] | None = None,
) -> SearchResult:
    """Rank every layout by the closed-form pipeline, then simulate the best `simulated` with
    the schedule code that runs and rank those again. `muon`: the optimizer is Muon, each layout
    estimated with its `MuonPlan` (its states decide what fits, its Newton–Schulz time the rank;
    None for a layout Muon's model does not cover: AdamW's estimate)."""
    plan_of = muon or (lambda lay: None)
    ranked, rejected, n = [], [], 0
    for lay in layouts(w, c, fw, gpus):
        n += 1
        reason = check(w, c, lay, fw, gpus)
        if reason:
            rejected.append(Estimate(lay, ok=False, reason=reason))
            continue
        est = estimate(w, c, lay, fw, gpus, simulate=False, muon=plan_of(lay))
        if not est.ok and est.reason.startswith("OOM") and _regathers(lay, fw):
            # a pipeline under FSDP that runs out of memory keeping its stage's weights gathered
            # may fit re-gathering them per micro-batch (zero3): more traffic, never faster, so
            # tried only here
            n += 1
            lay3 = lay.with_(zero3=True)
            zero3 = estimate(w, c, lay3, fw, gpus, simulate=False, muon=plan_of(lay3))
            rejected.append(est)
            est = zero3
        (ranked if est.ok else rejected).append(est)
    ranked.sort(key=lambda e: e.step_s)
    best = [estimate(w, c, e.layout, fw, gpus, muon=plan_of(e.layout)) for e in ranked[:simulated]]
    refined = sorted((e for e in best if e.ok), key=lambda e: e.step_s)
    rejected += [e for e in best if not e.ok]
    return SearchResult(refined + ranked[simulated:], rejected, n)
