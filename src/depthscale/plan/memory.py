"""Bytes on a layout's fullest rank: model states, activations, pipeline buffers, transients.

Model states follow `plan/states.py`'s placement in closed form (the search evaluates thousands of
layouts): tensor parallelism splits the dense weights, FSDP shards what it wraps over
dp_shard × cp, and expert parallelism splits an MoE layer's routed experts over ep — which FSDP
then shards over the ranks holding the same experts ((dp_shard / ep) × cp) — while the experts,
like the router, are replicated over tp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from depthscale.plan import activations
from depthscale.plan.frameworks import Framework
from depthscale.plan.layout import Layout
from depthscale.plan.pipeline import chunk_layers, hop_tensors, peak_weighted
from depthscale.shape import ModelShape


@dataclass(frozen=True)
class RankParams:
    """Parameters on the fullest pipeline rank (the first: it holds the embedding), after tp."""

    fsdp: float
    """What FSDP shards over dp_shard × cp (everything, without expert parallelism)."""
    experts: float
    """Expert-parallel experts: this rank's E/ep of each MoE layer, before FSDP shards them over
    `Layout.expert_shard` ranks."""
    layers: int
    """Layers on the rank."""
    root: float
    """Of `fsdp`, FSDP's root unit: the embedding and (without pipelining) the final norm,
    output read and head."""
    moe_layers: int = 0
    """Of `layers`, the MoE layers."""

    @property
    def total(self) -> float:
        return self.fsdp + self.experts

    def states(self, lay: Layout) -> float:
        """Elements of model states the rank keeps under the layout's FSDP."""
        return self.fsdp / lay.shard + self.experts / lay.expert_shard

    def experts_per_layer(self) -> float:
        """Expert-parallel experts FSDP gathers for one layer, on average over the rank's."""
        return self.experts / max(self.layers, 1)

    def fsdp_per_layer(self) -> float:
        """What FSDP gathers for one layer, on average over the rank's layers."""
        return (self.fsdp - self.root) / max(self.layers, 1)


def rank_params(s: ModelShape, lay: Layout) -> RankParams:
    """The first pipeline rank's parameters: its layers (chunks 0, pp, 2·pp, ... of
    `chunk_layers`), the embedding, and — without pipelining — the head."""
    ranges = chunk_layers(s, lay)
    mine = [i for c in range(0, lay.pp * lay.v, lay.pp) for i in ranges[c]]
    experts = sum(s.expert_params(i) for i in mine)
    dense = sum(s.layer_params(i) for i in mine) - experts
    root = (s.embedding_params() + (s.head_params() if lay.pp == 1 else 0)) / lay.tp
    fsdp = dense / lay.tp + root
    moe_layers = sum(i in s.moe_layers for i in mine)
    if lay.ep > 1:
        return RankParams(fsdp, experts / lay.ep, len(mine), root, moe_layers)
    return RankParams(fsdp + experts, 0.0, len(mine), root, moe_layers)


def memory(
    spec: ModelShape,
    seq: int,
    lay: Layout,
    fw: Framework,
    in_flight: tuple[int, ...],
    microbatches: int,
    params: RankParams,
    tokens: int,
    e: int,
) -> dict[str, float]:
    """Bytes on the fullest rank (the first pipeline rank holds the most micro-batches)."""
    weights, grads, optim = _state_bytes(lay, fw, params)
    units = max(in_flight) if in_flight else 1
    hops = hop_tensors(spec, lay)
    # received depth states, kept until their backward: the cache receives only missing blocks.
    # Megatron frees a stage's output once sent (`deallocate_pipeline_outputs`), and what a stage
    # receives is its first layer's LayerNorm input, in Table 2's count already
    pipeline = units * (max(hops) if hops else 0) * tokens * spec.dim * e / lay.tp
    if fw.frees_stage_outputs:
        pipeline = 0.0
    return {
        "weights": weights,
        "grads": grads,
        "optimizer": optim,
        "activations": _activation_bytes(spec, seq, lay, fw, units, microbatches, tokens, e),
        "pipeline": pipeline,
        "transient": _transient_bytes(spec, lay, fw, params, tokens, e),
    }


def _state_bytes(lay: Layout, fw: Framework, params: RankParams) -> tuple[float, float, float]:
    """(weights, gradients, optimizer states) on the rank: depthscale's FSDP shards (none on the
    device when offloaded), or Megatron's replicas with its distributed optimizer's shard."""
    if fw.ours:
        states = params.states(lay)
        if lay.offload:
            return 0.0, 0.0, 0.0
        return states * fw.weight_bytes, states * fw.grad_bytes, states * fw.moment_bytes
    optim = params.total * (fw.master_bytes + fw.moment_bytes) / (lay.dp if lay.zero1 else 1)
    return params.total * fw.weight_bytes, params.total * fw.grad_bytes, optim


def _activation_bytes(
    s: ModelShape,
    seq: int,
    lay: Layout,
    fw: Framework,
    units: int,
    microbatches: int,
    tokens: int,
    e: int,
) -> float:
    """What the first pipeline rank keeps for backward: `units` micro-batches of its chunks in
    flight (the schedule's peak), plus the embedding's and, without a pipeline, the head's."""
    chunks = lay.pp * lay.v
    ranges = chunk_layers(s, lay)
    mine = [ranges[c] for c in range(0, chunks, lay.pp)]  # the first rank's chunks
    if fw.ours:
        acts = activations.ours(
            s,
            tokens,
            seq // lay.cp,
            e == 2,
            lay.recompute,
            lay.tp,
            bf16_weights_gathered=lay.shard > 1,
            ep=lay.ep,
            experts_gathered=lay.expert_shard > 1 if lay.ep > 1 else lay.shard > 1,
        )
        per_chunk_bytes = [acts.of_layers(r) for r in mine]
        first_extra, last_extra = acts.embed, acts.head
    else:
        sp = lay.tp > 1
        flash = fw.attention == "flash"
        layer = activations.megatron(
            s, lay.micro_batch, seq // lay.cp, lay.tp, sp, lay.recompute, flash
        )
        per_chunk_bytes = [len(r) * layer for r in mine]
        sbh = lay.micro_batch * seq // lay.cp * s.dim
        first_extra = 0.0
        last_extra = 4 * sbh / lay.tp * (1 + s.vocab / s.dim) if lay.pp == 1 else 0.0
    if lay.pp > 1 and (lay.ends or s.moe):
        # chunks differ (lighter ends; dense first layers, every k-th MoE): the first rank's
        # live units, chunk by chunk along its order
        unit_bytes = (per_chunk_bytes[0] + first_extra, *per_chunk_bytes[1:])
        acts_bytes = peak_weighted(lay.pp, lay.v, microbatches, 0, unit_bytes)
    else:
        acts_bytes = units * per_chunk_bytes[0] + first_extra * math.ceil(units / lay.v)
    if lay.pp == 1:
        acts_bytes += last_extra
    return acts_bytes


def _transient_bytes(
    s: ModelShape, lay: Layout, fw: Framework, params: RankParams, tokens: int, e: int
) -> float:
    """Short-lived peaks: the last stage's fp32 logits and their gradient, and FSDP's gathered
    weights and unsharded gradients."""
    logits = 2 * tokens * s.vocab / lay.tp * 4  # fp32 logits and their gradient (last stage)
    transient = logits if lay.pp == 1 else 0.0
    if fw.ours and lay.shard > 1:
        layer = params.fsdp_per_layer() + params.experts_per_layer()
        if lay.pp > 1:
            # a stage accumulates unsharded fp32 gradients until the step's reduce-scatter, and
            # keeps its gathered weights for the step (zero3: two gathered layers, one prefetched)
            gathered = 2 * layer * e if lay.zero3 else params.total * e
            transient += gathered + params.total * 4
        else:  # two gathered layers (one prefetched), one unsharded gradient
            transient += layer * (2 * e + 4)
    return transient
