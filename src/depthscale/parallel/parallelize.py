"""Apply a parallel layout to a model, in one place and in a fixed order (torchtitan's lesson):

0. pipeline split (which layers, embedding and head this rank keeps, as stages),
1. tensor + sequence parallel (shards weights along heads / hidden features on the `tp` mesh dim),
2. context parallel (attention becomes a ring over the `cp` group),
3. data parallel: FSDP2 over `dp_shard` (HSDP when `dp_replicate` > 1 too), or replicated DDP —
   with pipeline stages as the FSDP roots, since their forward is what runs.

Every rank builds the same single-process model from the same seed first, so every layout starts from
bit-identical weights; parallelizing only slices and wraps them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from depthscale.config import Config
from depthscale.errors import ConfigError
from depthscale.model.transformer import Transformer
from depthscale.parallel.mesh import DistEnv, ParallelDims, init_distributed
from depthscale.parallel.plan import ParallelPlan


def check_supported(dims: ParallelDims, virtual: int = 1) -> None:
    """Layouts this build can run; anything else fails here, before a process group starts."""
    if virtual > 1 and dims.pp == 1:
        raise ConfigError(f"parallel.pp_virtual={virtual} needs parallel.pp > 1")


def check_layout(cfg: Config) -> None:
    """Every rule a worker would enforce for the layout in `cfg`, from the config alone, so the
    launching process reports a bad layout once, before any worker starts (pure: no process group)."""
    p = cfg.parallel
    dims = ParallelDims.from_config(p)
    check_supported(dims, p.pp_virtual)
    # cp: zigzag pads every sequence to a multiple of 2·cp (RoPE must cover it), then shards it
    padded = (
        -(-cfg.data.seq_len // (2 * dims.cp)) * 2 * dims.cp if dims.cp > 1 else cfg.data.seq_len
    )
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
    against the world size, and build the mesh."""
    dims = ParallelDims.from_config(cfg.parallel)
    env = init_distributed(device.type)
    dims.validate(env.world_size)
    check_layout(cfg)
    if device.type == "cuda":
        device = torch.device("cuda", env.local_rank)
    mesh = dims.build_mesh(device.type) if env.world_size > 1 else None
    return Layout(env, dims, mesh, device, *dp_rank_and_size(mesh, dims))


def dp_rank_and_size(mesh: DeviceMesh | None, dims: ParallelDims) -> tuple[int, int]:
    """Which slice of the global batch this rank trains on: ranks differing only in tp, cp or pp
    share one."""
    if mesh is None:
        return 0, 1
    rank = mesh.get_local_rank("dp_replicate") * dims.dp_shard + mesh.get_local_rank("dp_shard")
    return rank, dims.dp


def parallelize(
    model: Transformer, mesh: DeviceMesh | None, dims: ParallelDims, cfg: Config
) -> ParallelPlan:
    """Shard and wrap `model` in place for the layout `dims` on `mesh` (None: one process, nothing
    to do); returns the plan a training step follows. The pipeline split comes first: it decides
    which layers a rank keeps, and everything after applies to those."""
    check_supported(dims, cfg.parallel.pp_virtual)
    dtype = torch.bfloat16 if cfg.train.dtype == "bfloat16" else torch.float32
    if mesh is None:
        return ParallelPlan(model, None, dims, [], cfg.grad_accum_steps, dtype)
    stages = []
    if dims.pp > 1:
        from depthscale.parallel.pipeline.stage import build_stages

        stages = build_stages(model, mesh.get_local_rank("pp"), dims.pp, cfg.parallel.pp_virtual)
    if dims.tp > 1:
        from depthscale.parallel.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, mesh["tp"], chunks=cfg.parallel.tp_overlap_chunks)
        for stage in stages:  # the embedding and head are new modules now
            stage.register_modules()
    if dims.cp > 1:
        from depthscale.parallel.context_parallel import apply_context_parallel

        apply_context_parallel(model, mesh["cp"], layout="zigzag")  # as `SequenceShard` cuts
    if dims.dp_shard > 1:
        from depthscale.parallel.data_parallel import apply_fsdp

        dp_mesh = mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]
        apply_fsdp(
            model,
            dp_mesh,
            param_dtype=dtype,
            reduce_dtype=torch.float32,
            reshard_after_forward=cfg.parallel.fsdp_reshard_after_forward,
            offload=cfg.train.offload_params,
            roots=stages or None,
        )
    elif dims.dp_replicate > 1:
        from depthscale.parallel.data_parallel import apply_ddp

        apply_ddp(model, mesh["dp_replicate"], roots=stages or None)
    return ParallelPlan(model, mesh, dims, stages, cfg.grad_accum_steps, dtype)
