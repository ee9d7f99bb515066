"""Data parallelism: every dp rank trains the same model on its own slice of the global batch.

Three flavours, chosen by the mesh `parallelize()` hands over:

- `apply_fsdp` on a 1-D `dp_shard` mesh: FSDP2 / ZeRO-3. Parameters, gradients and optimizer state are
  sharded; each unit (one TransformerBlock, or the root) all-gathers its parameters just before it
  runs and reduce-scatters its gradients as soon as its backward is done.
- `apply_fsdp` on a 2-D (`dp_replicate`, `dp_shard`) mesh: HSDP. Shard inside a group, replicate across
  groups, so the all-gathers and reduce-scatters stay in the high-bandwidth domain (a node) and only one
  gradient all-reduce per unit crosses the slow links.
- `apply_ddp` on a 1-D `dp_replicate` mesh: plain replication with gradient all-reduces overlapped
  with backward (DDP's bucketed reducer). Once TP has made parameters DTensors, and for pipeline
  stages, replication is `apply_fsdp` on a (dp_replicate, dp_shard) mesh whose shard group is one
  rank: FSDP2's per-unit all-reduce across replicas, issued from each unit's post-backward hook.

Every rank must start from bit-identical weights (same seed, or a seed checkpoint): none of these
broadcast a reference copy, they only slice (FSDP) or check (DDP) what is there.

`clip_grad_norm_` and `dp_loss_average` are the two small reductions a training step needs on top.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from depthscale.model.transformer import Transformer
from depthscale.observe import spans

# ---------------------------------------------------------------------------------------------
# FSDP2 / HSDP

# FSDP2 warns, once per rank, when a unit returns a view: an in-place op on it would bypass the
# unit's pre-backward hook. A block (or a pipeline stage) returns a DepthState whose tensors are
# two-phase reads' aliases (`model/attnres_ops.py`: views by design, so that one backward sums each
# source's gradients), and nothing writes into a depth state in place (`model/residual.py`: a
# read's result is in the state it returns, never a side effect; the pipeline runtime only sends
# and backpropagates a stage's outputs). The FSDP parity tests check the gradients.
warnings.filterwarnings(
    "ignore",
    message=r"FSDP2-wrapped module \(FSDP(TransformerBlock|PipelineStage)\) returned a view tensor",
    category=UserWarning,
)


def depth_query_params(model: nn.Module) -> list[nn.Parameter]:
    """The layers' AttnRes parameters (pseudo-queries, key-norm gains): FSDP leaves them out of the
    layer units, so every unit is exactly one layer.

    Why: with two-phase reads the first sublayer of a depth block stacks the queries of *all*
    sublayers of that block (`AttnResidual.group`), including those of later layers, whose units are
    still sharded then. Merging a depth block's layers into one unit would make the gathered
    parameters grow with the block size (2, 4, 10 layers for 16, 32, 80 layers in 8 blocks); the
    queries are 2·d numbers per sublayer, so they stay whole on every rank instead, and their
    gradients are averaged once per step (`average_replicated_grads`)."""
    layers = getattr(model, "layers", None)
    if layers is None:
        return []
    return [p for layer in layers.values() for res in layer.residuals() for p in res.parameters()]


def apply_fsdp(
    model: Transformer,
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    roots: list[nn.Module] | None = None,
    offload: bool = False,
    leave: list[nn.Parameter] | None = None,
    inner: Iterable[tuple[nn.Module, DeviceMesh, int]] = (),
) -> list[nn.Parameter]:
    """Shard `model` in place with FSDP2: each TransformerBlock is a unit, then the root, which keeps
    the tied embedding/head weight, the final norm and the output AttnRes query (one weight, so the
    root must own both of its uses). Returns the parameters left whole on every rank (the layers'
    AttnRes queries, see `depth_query_params`): the caller averages their gradients.

    `roots`: the modules whose `forward` is what actually runs, when that is not `model.forward`:
    under pipeline parallelism each stage (`PipelineStage`, which registers the modules it runs) is a
    root, as in torchtitan. Each root owns the parameters of its children outside the block units
    (embedding on the first stage; final norm, head and output query on the last).

    `dp_mesh` 1-D: ZeRO-3 over it. 2-D (dp_replicate, dp_shard): HSDP, placements (Replicate, Shard(0)).

    `inner`: (module, mesh, dim) units sharded first, each over its own mesh on `dim` — expert
    parallelism's experts, over the ranks holding the same experts (`ExpertGroups`); the layer
    units around them leave their parameters to them.

    Mixed precision: with `param_dtype=bfloat16` the all-gathered parameters and the compute are bf16
    while the sharded master weights and the optimizer stay fp32; gradients are reduced in
    `reduce_dtype` (fp32 by default: summing many bf16 shards loses bits).

    Communication overlap (MegaScale's recipe, expressed with FSDP2 hooks):
    - forward: each unit prefetches the next unit's all-gather as soon as its own parameters are
      ready, so the next block's gather runs while the current block computes;
    - backward: each unit prefetches the previous unit's all-gather the same way;
    - gradients: FSDP2 issues each unit's reduce-scatter (HSDP: reduce-scatter then all-reduce across
      replicas) from that unit's post-backward hook, i.e. as soon as the block's gradients are ready,
      while backward continues on the earlier blocks. Nothing extra is needed for that.

    `offload`: FSDP2's CPU offload — sharded parameters, their gradients and (so) the optimizer
    states stay in host memory (pinned when a GPU is present); each unit's shard is copied to the
    device just before its all-gather, gradients copied back after the reduce-scatter.

    `reshard_after_forward=False` keeps gathered block parameters until backward (ZeRO-2-like: one
    all-gather per step instead of two, at the memory cost of the unsharded weights). The root never
    reshards after forward: its weights are needed first in backward anyway.
    """
    policies = {
        "mesh": dp_mesh,
        # cast_forward_inputs=False: under autocast the depth state already holds the compute
        # dtype (Transformer.embed), and FSDP's cast would also turn the fp32 log-sum-exps a
        # two-phase read hands to the next layer (DepthState.inter) into bf16
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False
        ),
        "reshard_after_forward": reshard_after_forward,
    }
    if offload:
        policies["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    queries = depth_query_params(model)
    ignored = set(queries) | set(leave or [])  # `leave`: reduced by their owner (experts)
    for module, mesh, dim in inner:  # units of their own mesh, inside the layers' units
        fully_shard(
            module, **(policies | {"mesh": mesh}), shard_placement_fn=lambda p, d=dim: Shard(d)
        )
    layers = list(model.layers.values())
    for layer in layers:
        fully_shard(layer, ignored_params=ignored, **policies)
    for root in roots if roots is not None else [model]:
        fully_shard(root, ignored_params=ignored, **policies)
        _chain_prefetch(root, [layer for layer in layers if _contains(root, layer)])
    return queries


def _contains(root: nn.Module, module: nn.Module) -> bool:
    return any(m is module for m in root.modules())


def _chain_prefetch(root: nn.Module, blocks: list[nn.Module]) -> None:
    """Forward: root → first block → next ...; backward the reverse. Any member of a merged unit
    addresses its shared state. Chains stay inside one root: under pipeline parallelism the next
    stage on a rank runs other microbatches, so prefetching across stages would only hold memory."""
    if not blocks:
        return
    root.set_modules_to_forward_prefetch([blocks[0]])
    root.set_modules_to_backward_prefetch([blocks[-1]])
    for prev, nxt in zip(blocks, blocks[1:]):
        prev.set_modules_to_forward_prefetch([nxt])
        nxt.set_modules_to_backward_prefetch([prev])


# ---------------------------------------------------------------------------------------------
# Replicated data parallel


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh) -> list[nn.Parameter]:
    """Replicate `model`, whose parameters are plain tensors, over the 1-D `dp_mesh` with DDP's
    bucketed reducer: each bucket's gradient all-reduce starts as soon as all its gradients are in,
    while backward is still running. Returns the layers' AttnRes queries, which it leaves out (the
    caller averages their gradients).

    `torch.distributed._composable.replicate` installs the reducer on the module itself instead of
    wrapping it: parameter names and state-dict keys stay those of the plain model (no `module.`
    prefix to strip for checkpoints), the module keeps its own methods (`embed`/`head`), and the
    trainer calls the model as it is. Parameters stay plain tensors, identical on all replicas
    (so the optimizer can take torch's fused AdamW). The AttnRes queries are left out as FSDP leaves
    them out: they are the only parameters that may get no gradient (with the reference/efficient
    reads the first sublayer reads the embedding alone), so the reducer needs neither
    `find_unused_parameters` (a walk of the autograd graph every step) nor a static graph (which
    cannot skip a sync in its first iteration, so gradient accumulation could not defer the
    all-reduce).

    DTensor parameters (tensor parallelism) and pipeline stages take FSDP2 instead (`parallelize`):
    `apply_fsdp` on the (dp_replicate, dp_shard) mesh with a shard group of one, which replicates.
    DDP's reducer cannot hold DTensors, and it is prepared in the model's forward, which never runs
    under pipeline parallelism.
    """
    if dp_mesh.ndim != 1:
        raise ValueError(f"apply_ddp needs a 1-D dp_replicate mesh, got {dp_mesh.ndim}-D")
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError(
            "apply_ddp replicates plain parameters; for DTensor parameters (tensor parallelism) "
            "use apply_fsdp on a (dp_replicate, dp_shard) mesh whose dp_shard has size 1"
        )
    replicate = replicate_api()
    queries = depth_query_params(model)
    ignored = [
        m
        for m in model.modules()
        if any(p is q for p in m.parameters(recurse=False) for q in queries)
    ]
    replicate(model, process_group=dp_mesh.get_group(), ignored_modules=ignored)
    return queries


def replicate_api() -> Callable:
    """`torch.distributed._composable.replicate`: DDP's reducer installed on a module. The one
    private torch API data parallelism uses (torchtitan's DDP path uses it too), so this is the one
    place that imports it, and tests/unit/test_private_torch_apis.py pins the name, the arguments
    and the gradient-sync switch on every torch the suite runs on (2.11 on the GPU image, 2.13 in
    CI).

    Public alternatives, checked against torch 2.11 and 2.13: `DistributedDataParallel` wraps the
    module, and the reducer only runs when the wrapper's forward is what gets called (the trainer
    calls the model; a wrapper would also rename every parameter). `fully_shard` with a shard group
    of one (what DTensor parameters use, see `apply_ddp`) turns every parameter into a DTensor (no
    fused AdamW), copies each unit's parameters into a separate unsharded buffer for its forward and
    backward, and all-reduces per unit instead of per bucket. torch 2.12+ adds
    `fully_shard(..., dp_mesh_dims=DataParallelMeshDims(replicate=...))`, FSDP2's replicate-only
    mode, still with DTensor parameters and the same copies."""
    try:
        from torch.distributed._composable import replicate
    except ImportError as err:
        raise RuntimeError(
            f"torch {torch.__version__} lacks torch.distributed._composable.replicate, which "
            f"parallel.dp_replicate uses without dp_shard, tp or pp ({err}); supported: torch 2.11 "
            "to 2.13. Use parallel.dp_shard (FSDP2, public API) instead, or a supported torch"
        ) from err
    return replicate


@torch.no_grad()
def average_replicated_grads(params: list[nn.Parameter], group: dist.ProcessGroup) -> None:
    """Average the gradients of parameters every data-parallel rank holds whole (what FSDP left
    out) over `group`, in one all-reduce per dtype; once per step, after the last backward.
    Whether a parameter got a gradient is structural, the same on every rank of `group`."""
    if dist.get_world_size(group) == 1:
        return
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        with spans.collective("all_reduce", group, flat):
            dist.all_reduce(flat, group=group)
        flat /= dist.get_world_size(group)
        torch._foreach_copy_(
            grads, [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in grads]), grads)]
        )


# ---------------------------------------------------------------------------------------------
# Gradient clipping across meshes


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _mesh_key(g: Tensor) -> tuple:
    if isinstance(g, DTensor):
        return (id(g.device_mesh), tuple(g.placements))
    return ("local",)


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[Tensor] | Tensor,
    max_norm: float,
    foreach: bool | None = None,
    across: dist.ProcessGroup | None = None,
    norm_excludes: Iterable[Tensor] = (),
) -> Tensor:
    """Clip the global L2 norm of all gradients to `max_norm`; returns the norm before clipping as a
    plain fp32 scalar tensor, identical on every rank. `max_norm <= 0` only measures.

    `across`: a group whose ranks hold *different* parameters (pipeline stages); their squared norms
    are summed over it. `norm_excludes`: parameters to scale but leave out of the norm — a copy of a
    weight another rank counts already (the tied head on the last pipeline stage).
    See `grad_norm` for how sharded and replicated gradients are counted."""
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    skip = {id(p) for p in norm_excludes}
    total_norm = grad_norm([p for p in params if id(p) not in skip], foreach, across)
    grads = [p.grad for p in params if p.grad is not None]
    if max_norm > 0 and grads:
        coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        targets = [_local(g) for g in grads]  # scaling the shards scales the DTensors
        if foreach is not False:
            torch._foreach_mul_(targets, coef.to(targets[0].device))
        else:
            for t in targets:
                t.mul_(coef)
    return total_norm


def _norm_device(grads: list[Tensor], across: dist.ProcessGroup | None) -> torch.device:
    """Where the squared-norm sum lives: where `across`'s backend communicates when that is NCCL
    (a CUDA tensor, also for gradients offloaded to host memory or a stage without any), else with
    the gradients."""
    if across is not None and dist.get_backend(across) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if grads:
        return _local(grads[0]).device
    return torch.device("cpu")


@torch.no_grad()
def grad_norm(
    params: list[Tensor], foreach: bool | None = None, across: dist.ProcessGroup | None = None
) -> Tensor:
    """The global L2 norm of the gradients of `params`, an fp32 scalar identical on every rank.

    Works when gradients are DTensors on different meshes (2-D FSDP×TP weights next to 1-D FSDP ones)
    or plain tensors, where `torch.nn.utils.clip_grad_norm_` fails (it stacks per-parameter norms,
    which DTensor refuses across meshes). Per group of gradients with the same mesh and placements:
    sum the squares of the local shards, then all-reduce that sum over the mesh dimensions the group
    is *sharded* on (summing over a replicated dimension would count the same elements twice).
    Partial gradients (pending reductions) are reduced first. Plain tensors are taken as replicas
    (DDP gradients are identical everywhere after backward) and are not reduced. Groups are summed in
    parameter order, the same on every rank, so the result is bit-identical across ranks. With
    `across`, the squared norm is finally summed over that group (ranks holding different parameters:
    every rank must call this, even one without gradients).
    """
    grads = [p.grad for p in params if p.grad is not None]
    groups: dict[tuple, list[Tensor]] = {}
    for g in grads:
        groups.setdefault(_mesh_key(g), []).append(g)
    total = torch.zeros((), dtype=torch.float32, device=_norm_device(grads, across))
    for group in groups.values():
        first = group[0]
        if isinstance(first, DTensor) and any(p.is_partial() for p in first.placements):
            placements = [Replicate() if p.is_partial() else p for p in first.placements]
            group = [g.redistribute(first.device_mesh, placements) for g in group]
        shards = [_local(g) for g in group]
        if foreach is not False:
            norms = torch._foreach_norm(shards, 2.0)
        else:
            norms = [torch.linalg.vector_norm(t) for t in shards]
        sq = torch.stack([n.float() for n in norms]).square().sum()
        if isinstance(first, DTensor):
            mesh = first.device_mesh
            if mesh.device_type != sq.device.type:  # CPU-offloaded gradients, NCCL mesh
                sq = sq.to(mesh.device_type)
            for dim, placement in enumerate(first.placements):
                # "not replicated", not `is_shard()`: FSDP's (_StridedShard, Shard) placement of
                # FSDP×TP weights answers is_shard() == False in torch 2.13
                if not placement.is_replicate() and mesh.size(dim) > 1:
                    with spans.collective("all_reduce", mesh.get_group(dim), sq):
                        dist.all_reduce(sq, group=mesh.get_group(dim))
        total = total + sq.to(total.device)
    if across is not None:
        with spans.collective("all_reduce", across, total):
            dist.all_reduce(total, group=across)
    return total.sqrt()


# ---------------------------------------------------------------------------------------------
# Logging


def dp_loss_average(loss: Tensor, dp_group: dist.ProcessGroup | DeviceMesh | None) -> float:
    """The mean of the per-rank losses over `dp_group` (for logging: with equal-sized slices it is the
    global-batch loss). No group, or no process group at all: this rank's loss."""
    value = loss.detach()
    if isinstance(value, DTensor):
        value = value.full_tensor()
    value = value.float().reshape(()).clone()
    if dp_group is None or not dist.is_initialized():
        return value.item()
    group = dp_group.get_group() if isinstance(dp_group, DeviceMesh) else dp_group
    with spans.collective("all_reduce", group, value):
        dist.all_reduce(value, group=group)
    return value.item() / dist.get_world_size(group)
