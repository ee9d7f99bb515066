"""Muon in the planner: a rank's optimizer states, the bytes its redistribution moves per step and
its Newton–Schulz FLOPs, from the same parameter table, sharding and owner rule the optimizer
uses (`plan.states`, `shape.muon`; `train/muon.py` is what they model).

- States: one fp32 momentum buffer per Muon matrix, laid out as the parameter; the AdamW part's two
  fp32 moments and a 0-d fp32 step per parameter.
- Which matrices are split, and over which group: FSDP splits dim 0 of a dense matrix over
  dp_shard × cp, tensor parallelism its tp dim, both together one flattened group (shard outer, tp
  inner); an expert stack split only along its experts (FSDP without ep, or ep) splits no matrix.
  The matrices split over the same group get owners from `assign_owners` in parameter order.
- Bytes: each step a rank sends its shard of every matrix it does not own to the owner (the
  momentum update, in the Newton–Schulz dtype) and receives them back; an owner sends every other
  rank its shard of the result. Counted as `train/muon.py` counts them: bytes sent to other ranks.

Expert-parallel stacks sharded over an expert-shard group (dp_shard × cp > ep) are not modelled
yet (ValueError): the optimizer handles them, the planner does not place their owners.
`muon_plan` takes the fullest rank's numbers for `depthscale plan` (plan.estimate, plan.comm).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from depthscale.plan.layout import Layout
from depthscale.plan.states import (
    Param,
    StateBytes,
    _chunk,
    ep_shape,
    fsdp_sharded,
    local_numel,
    rank_params,
)
from depthscale.shape.muon import assign_owners, is_muon_matrix, ns_flops


def _split_over(p: Param, lay: Layout) -> tuple[str, ...]:
    """The groups ('shard', 'tp') that split `p`'s matrices in this layout."""
    if p.experts:
        if lay.ep > 1 and lay.expert_shard > 1:
            raise ValueError("the planner does not model Muon's owners of expert-sharded experts")
        return ()
    dims = ()
    if fsdp_sharded(p, lay) and lay.shard > 1:
        dims += ("shard",)
    if p.tp_dim is not None and lay.tp > 1:
        dims += ("tp",)
    return dims


def _routes(spec, lay: Layout, pp_rank: int) -> dict[tuple[str, ...], list[Param]]:
    """This rank's Muon matrices by the groups that split them (() = whole here)."""
    out: dict[tuple[str, ...], list[Param]] = {}
    for p in rank_params(spec, lay, pp_rank):
        if is_muon_matrix(p.name, len(p.shape)):
            out.setdefault(_split_over(p, lay), []).append(p)
    return out


def _group_rank(dims: tuple[str, ...], lay: Layout, tp_rank: int, shard_rank: int) -> int:
    sizes = {"shard": (lay.shard, shard_rank), "tp": (lay.tp, tp_rank)}
    rank = 0
    for d in dims:
        size, coordinate = sizes[d]
        rank = rank * size + coordinate
    return rank


def _group_size(dims: tuple[str, ...], lay: Layout) -> int:
    return (lay.shard if "shard" in dims else 1) * (lay.tp if "tp" in dims else 1)


def muon_state_bytes(spec, lay: Layout, pp_rank: int, tp_rank: int, shard_rank: int) -> StateBytes:
    """fp32 parameters and gradients, and Muon's states (see the module docstring), of one rank."""
    held = rank_params(spec, lay, pp_rank)
    params = optimizer = 0
    for p in held:
        n = local_numel(p, lay, tp_rank, shard_rank)
        params += n
        optimizer += 4 * n if is_muon_matrix(p.name, len(p.shape)) else 8 * n + 4
    return StateBytes(4 * params, 4 * params, optimizer)


def muon_step_work(
    spec,
    lay: Layout,
    pp_rank: int,
    tp_rank: int,
    shard_rank: int,
    ns_bytes: int = 4,
    ns_steps: int = 5,
) -> dict[str, int]:
    """{"to_owners", "from_owners"}: bytes this rank sends to other ranks in one step's
    redistribution (`ns_bytes` per element: 4 fp32 on CPU, 2 bf16 on CUDA), and "ns_flops": the
    Newton–Schulz FLOPs it runs (its owned matrices, and the whole ones it holds)."""
    out = {"to_owners": 0, "from_owners": 0, "ns_flops": 0}
    for dims, params in _routes(spec, lay, pp_rank).items():
        if not dims:
            out["ns_flops"] += sum(ns_flops(ep_shape(p, lay), ns_steps) for p in params)
            continue
        size = _group_size(dims, lay)
        me = _group_rank(dims, lay, tp_rank, shard_rank)
        owners = assign_owners([ns_flops(ep_shape(p, lay), ns_steps) for p in params], size)
        for p, owner in zip(params, owners):
            mine = local_numel(p, lay, tp_rank, shard_rank)
            if owner == me:
                whole = 1
                for s in ep_shape(p, lay):
                    whole *= s
                out["from_owners"] += (whole - mine) * ns_bytes
                out["ns_flops"] += ns_flops(ep_shape(p, lay), ns_steps)
            else:
                out["to_owners"] += mine * ns_bytes
    return out


@dataclass(frozen=True)
class MuonPlan:
    """The fullest rank's Muon costs in a layout (each the maximum over ranks)."""

    optimizer_bytes: int
    """Muon momentum and the AdamW part's moments and steps (`muon_state_bytes`)."""
    sent_bytes: int
    """Bytes the redistribution sends to other ranks per step (to and from owners)."""
    ns_flops: int
    """Newton–Schulz FLOPs per step."""


def muon_plan(spec, lay: Layout, ns_bytes: int = 2, ns_steps: int = 5) -> MuonPlan:
    """`muon_state_bytes` and `muon_step_work` over every (pp, tp, shard) rank of the layout,
    each at its maximum: replicas repeat a shard rank. ValueError where Muon is not modelled.

    The same sums, arranged so the layout search can afford them on every layout: per pipeline
    rank the parameters, their groups and owners are found once, and a rank's sums run over the
    distinct kinds of parameter (shape and sharding: a few, not every layer's copies), each
    kind's local sizes tabulated once per distinct tp shard (tested equal to the per-rank
    functions)."""
    opt = sent = flops = 0
    for pp_rank in range(lay.pp):
        held = rank_params(spec, lay, pp_rank)
        sizes = _LocalSizes(lay)
        states: dict[tuple, list] = {}  # kind + (muon,) -> [count, bytes per element, per param]
        for p in held:
            muon = is_muon_matrix(p.name, len(p.shape))
            entry = states.setdefault(
                sizes.kind(p) + (muon,), [0, 4 if muon else 8, 0 if muon else 4]
            )
            entry[0] += 1
        routes: dict[tuple[str, ...], list[Param]] = {}
        for p in held:
            if is_muon_matrix(p.name, len(p.shape)):
                routes.setdefault(_split_over(p, lay), []).append(p)
        groups, whole_flops = [], 0
        for dims, params in routes.items():
            costs = [ns_flops(ep_shape(p, lay), ns_steps) for p in params]
            if not dims:
                whole_flops += sum(costs)
                continue
            size = _group_size(dims, lay)
            owned: list[dict[tuple, int]] = [{} for _ in range(size)]
            total: dict[tuple, int] = {}
            owned_flops = [0] * size
            for p, owner, cost in zip(params, assign_owners(costs, size), costs):
                k = sizes.kind(p)
                total[k] = total.get(k, 0) + 1
                owned[owner][k] = owned[owner].get(k, 0) + 1
                owned_flops[owner] += cost
            whole = {k: math.prod(ep_shape(sizes.example[k], lay)) for k in total}
            groups.append((dims, total, owned, owned_flops, whole))
        for tp_rank in range(lay.tp):
            rows = {k: sizes.row(k, tp_rank) for k in sizes.example}
            for shard_rank in range(lay.shard):
                optimizer = 0
                for key, (count, per_element, per_param) in states.items():
                    optimizer += count * (per_element * rows[key[:-1]][shard_rank] + per_param)
                opt = max(opt, optimizer)
                moved, work = 0, whole_flops
                for dims, total, owned, owned_flops, whole in groups:
                    me = _group_rank(dims, lay, tp_rank, shard_rank)
                    work += owned_flops[me]
                    for k, n in total.items():
                        mine, own = rows[k][shard_rank], owned[me].get(k, 0)
                        moved += (n - own) * mine + own * (whole[k] - mine)
                sent = max(sent, moved * ns_bytes)
                flops = max(flops, work)
    return MuonPlan(opt, sent, flops)


class _LocalSizes:
    """`local_numel` of each kind of parameter (what its local size depends on) for every shard
    rank, computed once per distinct tp shard size of the kind."""

    def __init__(self, lay: Layout) -> None:
        self.lay = lay
        self.example: dict[tuple, Param] = {}
        self._rows: dict[tuple, list[int]] = {}

    def kind(self, p: Param) -> tuple:
        k = (p.shape, p.tp_dim, p.fsdp, p.experts)
        self.example.setdefault(k, p)
        return k

    def row(self, k: tuple, tp_rank: int) -> list[int]:
        lay, p = self.lay, self.example[k]
        tp_size = ep_shape(p, lay)[p.tp_dim] if p.tp_dim is not None else 0
        cls = (k, _chunk(tp_size, lay.tp, tp_rank))  # the tp shard's size: all local_numel reads
        if cls not in self._rows:
            self._rows[cls] = [local_numel(p, lay, tp_rank, r) for r in range(lay.shard)]
        return self._rows[cls]
