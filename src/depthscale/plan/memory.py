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
from depthscale.plan.spec import ModelSpec


@dataclass(frozen=True)
class RankParams:
    """Parameters on the fullest pipeline rank (the first: it holds the embedding), after tp."""

    fsdp: float
    """What FSDP shards over dp_shard × cp (everything, without expert parallelism)."""
    experts: float
    """Expert-parallel experts: this rank's E/ep of each MoE layer, before FSDP shards them over
    `expert_shard` ranks."""
    layers: int
    """Layers on the rank."""
    ends: float
    """Of `fsdp`, the embedding and (without pipelining) the final norm, output read and head."""
    moe_layers: int = 0
    """Of `layers`, the MoE layers."""
    expert_shard: int = 1
    """Ranks FSDP shards `experts` over."""

    @property
    def total(self) -> float:
        return self.fsdp + self.experts

    def states(self, shard: int) -> float:
        """Elements of model states the rank keeps under FSDP over `shard` ranks."""
        return self.fsdp / shard + self.experts / self.expert_shard

    def experts_per_layer(self) -> float:
        """Expert-parallel experts FSDP gathers for one layer, on average over the rank's."""
        return self.experts / max(self.layers, 1)

    def fsdp_per_layer(self) -> float:
        """What FSDP gathers for one layer, on average over the rank's layers."""
        return (self.fsdp - self.ends) / max(self.layers, 1)


def rank_params(s: ModelSpec, lay: Layout) -> RankParams:
    """The first pipeline rank's parameters: its layers (chunks 0, pp, 2·pp, ... of
    `chunk_layers`), the embedding, and — without pipelining — the head."""
    ranges = chunk_layers(s, lay)
    mine = [i for c in range(0, lay.pp * lay.v, lay.pp) for i in ranges[c]]
    experts = sum(s.expert_params(i) for i in mine)
    dense = sum(s.layer_params(i) for i in mine) - experts
    ends = (s.embedding_params() + (s.head_params() if lay.pp == 1 else 0)) / lay.tp
    fsdp = dense / lay.tp + ends
    moe_layers = sum(i in s.moe_layers for i in mine)
    if lay.ep > 1:
        shard = lay.dp_shard // lay.ep * lay.cp
        return RankParams(fsdp, experts / lay.ep, len(mine), ends, moe_layers, shard)
    return RankParams(fsdp + experts, 0.0, len(mine), ends, moe_layers)


def memory(
    spec: ModelSpec,
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
    s = spec
    local_params = params.total
    if fw.ours:
        states = params.states(lay.shard)
        weights, grads = states * fw.weight_bytes, states * fw.grad_bytes
        optim = states * fw.moment_bytes
        if lay.offload:
            weights = grads = optim = 0.0
    else:
        weights, grads = local_params * fw.weight_bytes, local_params * fw.grad_bytes
        optim = local_params * (fw.master_bytes + fw.moment_bytes) / (lay.dp if lay.zero1 else 1)
    chunks = lay.pp * lay.v
    ranges = chunk_layers(s, lay)
    mine = [ranges[c] for c in range(0, chunks, lay.pp)]  # the first rank's chunks
    per_chunk = s.n_layers // chunks
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
            experts_gathered=params.expert_shard > 1 if lay.ep > 1 else lay.shard > 1,
        )
        chunk_bytes = acts.of_layers(range(per_chunk))
        per_chunk_bytes = [acts.of_layers(r) for r in mine]
        if s.moe:  # layers differ (dense first layers, every k-th MoE): the rank's mean chunk
            chunk_bytes = sum(per_chunk_bytes) / len(mine)
        first_extra, last_extra = acts.embed, acts.head
    else:
        sp = lay.tp > 1
        flash = fw.attention == "flash"
        layer = activations.megatron(
            s, lay.micro_batch, seq // lay.cp, lay.tp, sp, lay.recompute, flash
        )
        chunk_bytes = per_chunk * layer
        per_chunk_bytes = [len(r) * layer for r in mine]
        sbh = lay.micro_batch * seq // lay.cp * s.dim
        first_extra = 0.0
        last_extra = 4 * sbh / lay.tp * (1 + s.vocab / s.dim) if lay.pp == 1 else 0.0
    units = max(in_flight) if in_flight else 1
    acts_bytes = units * chunk_bytes + first_extra * math.ceil(units / lay.v)
    if lay.ends and lay.pp > 1:  # chunks differ: the first rank's live units, chunk by chunk
        unit_bytes = (per_chunk_bytes[0] + first_extra, *per_chunk_bytes[1:])
        acts_bytes = peak_weighted(lay.pp, lay.v, microbatches, 0, unit_bytes)
    if lay.pp == 1:
        acts_bytes += last_extra
    hops = hop_tensors(s, lay)
    # received depth states, kept until their backward: the cache receives only missing blocks.
    # Megatron frees a stage's output once sent (`deallocate_pipeline_outputs`), and what a stage
    # receives is its first layer's LayerNorm input, in Table 2's count already
    pipeline = units * (max(hops) if hops else 0) * tokens * s.dim * e / lay.tp
    if fw.frees_stage_outputs:
        pipeline = 0.0
    logits = 2 * tokens * s.vocab / lay.tp * 4  # fp32 logits and their gradient (last stage)
    transient = logits if lay.pp == 1 else 0.0
    layer_local = params.fsdp_per_layer() if fw.ours else s.layer_params() / lay.tp
    if fw.ours and lay.shard > 1 and lay.pp > 1:
        # a stage accumulates unsharded fp32 gradients until the step's reduce-scatter, and keeps
        # its gathered weights for the step (zero3: two gathered layers, one prefetched)
        layer_local += params.experts_per_layer()
        whole = params.fsdp + params.experts
        gathered = 2 * layer_local * e if lay.zero3 else whole * e
        transient += gathered + whole * 4
    elif fw.ours and lay.shard > 1:  # two gathered layers (one prefetched), one unsharded grad
        transient += (layer_local + params.experts_per_layer()) * (2 * e + 4)
    return {
        "weights": weights,
        "grads": grads,
        "optimizer": optim,
        "activations": acts_bytes,
        "pipeline": pipeline,
        "transient": transient,
    }
