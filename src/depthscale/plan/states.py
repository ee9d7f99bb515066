"""Model states per rank, exactly: which parameters a rank holds and how many of their elements.

The parameter table mirrors `Transformer` (names, shapes), how tensor parallelism places each
(vocabulary and column-parallel rows Shard(0), row-parallel Shard(1), norms and AttnRes queries
replicated), which pipeline stage owns it (`split_layers`: earlier stages take the remainder; the
embedding on the first, the output read, final norm and head on the last, a tied head copied there
when they are different ranks), and how FSDP2 shards it (dim 0 of the tp-local tensor in
`torch.chunk` pieces over dp_shard × cp; the layers' AttnRes queries stay whole; expert-parallel
experts split over ep on dim 0 and sharded on dim 1 over the ranks holding the same experts).
Gradients have their parameter's local shape; AdamW and LAMB keep two fp32 moments of that shape and a 0-d fp32
step per parameter. `tests/dist/test_plan_states.py` compares it with what gloo ranks allocate.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from depthscale.parallel.pipeline.schedules import split_layers
from depthscale.plan.layout import Layout
from depthscale.shape import EXPERT_SHARD_DIM, ModelShape


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    tp_dim: int | None
    """The dimension tensor parallelism shards (None: replicated)."""
    stage: str
    """'embed', 'layer:<i>' or 'head'."""
    fsdp: bool = True
    """False for what FSDP leaves whole (the layers' AttnRes queries)."""
    experts: bool = False
    """An MoE layer's routed experts: split over ep on dim 0, then FSDP-sharded on dim 1 over
    the ranks holding the same experts; without ep, FSDP-sharded like any weight."""


@functools.lru_cache(maxsize=16)
def param_table(spec: ModelShape) -> tuple[Param, ...]:
    """Every parameter of our `Transformer`, in `named_parameters()` order. Cached (a search
    asks for it per layout and pipeline rank; the spec is frozen, and so is the tuple)."""
    if spec.family != "llama":
        raise ValueError("param_table models depthscale's own model (family 'llama')")
    d, hd = spec.dim, spec.head_dim
    out = [Param("tok_embeddings.weight", (spec.vocab, d), 0, "embed")]
    residuals = ["residual"] if spec.parallel_block else ["attention_residual", "ffn_residual"]
    for i in range(spec.n_layers):
        stage = f"layer:{i}"
        p = f"layers.{i}."
        out.append(Param(p + "attention_norm.weight", (d,), None, stage))
        out += [
            Param(p + "attention.wq.weight", (spec.n_heads * hd, d), 0, stage),
            Param(p + "attention.wk.weight", (spec.kv_heads * hd, d), 0, stage),
            Param(p + "attention.wv.weight", (spec.kv_heads * hd, d), 0, stage),
            Param(p + "attention.wo.weight", (d, spec.n_heads * hd), 1, stage),
        ]
        out += _ffn(spec, p + "feed_forward.", stage, i)
        if not spec.parallel_block:
            out.append(Param(p + "ffn_norm.weight", (d,), None, stage))
        if spec.attnres:
            for r in residuals:
                out.append(Param(p + r + ".pseudo_query", (d,), None, stage, fsdp=False))
                if spec.key_norm_gain:
                    out.append(Param(p + r + ".key_norm", (d,), None, stage, fsdp=False))
    if spec.attnres:
        out.append(Param("output_residual.pseudo_query", (d,), None, "head"))
        if spec.key_norm_gain:
            out.append(Param("output_residual.key_norm", (d,), None, "head"))
    out.append(Param("norm.weight", (d,), None, "head"))
    out.append(Param("output.weight", (spec.vocab, d), 0, "head"))
    return tuple(out)


def _ffn(spec: ModelShape, p: str, stage: str, layer: int) -> list[Param]:
    """A layer's FFN: SwiGLU, or the MoE router, routed experts [E, in, out] and shared SwiGLU."""
    d = spec.dim
    if layer not in spec.moe_layers:
        return _swiglu(p, d, spec.ffn_dim, stage)
    e, f = spec.n_experts, spec.moe_ffn
    out = [
        Param(p + "router.weight", (e, d), None, stage),
        Param(p + "experts.w_gate", (e, d, f), None, stage, experts=True),
        Param(p + "experts.w_up", (e, d, f), None, stage, experts=True),
        Param(p + "experts.w_down", (e, f, d), None, stage, experts=True),
    ]
    if spec.moe_shared:
        out += _swiglu(p + "shared.", d, spec.moe_shared * f, stage)
    return out


def _swiglu(p: str, d: int, hidden: int, stage: str) -> list[Param]:
    return [
        Param(p + "w_gate.weight", (hidden, d), 0, stage),
        Param(p + "w_up.weight", (hidden, d), 0, stage),
        Param(p + "w_down.weight", (d, hidden), 1, stage),
    ]


def fsdp_sharded(p: Param, lay: Layout) -> bool:
    """Whether FSDP shards `p` over dp_shard × cp in this layout (not the AttnRes queries, nor
    expert-parallel experts: those it shards over their own group, `Layout.expert_shard`)."""
    return p.fsdp and not (p.experts and lay.ep > 1)


def ep_shape(p: Param, lay: Layout) -> tuple[int, ...]:
    """`p`'s shape on one rank before tp and FSDP: experts split over ep on dim 0."""
    if p.experts and lay.ep > 1:
        return (p.shape[0] // lay.ep, *p.shape[1:])
    return p.shape


def _chunk(n: int, parts: int, index: int) -> int:
    """Length of piece `index` of `torch.chunk(range(n), parts)` (0 past the end)."""
    size = math.ceil(n / parts)
    return max(0, min(size, n - index * size))


def rank_params(spec: ModelShape, lay: Layout, pp_rank: int) -> list[Param]:
    """The parameters pipeline rank `pp_rank` holds."""
    stages = lay.pp * lay.v
    ranges = split_layers(spec.n_layers, stages, lay.ends)
    mine = range(pp_rank, stages, lay.pp)
    layers = {i for s in mine for i in ranges[s]}
    first, last = 0 in mine, stages - 1 in mine
    tied_once = spec.tie_embeddings and first and last
    held = []
    for p in param_table(spec):
        if p.stage == "embed" and first:
            held.append(p)
        elif p.stage == "head" and last:
            if p.name == "output.weight" and tied_once:
                continue  # the same parameter as the embedding
            held.append(p)
        elif p.stage.startswith("layer:") and int(p.stage[6:]) in layers:
            held.append(p)
    return held


def local_numel(p: Param, lay: Layout, tp_rank: int, shard_rank: int) -> int:
    shape = list(ep_shape(p, lay))
    if p.tp_dim is not None and lay.tp > 1:
        shape[p.tp_dim] = _chunk(shape[p.tp_dim], lay.tp, tp_rank)
    if fsdp_sharded(p, lay) and lay.shard > 1:
        shape[0] = _chunk(shape[0], lay.shard, shard_rank)
    elif p.experts and lay.expert_shard > 1:
        d, rank = EXPERT_SHARD_DIM, lay.degrees.expert_shard_rank(shard_rank)
        shape[d] = _chunk(shape[d], lay.expert_shard, rank)
    return math.prod(shape)


@dataclass(frozen=True)
class StateBytes:
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def rank_state_bytes(
    spec: ModelShape, lay: Layout, pp_rank: int, tp_rank: int, shard_rank: int
) -> StateBytes:
    """fp32 parameters, fp32 gradients, AdamW/LAMB state (two fp32 moments, a 0-d fp32 step per
    parameter) held by one rank (`shard_rank`: its index in the dp_shard × cp group). Offloaded
    states live in host memory and count there."""
    held = rank_params(spec, lay, pp_rank)
    elements = sum(local_numel(p, lay, tp_rank, shard_rank) for p in held)
    return StateBytes(4 * elements, 4 * elements, 8 * elements + 4 * len(held))
