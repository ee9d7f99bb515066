"""Bytes each rank hands to collectives and point-to-point per optimizer step (forward, backward
and gradient reduction of every micro-batch), per operation and process group — depthscale's
layouts, op by op, as `parallel/` issues them:

- tp (sequence parallel): per sublayer one all-gather of its input and one reduce-scatter of its
  output in forward and the mirror pair in backward (recompute gathers again, and reduce-scatters
  again all but the layer's last output, which backward does not need); one
  pair each for the head's input and the vocabulary-parallel embedding; the loss reduces three
  fp32 numbers per token; the replicated parameters' gradients are summed once per step.
- pp: each chunk sends its depth state forward and the gradient of its input back — the AttnRes
  hop carries the partial sum and the blocks the receiver lacks (cross-stage cache, Eq. 8); the
  loss is summed and a tied embedding's gradient all-reduced between first and last stage.
- cp (zigzag ring attention): a key/value block travels as far as the farthest rank that needs it;
  backward sends it again, and each rank passes the gradients of the blocks it received on to the
  next rank of the ring.
- FSDP over dp_shard × cp: every micro-batch all-gathers each unit's padded shards twice (forward,
  and backward after resharding) and reduce-scatters padded gradients (fp32, or bf16 with
  `parallel.grad_reduce_dtype`); under pipelines a
  stage keeps its gathered parameters for the step (`fsdp_reshard_after_forward = "auto"`), so
  each unit is gathered once and reduce-scattered once per step (`zero3`: gathered twice per
  micro-batch, reduce-scattered once); expert-parallel experts are units of their own, sharded
  on dim 1 over the ranks holding the same experts; HSDP all-reduces the reduced shards across
  replicas; the layers' AttnRes queries, left whole, are averaged over all data ranks; DDP
  all-reduces fp32 gradients (in C++).

Payload: an all-gather counts its output, a reduce-scatter its input, an all-reduce its tensor,
P2P what is sent and received. `wire_bytes` turns payloads into bytes on the wire.
`tests/dist/test_plan_comm.py` counts them on gloo ranks.
"""

from __future__ import annotations

import math
from collections import Counter

from depthscale.parallel.pipeline.schedules import split_layers
from depthscale.plan.layout import Layout
from depthscale.plan.pipeline import hop_tensors
from depthscale.plan.states import (
    ep_shape,
    fsdp_sharded,
    local_numel,
    rank_params,
)
from depthscale.shape import EXPERT_SHARD_DIM, MESH_DIMS, ModelShape
from depthscale.shape.ulysses import kv_heads_sent, ulysses_degrees

DIMS = MESH_DIMS


def dim_sizes(lay: Layout) -> dict[str, int]:
    """The layout's size along each mesh dimension."""
    return {"pp": lay.pp, "dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard,
            "cp": lay.cp, "tp": lay.tp}  # fmt: skip


def group(lay: Layout, *dims: str) -> str | None:
    """The label of the group spanning `dims`: its dimensions of size > 1, in mesh order."""
    sizes = dim_sizes(lay)
    real = [d for d in DIMS if d in dims and sizes[d] > 1]
    return "+".join(real) or None


def rank_payload(
    spec: ModelShape,
    lay: Layout,
    seq: int,
    batch: int,
    bf16: bool,
    pp_rank: int = 0,
    cp_rank: int = 0,
    shard_rank: int = 0,
    reduce_bytes: int = 4,
) -> Counter:
    """(operation, group) → bytes this rank hands over in one step; gradients are reduced in
    `reduce_bytes` per element (`parallel.grad_reduce_dtype`: 4 fp32, 2 bf16)."""
    e = 2 if bf16 else 4
    out: Counter = Counter()
    m = batch // (lay.dp * lay.micro_batch)
    tokens = lay.micro_batch * seq // lay.cp
    chunks = lay.pp * lay.v
    mine = list(range(pp_rank, chunks, lay.pp))
    ranges = split_layers(spec.n_layers, chunks, lay.ends)
    layers = sum(len(ranges[c]) for c in mine)
    first, last = 0 in mine, chunks - 1 in mine
    held = rank_params(spec, lay, pp_rank)
    if group(lay, "tp"):
        out.update(_tp_payload(spec, lay, held, m, tokens, layers, (first, last), e, shard_rank))
    if group(lay, "pp"):
        out.update(_pp_payload(spec, lay, held, m, seq, mine, (first, last), e, shard_rank))
    cp = group(lay, "cp")
    if cp:
        out += cp_payload(spec, lay, seq, m * layers, cp_rank, e)
        if last:
            out["all_reduce", cp] += m * 16

    out.update(_data_payload(spec, lay, held, m, bf16, reduce_bytes))
    if spec.moe:
        moe_layers = sum(1 for c in mine for i in ranges[c] if i in spec.moe_layers)
        out += moe_payload(spec, lay, held, m * moe_layers, tokens // lay.tp, e)
    return out


def _tp_payload(
    spec: ModelShape,
    lay: Layout,
    held: list,
    m: int,
    tokens: int,
    layers: int,
    ends_held: tuple[bool, bool],
    e: int,
    shard_rank: int,
) -> Counter:
    """Tensor parallelism's bytes: sequence-parallel gathers and scatters around every sublayer
    (and again where recomputation re-runs them), the loss's reductions on the last stage, and
    the gradients tp replicates."""
    out: Counter = Counter()
    tp = group(lay, "tp")
    first, last = ends_held
    sublayers = layers * spec.sublayers_per_layer
    ends = int(first) + int(last)  # the embedding's and the head's pair
    gathers = scatters = 2 * sublayers + ends
    if lay.recompute != "none":
        # recomputation re-gathers every sublayer's input; it stops before the layer's (or,
        # recomputing sublayer bodies, each body's) last reduce-scatter, whose output
        # backward does not need
        gathers += sublayers
        if lay.recompute in ("selective", "full"):
            scatters += layers * (spec.sublayers_per_layer - 1)
    out["all_gather", tp] += m * gathers * tokens * spec.dim * e
    out["reduce_scatter", tp] += m * scatters * tokens * spec.dim * e
    if last:
        out["all_reduce", tp] += m * 3 * tokens * 4
    # the gradients tp replicates, as this rank holds them: FSDP's shard (tp × dp_shard),
    # an expert-parallel rank's experts
    replicated = sum(local_numel(p, lay, 0, shard_rank) for p in held if p.tp_dim is None)
    out["all_reduce", tp] += replicated * 4
    return out


def _pp_payload(
    spec: ModelShape,
    lay: Layout,
    held: list,
    m: int,
    seq: int,
    mine: list[int],
    ends_held: tuple[bool, bool],
    e: int,
    shard_rank: int,
) -> Counter:
    """Pipeline parallelism's bytes: each chunk's hops out and in (activations forward, their
    gradients back), the stop vote, and the tied embedding's gradient between the end stages."""
    out: Counter = Counter()
    pp = group(lay, "pp")
    first, last = ends_held
    chunks = lay.pp * lay.v
    hops = hop_tensors(spec, lay)
    unit = lay.micro_batch * seq // lay.cp // lay.tp * spec.dim * e
    for c in mine:
        if c < chunks - 1:
            out["send", pp] += m * hops[c] * unit
            out["recv", pp] += m * hops[c] * unit  # the gradient of what it sent
        if c > 0:
            out["recv", pp] += m * hops[c - 1] * unit
            out["send", pp] += m * hops[c - 1] * unit
    out["all_reduce", pp] += 4
    if spec.tie_embeddings and (first or last) and not (first and last):
        tied = next(p for p in held if p.name in ("tok_embeddings.weight", "output.weight"))
        out["all_reduce", pp] += local_numel(tied, lay, 0, shard_rank) * 4  # its shard
    return out


def _data_payload(
    spec: ModelShape, lay: Layout, held: list, m: int, bf16: bool, reduce_bytes: int
) -> Counter:
    """Data parallelism's bytes: FSDP's gathers and reduce-scatters per unit (dense weights over
    dp_shard × cp, experts over their shard group), HSDP's or DDP's all-reduce, and the AttnRes
    parameters FSDP leaves whole."""
    out: Counter = Counter()
    shard = group(lay, "dp_shard", "cp")
    data = group(lay, "dp_replicate", "dp_shard", "cp")
    if lay.shard > 1:
        e_param = 2 if bf16 else 4
        gathers = 1 if lay.pp > 1 and not lay.zero3 else m * 2
        scatters = 1 if lay.pp > 1 else m
        g = reduce_bytes
        # FSDP's units: the dense weights over dp_shard × cp, expert-parallel experts over their
        # own shard group (`Layout.expert_shard`)
        units = [(shard, lay.shard, sum(_padded(p, lay) for p in held if fsdp_sharded(p, lay)))]
        if lay.expert_shard > 1:
            padded = sum(_padded_experts(p, lay) for p in held if p.experts)
            units.append((expert_group(lay), lay.expert_shard, padded))
        for grp, size, padded in units:
            out["all_gather", grp] += gathers * padded * e_param
            out["reduce_scatter", grp] += scatters * padded * g
            if lay.dp_replicate > 1:
                out["all_reduce", group(lay, "dp_replicate")] += padded // size * g
    elif lay.dp_replicate > 1:
        whole = sum(math.prod(p.shape) for p in held if fsdp_sharded(p, lay))
        out["all_reduce(ddp)", group(lay, "dp_replicate")] += whole * reduce_bytes
    if data and spec.attnres:
        queries = sum(math.prod(p.shape) for p in held if not p.fsdp)
        out["all_reduce", data] += queries * 4
    return out


CP_STYLES = {"ring": "a ring over cp", "ulysses": "all-to-alls over cp", "hybrid": "both"}


def cp_style(lay: Layout) -> str:
    """'ring', 'ulysses' or 'hybrid' (Ulysses groups inside, a ring across them)."""
    return "ring" if lay.ulysses == 1 else "ulysses" if lay.ulysses == lay.cp else "hybrid"


def cp_payload(
    spec: ModelShape, lay: Layout, seq: int, passes: int, cp_rank: int, e: int
) -> Counter:
    """Attention's traffic under context parallelism, `passes` = layers on this rank ×
    micro-batches (`parallel/ulysses.py`, `context_parallel.py`). Ulysses (degree u > 1): per pass
    one all-to-all of q, k, v (KV heads repeated up to u where fewer: `kv_heads_sent`) and one of
    the output, each of the local tokens' full (tp-local) heads; backward sends both again,
    recompute the forward's. The ring over the cp / u groups: a key/value block (this rank's
    KV heads after the exchange) travels as far as the farthest ring rank that needs it;
    backward sends it again, and each rank passes the gradients of the blocks it received on."""
    out: Counter = Counter()
    cp, u = group(lay, "cp"), lay.ulysses
    r, hd = lay.cp // u, spec.head_dim
    heads, kv = spec.n_heads // lay.tp, kv_heads_sent(spec.kv_heads // lay.tp, u)
    if u > 1:
        tokens = lay.micro_batch * seq // lay.cp
        forwards = 2 if lay.recompute != "none" else 1
        exchanged = tokens * (2 * heads + 2 * kv) * hd * e  # q, k, v in; the output back
        out["all_to_all", cp] += passes * (forwards + 1) * exchanged
    if r > 1:
        kv_token = lay.micro_batch * 2 * kv // u * hd * e  # K and V per token, this rank's heads
        me = cp_rank // u
        sent, received = ring_units(r, seq, spec.sliding_window, me)
        block = passes * seq // (2 * r) * kv_token  # one key chunk, every pass
        behind = ring_units(r, seq, spec.sliding_window, (me - 1) % r)[1]
        # K,V forward and again in backward; the gradients of the blocks a rank received move
        # on around the ring, so it receives what the rank behind it received
        out["send", cp] += (2 * sent + received) * block
        out["recv", cp] += (2 * received + behind) * block
    return out


def cp_choice(spec: ModelShape, lay: Layout, seq: int, batch: int, bf16: bool) -> dict:
    """Each CP style this layout allows ({label: wire bytes per step of the fullest cp rank}) and
    the one chosen: the fewest bytes (the ring on a tie: it needs no all-to-all)."""
    e, cp = 2 if bf16 else 4, group(lay, "cp")
    passes = batch // (lay.dp * lay.micro_batch) * -(-spec.n_layers // lay.pp)  # fullest stage
    options = {}
    for u in ulysses_degrees(spec.n_heads, spec.kv_heads, lay.tp, lay.cp):
        option = lay.with_(ulysses=u)
        payloads = [cp_payload(spec, option, seq, passes, c, e) for c in range(lay.cp)]
        # on the wire: what a rank sends, and all but its own share of an all-to-all
        worst = max(p["send", cp] + p["all_to_all", cp] * (u - 1) / u for p in payloads)
        label = cp_style(option) + (f" {u}×{lay.cp // u}" if 1 < u < lay.cp else "")
        options[label] = (u, worst)
    chosen = min(options, key=lambda k: (options[k][1], options[k][0]))
    return {"chosen": chosen, "ulysses": options[chosen][0],
            "options": {k: b for k, (_, b) in options.items()}}  # fmt: skip


def moe_payload(spec: ModelShape, lay: Layout, held, passes: int, tokens: int, e: int) -> Counter:
    """Expert parallelism's traffic (`parallel/expert_parallel.py`), `passes` = MoE layers on
    this rank × micro-batches: per pass and forward, the experts' row counts (one int64 per
    expert) and the routed rows out (tokens·k) and back; backward sends both again. The rows
    that come back and the gradients sent back are those that arrived, tokens·k when routing is
    balanced (over an ep group the sums are exact whatever the routing). Recompute runs the
    forward's exchanges again. Where FSDP has no expert shard group (dp_shard = ep, no cp), the
    expert gradients are averaged over the replicas by hand (fp32); under cp/tp each pass sums
    the auxiliary loss's counts over the rows' ranks."""
    out: Counter = Counter()
    forwards = 2 if lay.recompute != "none" else 1
    rows = tokens * spec.moe_top_k * spec.dim * e
    if lay.ep > 1:
        counts = spec.n_experts * 8
        out["all_to_all", group(lay, "dp_shard")] += passes * (
            forwards * (counts + 2 * rows) + 2 * rows
        )
        if lay.expert_shard == 1 and lay.dp_replicate > 1:  # no FSDP: averaged by hand
            experts = sum(math.prod(ep_shape(p, lay)) for p in held if p.experts)
            out["all_reduce", group(lay, "dp_replicate")] += experts * 4
    rows_group = group(lay, "cp", "tp")
    if rows_group and spec.moe_aux:
        out["all_reduce", rows_group] += passes * forwards * (spec.n_experts + 1) * 4
    return out


def expert_group(lay: Layout) -> str | None:
    """The label of an expert shard group: the dimensions it spans (part of dp_shard, cp)."""
    return group(lay, *(["dp_shard"] if lay.dp_shard > lay.ep else []), "cp")


def _padded_experts(p, lay: Layout) -> int:
    """Elements of an expert-parallel weight's FSDP shard times its group's size (dim 1 padded
    to equal lengths)."""
    shape = list(ep_shape(p, lay))
    n = lay.expert_shard
    shape[EXPERT_SHARD_DIM] = math.ceil(shape[EXPERT_SHARD_DIM] / n) * n
    return math.prod(shape)


def _padded(p, lay: Layout) -> int:
    """Elements of a parameter's FSDP shard times the group size (shards are padded to equal
    dim-0 lengths), after tensor parallelism's split."""
    shape = list(p.shape)
    if p.tp_dim is not None and lay.tp > 1:
        shape[p.tp_dim] = math.ceil(shape[p.tp_dim] / lay.tp)
    rows = math.ceil(shape[0] / lay.shard) * lay.shard
    return rows * math.prod(shape[1:])


def _needs(q: int, k: int, chunk: int, window: int) -> bool:
    """Does query chunk q see any key of chunk k (causal, optionally within `window`)?"""
    if q < k:
        return False
    if window <= 0 or q == k:
        return True
    return (q - k - 1) * chunk + 1 < window


def _ring_blocks(cp: int, seq: int, window: int) -> list[tuple[int, int]]:
    """(owner, hops) of every key chunk under the zigzag layout (rank r holds chunks r and
    2·cp−1−r): a block goes around the ring to the farthest rank that needs it."""
    chunk = seq // (2 * cp)
    holds = {r: (r, 2 * cp - 1 - r) for r in range(cp)}
    blocks = []
    for owner in range(cp):
        for k in holds[owner]:
            hops = 0
            for other in range(cp):
                if other != owner and any(_needs(q, k, chunk, window) for q in holds[other]):
                    hops = max(hops, (other - owner) % cp)
            blocks.append((owner, hops))
    return blocks


def ring_units(cp: int, seq: int, window: int, rank: int) -> tuple[int, int]:
    """(key chunks this rank sends, key chunks it receives) in one forward ring."""
    sent = received = 0
    for owner, hops in _ring_blocks(cp, seq, window):
        for h in range(hops):  # hop h: from owner+h to owner+h+1
            sent += (owner + h) % cp == rank
            received += (owner + h + 1) % cp == rank
    return sent, received


def muon_payload(lay: Layout, sent_bytes: int) -> Counter:
    """Muon's redistribution per step (`plan.muon_states.muon_plan`'s `sent_bytes`, counted as
    `train/muon.py` counts them: what a rank sends to the other ranks), on the group that splits
    its matrices: dp_shard × cp and tp."""
    grp = group(lay, "dp_shard", "cp", "tp")
    return Counter({("muon_all_to_all", grp): sent_bytes}) if grp and sent_bytes else Counter()


def wire_bytes(payload: Counter, sizes: dict[str, int]) -> float:
    """Bytes on the wire per rank for ring algorithms: (n−1)/n of an all-gather or
    reduce-scatter, 2·(n−1)/n of an all-reduce, all of a send and of Muon's all-to-all (its
    payload is already what leaves the rank)."""
    total = 0.0
    for (op, grp), b in payload.items():
        n = math.prod(sizes[d] for d in grp.split("+"))
        if op.startswith("all_reduce"):
            total += 2 * (n - 1) / n * b
        elif op in ("all_gather", "reduce_scatter"):
            total += (n - 1) / n * b
        elif op in ("send", "muon_all_to_all"):
            total += b
    return total
