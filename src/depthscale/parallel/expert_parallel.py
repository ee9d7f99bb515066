"""Expert parallelism: the routed experts of every MoE layer split over groups of `ep` data-parallel
ranks, tokens sent to the rank that holds their expert and back by all-to-all.

"EP/CP are just variations on the DP dimension" (the Attention Residuals infra note): the ep ranks
are consecutive ranks of dp_shard, each still training its own rows of the batch. Only the routed
experts are split: rank i of an ep group holds experts [i·E/ep, (i+1)·E/ep) as a DTensor sharded on
the expert dimension (so checkpoints reshard to any other ep). FSDP then shards those experts over
the ranks that hold the same ones — the other ep groups of dp_shard and the cp ranks, HSDP across
replicas (`ExpertGroups`) — on their input dimension, and everything else as without MoE. Per MoE
layer and micro-batch (`AllToAllDispatch`):

1. every rank sorts its (token, expert) slots by expert (`model/moe.py`) and tells each peer how many
   rows it will send for each of that peer's experts (one small all-to-all of counts, then one host
   copy: the row splits must be known to post the exchange);
2. the rows go out in one all-to-all with uneven splits and arrive grouped by source; they are
   regrouped by local expert for the grouped GEMM;
3. the outputs take the inverse path (regroup, all-to-all back) and are combined by the router's
   weights where they came from. Backward runs the same two exchanges the other way round.

Every rank posts the same collectives in the same order (the layers' order), so the schedule is
NCCL-safe; each exchange is a span on the timeline.

Gradients: an expert's gradient on its holder already sums the contributions of every token the ep
group sent it; the gradient the optimizer needs is the mean over all data-parallel ranks, i.e. the
mean over the ranks holding the same experts (FSDP's reduce-scatter over the expert mesh, or by
hand where that mesh has only replicas), divided by ep (`reduce_expert_gradients`). The balancing
loads and bias updates are summed over all ranks in `parallel/expert_load.py`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from depthscale.model.moe import MoE
from depthscale.observe import spans
from depthscale.parallel import startup
from depthscale.parallel.mesh import ParallelDims, flat


class _AllToAll(torch.autograd.Function):
    """Rows exchanged with uneven splits; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, dy: Tensor):
        out_splits, in_splits = ctx.splits
        return _exchange(dy, in_splits, out_splits, ctx.group), None, None, None


def _exchange(x: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    x = x.contiguous()
    with spans.collective("all_to_all", group, x):
        dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    return out


def all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
    """Differentiable all-to-all of rows: `in_splits[r]` rows of x go to rank r, `out_splits[r]`
    arrive from it."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def regroup(counts: Tensor) -> Tensor:
    """Rows arriving as [source][local expert] segments (`counts` [sources, experts] on the host)
    → the order [local expert][source]: the index of each row of the new order in the old."""
    starts = (counts.flatten().cumsum(0) - counts.flatten()).view_as(counts)
    lengths = counts.t().flatten()
    first = starts.t().flatten()
    offset_in_segment = torch.arange(int(lengths.sum())) - torch.repeat_interleave(
        lengths.cumsum(0) - lengths, lengths
    )
    return torch.repeat_interleave(first, lengths) + offset_in_segment


class AllToAllDispatch:
    """The MoE dispatcher under expert parallelism (see the module doc)."""

    def __init__(self, group: ProcessGroup, n_experts: int) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.local = n_experts // self.size

    def dispatch(self, x: Tensor, counts: Tensor) -> tuple[Tensor, Tensor, tuple]:
        n, L = self.size, self.local
        with torch.no_grad():
            incoming = torch.empty_like(counts)
            with spans.collective("all_to_all", self.group, counts):
                dist.all_to_all_single(incoming, counts.contiguous(), group=self.group)
            both = torch.stack([counts, incoming]).cpu()  # the splits must be on the host
        sent, arriving = both[0].view(n, L), both[1].view(n, L)
        send, recv = sent.sum(1).tolist(), arriving.sum(1).tolist()
        rows = all_to_all(x, recv, send, self.group)
        order = regroup(arriving).to(x.device)
        local_counts = arriving.sum(0).to(x.device)
        return rows.index_select(0, order), local_counts, (order, send, recv)

    def combine(self, y: Tensor, handle: tuple) -> Tensor:
        order, send, recv = handle
        arrived = torch.zeros_like(y).index_copy(0, order, y)  # back to [source][expert]
        return all_to_all(arrived, send, recv, self.group)

    def __repr__(self) -> str:
        return f"all_to_all(ep={self.size})"


class ExpertGroups(NamedTuple):
    """Where a rank's experts live: its ep group, and the ranks holding the same experts."""

    ep: ProcessGroup
    mesh: DeviceMesh
    """(expert_replicate?, expert_shard?, ep): the ep dimension the experts are split over, and
    the dimensions of the other ranks holding the same experts — the other ep groups of dp_shard
    and the cp ranks (FSDP shards the experts over them), the replicas (HSDP)."""
    replicas: ProcessGroup | None
    """Without an expert shard dimension (dp_shard = ep, no cp): the replicas the experts'
    gradients are averaged over by hand (FSDP has nothing to shard them over)."""

    @property
    def fsdp_mesh(self) -> DeviceMesh | None:
        """The mesh FSDP shards the experts over (None: nothing to shard over)."""
        names = [n for n in self.mesh.mesh_dim_names if n != "ep"]
        return self.mesh[tuple(names)] if "expert_shard" in names else None


def expert_groups(
    dims: ParallelDims, ep: int, device_type: str, replicate: ProcessGroup | None = None
) -> ExpertGroups:
    """The process groups and device mesh of expert parallelism (see `ExpertGroups`): ep groups
    of `ep` consecutive dp_shard ranks; FSDP over the (dp_shard / ep) × cp ranks holding the same
    experts inside a replica; HSDP across replicas — `replicate`, the mesh's dp_replicate group
    (the same ranks: no second communicator)."""
    d = replace(dims, ep=ep)
    R, F, C = d.dp_replicate, d.dp_shard // ep, d.cp
    ranks = torch.arange(d.world_size).reshape(d.expert_mesh_shape)
    ep_group = startup.own_group(ranks.movedim(3, -1).reshape(-1, ep).tolist(), "expert_parallel")
    assert ep_group is not None
    p, *_, t = (int(i) for i in (ranks == dist.get_rank()).nonzero()[0])
    # this rank's (R, F·C, ep) block of ranks, and the groups along each of its dimensions
    block = ranks[p, :, :, :, :, t].permute(0, 1, 3, 2).reshape(R, F * C, ep)
    groups, names, shape = [], [], []
    if R > 1:
        assert replicate is not None, "expert_groups: dp_replicate > 1 needs its group"
        groups.append(replicate)
        names.append("expert_replicate")
        shape.append(R)
    if d.expert_shard > 1:
        parts = ranks.permute(0, 1, 3, 5, 2, 4).reshape(-1, F * C).tolist()
        groups.append(startup.own_group(parts, "expert_shard"))
        names.append("expert_shard")
        shape.append(F * C)
    groups.append(ep_group)
    mesh = DeviceMesh.from_group(
        groups if len(groups) > 1 else groups[0],
        device_type,
        mesh=block.reshape(*shape, ep).tolist(),
        mesh_dim_names=(*names, "ep"),
    )
    replicas = None
    if d.expert_shard == 1 and R > 1:
        replicas = groups[0]
    return ExpertGroups(ep_group, mesh, replicas)


def apply_expert_parallel(model: nn.Module, groups: ExpertGroups) -> list[str]:
    """Split every MoE layer's routed experts over the ep dimension (in place; meta or real
    weights) and route its tokens by all-to-all. Returns the names of the expert parameters."""
    mesh = groups.mesh["ep"]
    names = []
    for layer_name, layer in model.layers.items():
        ffn = layer.feed_forward
        if not isinstance(ffn, MoE):
            continue
        experts = ffn.experts
        for name, p in list(experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(p.data, mesh, [Shard(0)], src_data_rank=None)
            setattr(experts, name, nn.Parameter(sharded, requires_grad=p.requires_grad))
            names.append(f"layers.{layer_name}.feed_forward.experts.{name}")
        ffn.dispatcher = AllToAllDispatch(groups.ep, ffn.router.n_experts)
    return names


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """Every MoE layer's routed experts (what FSDP shards over the expert mesh)."""
    return [m.experts for m in model.modules() if isinstance(m, MoE)]


class ExpertShards:
    """The expert-parallel parameters (by name: materialising replaces the parameter objects) and
    what their gradients still need after FSDP: the replicas' mean where FSDP has no dimension
    to shard them over (`replicas`), and the division by ep that turns the ep group's sum over
    its tokens into the data-parallel mean."""

    def __init__(self, names: list[str], replicas: ProcessGroup | None, ep: int) -> None:
        self.names, self.replicas, self.ep = names, replicas, ep

    def reduce_gradients(self, model: nn.Module) -> None:
        params = dict(model.named_parameters())
        reduce_expert_gradients([params[n] for n in self.names], self.replicas, self.ep)


class SumOver:
    """Per-expert counts summed over groups in turn (over their product: each group spans one
    dimension of the mesh); no gradient: they are counts."""

    def __init__(self, *groups: ProcessGroup) -> None:
        self.groups = groups

    def __call__(self, counts: Tensor) -> Tensor:
        counts = counts.clone()
        for group in self.groups:
            with spans.collective("all_reduce", group, counts):
                dist.all_reduce(counts, group=group)
        return counts


def row_group(dims: ParallelDims) -> ProcessGroup:
    """The ranks holding parts of the same rows: cp × tp (sequence shards of both)."""
    ranks = torch.arange(dims.world_size).reshape(
        dims.pp * dims.dp_replicate * dims.dp_shard, dims.cp * dims.tp
    )
    group = startup.own_group(ranks.tolist(), "moe_rows")
    assert group is not None
    return group


def apply_balance_scope(
    model: nn.Module, mesh: DeviceMesh | None, dims: ParallelDims, scope: str
) -> None:
    """Over which ranks every MoE layer counts its auxiliary losses' statistics (`Router.forward`:
    counts summed over them, detached; each rank's loss is its tokens' share of the loss over all
    of them, so the shares sum to that loss and its gradient), and the factor its share is scaled
    by (`MoE.token_scale`: the gradient mean over the ranks holding different tokens divides by
    it; tp ranks sum the gradients of what they replicate).

    'micro_batch': the ranks holding the same rows, cp × tp (`row_group`): the loss of each
    data-parallel rank's micro-batch, as in Megatron. 'global_batch': every rank training a share
    of the same micro-batch step — dp × cp (the mesh's dp_cp group), then tp — summed over the
    data-parallel groups the loads of `parallel/expert_load.py` are summed over: the loss of the
    step's tokens whatever the layout (within a pipeline stage, whose ranks run the same
    micro-batches in the same order)."""
    if scope == "global_batch":
        groups = [flat(mesh, "dp_cp").get_group()] if dims.dp * dims.cp > 1 else []
        groups += [mesh["tp"].get_group()] if dims.tp > 1 else []
        scale = dims.dp * dims.cp
    else:
        groups = [row_group(dims)] if dims.cp * dims.tp > 1 else []
        scale = dims.cp
    if not groups:
        return
    totals = SumOver(*groups)
    for layer in model.layers.values():
        if isinstance(layer.feed_forward, MoE):
            layer.feed_forward.token_totals = totals
            layer.feed_forward.token_scale = float(scale)


@torch.no_grad()
def reduce_expert_gradients(params: list[Tensor], replicas: ProcessGroup | None, ep: int) -> None:
    """The data-parallel mean of the expert gradients (FSDP's mean over the expert mesh already
    taken): their mean over `replicas` where FSDP took none, then / ep."""
    grads = [_local(p.grad) for p in params if p.grad is not None]
    if not grads:
        return
    if replicas is None or dist.get_world_size(replicas) == 1:
        torch._foreach_div_(grads, float(ep))
        return
    flat = torch.cat([g.flatten() for g in grads])
    with spans.collective("all_reduce", replicas, flat):
        dist.all_reduce(flat, group=replicas)
    flat /= dist.get_world_size(replicas) * ep
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
