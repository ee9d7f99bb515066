"""The process mesh: pp × dp_replicate × dp_shard × cp × tp, validated against the world size and
built once as one named DeviceMesh.

Ordering puts tp innermost (adjacent ranks, the fastest links: TP stays inside a node), then cp, then
the data-parallel dimensions, and pp outermost, as Megatron and MegaScale do.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from depthscale.config import ParallelConfig
from depthscale.errors import ConfigError

DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1

    @classmethod
    def from_config(cls, cfg: ParallelConfig) -> ParallelDims:
        return cls(cfg.pp, cfg.dp_replicate, cfg.dp_shard, cfg.cp, cfg.tp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Ranks that see different samples of the global batch."""
        return self.dp_replicate * self.dp_shard

    def validate(self, world_size: int) -> ParallelDims:
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise ConfigError(f"parallel.{f.name}={getattr(self, f.name)} must be >= 1")
        if self.world_size != world_size:
            layout = " × ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))
            raise ConfigError(
                f"parallel layout {layout} needs {self.world_size} processes but the world "
                f"size is {world_size}; allowed: degrees whose product is {world_size}"
            )
        return self

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The named mesh, plus two flattened dimensions: `dp_shard_cp` (dp_shard × cp), FSDP's
        shard dimension (cp ranks hold the same parameters; see `parallelize`), and `dp_cp`
        (dp_replicate × dp_shard × cp), every rank holding the same parameters."""
        shape = tuple(getattr(self, name) for name in DIM_NAMES)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=DIM_NAMES)
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        return mesh


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def dist_env() -> DistEnv:
    """Rank, world size and local rank as torchrun sets them (a single process when unset)."""
    return DistEnv(
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
        int(os.environ.get("LOCAL_RANK", 0)),
    )


def init_distributed(device_type: str) -> DistEnv:
    """Join the process group: gloo on CPU, nccl on CUDA.

    The store gets a per-attempt prefix so that a torchrun restart (`--max-restarts`) never meets the
    previous attempt's gloo addresses in the agent's store (seen as 'connectFullMesh failed')."""
    env = dist_env()
    if dist.is_initialized() or env.world_size == 1:
        return env
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(env.local_rank)
    # Under torchrun the agent hosts the store; launched any other way, rank 0 hosts it.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        env.world_size,
        is_master=not agent_store and env.rank == 0,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"depthscale/attempt{attempt}", store)
    # NCCL: bind the group to this rank's GPU, so communicators are created eagerly (and subgroups
    # split from them) instead of lazily by whichever operation comes first — a group's first
    # batched P2P call would otherwise need every rank of the group (batch_isend_irecv's contract)
    device_id = torch.device("cuda", env.local_rank) if device_type == "cuda" else None
    dist.init_process_group(
        backend, store=store, rank=env.rank, world_size=env.world_size, device_id=device_id
    )
    return env


def destroy_distributed() -> None:
    """Barrier first: tearing down gloo while a peer is still in a collective aborts that peer."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
