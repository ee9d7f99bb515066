"""Apply a parallel layout to a model, in one place and in a fixed order (torchtitan's lesson):

0. pipeline split (which layers, embedding and head this rank keeps, as stages),
1. tensor + sequence parallel (shards weights along heads / hidden features on the `tp` mesh dim),
2. context parallel (attention becomes a ring over the `cp` group),
3. data parallel: FSDP2 over `dp_shard` (HSDP when `dp_replicate` > 1 too), or replicated DDP —
   with pipeline stages as the FSDP roots, since their forward is what runs.

The trainer builds the model on the meta device; after the split and the sharding each rank
materialises only its own shards and draws the values one process would (see `materialize`), so
every layout starts from the same weights and no rank ever holds the whole model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from depthscale.config import Config
from depthscale.errors import ConfigError
from depthscale.model.transformer import Transformer
from depthscale.observe import startup
from depthscale.parallel.cp_balance import Balancing
from depthscale.parallel.mesh import DistEnv, ParallelDims, dp_mesh, flat, init_distributed
from depthscale.parallel.step import ParallelPlan
from depthscale.shape import EXPERT_SHARD_DIM, ModelShape


def check_supported(dims: ParallelDims, virtual: int = 1) -> None:
    """Layouts this build can run; anything else fails here, before a process group starts."""
    if virtual > 1 and dims.pp == 1:
        raise ConfigError(f"parallel.pp_virtual={virtual} needs parallel.pp > 1")


def _check_stage_split(cfg: Config) -> None:
    """parallel.pp_ends_fewer_layers: >= 0, with a pipeline, and leaving no end stage negative."""
    from depthscale.parallel.pipeline.schedules import split_layers

    p, key = cfg.parallel, "parallel.pp_ends_fewer_layers"
    e = p.pp_ends_fewer_layers
    if e < 0:
        raise ConfigError(f"{key}={e} must be >= 0 (0: a balanced split)")
    stages = p.pp * p.pp_virtual
    if e and stages < 3:
        raise ConfigError(
            f"{key}={e} needs a middle stage to give the layers to: parallel.pp × pp_virtual >= 3 "
            f"(got {stages})"
        )
    if e:
        n = cfg.model.n_layers

        def fits(k: int) -> bool:
            try:
                split_layers(n, stages, k)
            except ValueError:
                return False
            return True

        if not fits(e):
            most = max(k for k in range(e) if fits(k))
            raise ConfigError(
                f"{key}={e}: {n} layers over {stages} pipeline stages cannot leave the end stages "
                f"{e} fewer than the others; allowed: 0..{most}"
            )


def check_layout(cfg: Config) -> None:
    """Every rule a worker would enforce for the layout in `cfg`, from the config alone, so the
    launching process reports a bad layout once, before any worker starts (pure: no process group)."""
    p = cfg.parallel
    dims = ParallelDims.from_config(p)
    check_supported(dims, p.pp_virtual)
    _check_stage_split(cfg)
    # cp: zigzag pads every sequence to a multiple of 2·cp (RoPE must cover it), then shards it
    padded = dims.padded_seq(cfg.data.seq_len)
    if padded > cfg.model.max_seq_len:
        raise ConfigError(
            f"parallel.cp={dims.cp} pads data.seq_len={cfg.data.seq_len} to {padded} (a "
            f"multiple of 2·cp), beyond model.max_seq_len={cfg.model.max_seq_len}; allowed: "
            f"a seq_len that is a multiple of {2 * dims.cp}, or a larger max_seq_len"
        )
    if dims.tp > 1:
        from depthscale.parallel.tensor_parallel import check_seq_len, check_tp_divides

        check_tp_divides(cfg.model, dims.tp)
        check_seq_len(padded // dims.cp, dims.tp, p.tp_overlap_chunks)
    if dims.pp > 1 and p.pp_virtual > 1 and cfg.grad_accum_steps % dims.pp:
        raise ConfigError(
            f"interleaved 1F1B (parallel.pp_virtual={p.pp_virtual}) needs the micro-batches per "
            f"step divisible by parallel.pp={dims.pp}, but train.batch_size={cfg.train.batch_size} "
            f"/ (data-parallel ranks {cfg.dp_degree} × micro-batch size {cfg.micro_batch_size}) = "
            f"{cfg.grad_accum_steps}; allowed: a batch size or train.micro_batch_size giving a "
            f"multiple of {dims.pp} micro-batches"
        )


@dataclass(frozen=True)
class Layout:
    """Where this process sits: its ranks, the layout's degrees, the mesh (None for one process),
    its device, and the slice of the global batch it trains on."""

    env: DistEnv
    dims: ParallelDims
    mesh: DeviceMesh | None
    device: torch.device
    dp_rank: int
    dp_size: int


def init_layout(cfg: Config, device: torch.device) -> Layout:
    """Join the process group (when launched with several processes), check the layout in `cfg`
    against the world size, and build the mesh (each marked as a start-up phase)."""
    startup.mark("imports")
    dims = ParallelDims.from_config(cfg.parallel)
    env = init_distributed(device.type, cfg.parallel.timeout_s, cfg.parallel.setup_timeout_s)
    startup.mark("process_group")
    dims.validate(env.world_size)
    check_layout(cfg)
    if device.type == "cuda":
        device = torch.device("cuda", env.local_rank)
    mesh = dims.build_mesh(device.type) if env.world_size > 1 else None
    startup.mark("mesh")
    return Layout(env, dims, mesh, device, *dp_rank_and_size(mesh, dims))


def dp_rank_and_size(mesh: DeviceMesh | None, dims: ParallelDims) -> tuple[int, int]:
    """Which slice of the global batch this rank trains on: ranks differing only in tp, cp or pp
    share one."""
    if mesh is None:
        return 0, 1
    rank = mesh.get_local_rank("dp_replicate") * dims.dp_shard + mesh.get_local_rank("dp_shard")
    return rank, dims.dp


def parallelize(
    model: Transformer,
    mesh: DeviceMesh | None,
    dims: ParallelDims,
    cfg: Config,
    device: torch.device | None = None,
) -> ParallelPlan:
    """Shard and wrap `model` in place for the layout `dims` on `mesh` (None: one process); returns
    the plan a training step follows. The pipeline split comes first: it decides which layers a
    rank keeps, and everything after applies to those.

    `model` may live on the meta device (what the trainer builds): the split, tensor parallelism
    and FSDP then only shape it, and each rank materialises just its own shards on `device` and
    draws their initial values (`Transformer.reset_parameters`: the same values one process draws).
    A model with real weights (tests' oracle) is sliced instead; both start from the same weights.
    """
    check_supported(dims, cfg.parallel.pp_virtual)
    dtype = torch.bfloat16 if cfg.train.dtype == "bfloat16" else torch.float32
    if mesh is None:
        materialize(model, device)
        return ParallelPlan(model, None, dims, [], cfg.grad_accum_steps, dtype)
    stages = []
    if dims.pp > 1:
        from depthscale.parallel.pipeline.stage import build_stages

        p = cfg.parallel
        stages = build_stages(
            model, mesh.get_local_rank("pp"), dims.pp, p.pp_virtual, p.pp_ends_fewer_layers
        )
    if dims.tp > 1:
        from depthscale.parallel.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, mesh["tp"], chunks=cfg.parallel.tp_overlap_chunks)
        for stage in stages:  # the embedding and head are new modules now
            stage.register_modules()
    experts, expert_units = _apply_experts(model, mesh, dims, cfg, device)
    _apply_context(model, mesh, dims, cfg)
    whole = _apply_data_parallel(
        model, mesh, dims, cfg, device, stages, experts, expert_units, dtype
    )
    return ParallelPlan(
        model,
        mesh,
        dims,
        stages,
        cfg.grad_accum_steps,
        dtype,
        defer_reduce_scatter=cfg.parallel.fsdp_defer_reduce_scatter,
        replicated=whole,
        tp_chunks=cfg.parallel.tp_overlap_chunks,
        experts=experts,
        balancing=Balancing(
            cfg.parallel.cp_balance, cfg.model.sliding_window, cfg.parallel.cp_balance_chunk
        ),
    )


def _apply_experts(model, mesh, dims: ParallelDims, cfg: Config, device):
    """Expert parallelism (experts split over ep ranks, FSDP over the expert mesh where there is
    one) and the MoE balance's reduction scope; returns the expert shards and FSDP's expert
    units."""
    experts, expert_units = None, []
    if cfg.parallel.ep > 1:
        from depthscale.parallel import expert_parallel as ep

        device_type = device.type if device is not None else mesh.device_type
        replicate = mesh["dp_replicate"].get_group() if dims.dp_replicate > 1 else None
        expert_groups = ep.expert_groups(dims, cfg.parallel.ep, device_type, replicate)
        names = ep.apply_expert_parallel(model, expert_groups)
        experts = ep.ExpertShards(names, expert_groups.replicas, cfg.parallel.ep)
        if expert_groups.fsdp_mesh is not None:  # FSDP shards them over the expert mesh
            mesh_e, dim = expert_groups.fsdp_mesh, EXPERT_SHARD_DIM
            expert_units = [(m, mesh_e, dim) for m in ep.expert_modules(model)]
    if ModelShape.from_config(cfg.model).moe:
        from depthscale.parallel.expert_parallel import apply_balance_scope

        apply_balance_scope(model, mesh, dims, cfg.model.moe_balance_scope)
    return experts, expert_units


def _apply_context(model, mesh, dims: ParallelDims, cfg: Config) -> None:
    """Context parallelism: Ulysses groups with the ring across, or the ring alone."""
    if dims.cp > 1 and cfg.parallel.cp_ulysses > 1:
        from depthscale.parallel.ulysses import apply_ulysses

        apply_ulysses(model, mesh, cfg.parallel.cp_ulysses)  # Ulysses groups, ring across
    elif dims.cp > 1:
        from depthscale.parallel.context_parallel import apply_context_parallel

        # as `SequenceShard` cuts: zigzag, or balanced over each batch's documents
        apply_context_parallel(model, mesh["cp"], layout=cfg.parallel.cp_balance)


def _apply_data_parallel(
    model, mesh, dims: ParallelDims, cfg: Config, device, stages, experts, expert_units, dtype
) -> list:
    """FSDP2 over dp_shard × cp (HSDP with replicas), or DDP for plain replicas; materialises
    the model's shards on `device`. Returns the names of what the replicas hold whole."""
    offload = cfg.train.offload_params
    sharded = dims.shard > 1
    # Plain replicas (no tp, no pipeline) take DDP's bucketed reducer (`apply_ddp`); everything
    # else FSDP2 — with a shard group of one (dp_replicate beside tp or pp) it replicates.
    plain_replicas = (
        not sharded
        and dims.tp == 1
        and not stages
        and cfg.parallel.grad_reduce_dtype == "float32"  # DDP's reducer sums in fp32
    )
    if sharded or (dims.dp_replicate > 1 and not plain_replicas):
        # cp ranks hold the same parameters and each sees part of every sequence: shard over
        # dp_shard × cp, as torchtitan does, so FSDP's reduce-scatter also averages over cp
        from depthscale.parallel.data_parallel import apply_fsdp

        shard = flat(mesh, "dp_shard_cp")
        reshard = cfg.parallel.fsdp_reshard_after_forward
        if reshard == "auto":  # a pipeline would gather every layer twice per micro-batch
            reshard = not stages
        for stage in stages:
            stage.keep_gathered = sharded and not reshard
        whole = apply_fsdp(
            model,
            dp_mesh(mesh) if dims.dp_replicate > 1 else shard,
            # replicas compute like DDP's: fp32 weights under autocast, and the unsharded copy kept
            # from forward to backward (re-copying it would save memory, not communication)
            param_dtype=dtype if sharded else torch.float32,
            reduce_dtype=getattr(torch, cfg.parallel.grad_reduce_dtype),
            reshard_after_forward=reshard and sharded,
            offload=offload,
            roots=stages or None,
            leave=_named(model, experts.names) if experts and not expert_units else None,
            inner=expert_units,
        )
        whole = _names(model, whole)
        materialize(model, device, params_on_host=offload)
    else:
        materialize(model, device)  # DDP checks replicas at construction: real weights first
        whole = []
        if dims.dp_replicate > 1:
            from depthscale.parallel.data_parallel import apply_ddp

            whole = _names(model, apply_ddp(model, mesh["dp_replicate"]))
    return whole


def _named(model: nn.Module, names: list[str]) -> list[nn.Parameter]:
    params = dict(model.named_parameters())
    return [params[n] for n in names]


def _names(model: nn.Module, params: list[nn.Parameter]) -> list[str]:
    """The names of `params` in `model` (materialising replaces the parameter objects)."""
    ids = {id(p) for p in params}
    return [name for name, p in model.named_parameters() if id(p) in ids]


def materialize(
    model: Transformer, device: torch.device | None, params_on_host: bool = False
) -> None:
    """Give a meta-device model (already split and sharded) real storage on `device` — its
    parameters in host memory when FSDP offloads them — and draw its initial values. A model with
    real weights is left as it is."""
    if not model.rope_cos.is_meta:
        return
    if device is None:
        raise ValueError("parallelize: a model on the meta device needs the device to build it on")
    # `to_empty` gives each module its own new tensor, so a weight two modules share (tied
    # embedding and head) would come out as two: remember the sharing and restore it
    shared = _shared_parameters(model)
    model.to_empty(device="cpu" if params_on_host else device)
    for module, name, owner, owner_name in shared:
        if getattr(module, name) is not getattr(owner, owner_name):
            setattr(module, name, getattr(owner, owner_name))
    if params_on_host:  # what FSDP does not offload is read by the computation, on the device
        model.rope_cos = torch.empty_like(model.rope_cos, device=device)
        model.rope_sin = torch.empty_like(model.rope_sin, device=device)
        for module in model.modules():
            for name, p in module.named_parameters(recurse=False):
                if not isinstance(p, DTensor):
                    setattr(module, name, nn.Parameter(torch.empty_like(p, device=device)))
    model.reset_parameters()


def _shared_parameters(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module, str]]:
    """(module, name, owner, owner's name) for every registration of a parameter that an earlier
    module (the owner) also holds."""
    owners: dict[int, tuple[nn.Module, str]] = {}
    shared = []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in owners:
                shared.append((module, name, *owners[id(p)]))
            else:
                owners[id(p)] = (module, name)
    return shared
