"""The process mesh: pp × dp_replicate × dp_shard × cp × tp, validated against the world size and
built once as one named DeviceMesh (the degrees, their rules and the mesh shape: `shape/layout.py`).

Ordering puts tp innermost (adjacent ranks, the fastest links: TP stays inside a node), then cp, then
the data-parallel dimensions, and pp outermost, as Megatron and MegaScale do.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from depthscale.config import ParallelConfig
from depthscale.parallel import startup
from depthscale.shape import MESH_DIMS, Degrees

DIM_NAMES = MESH_DIMS


@dataclass(frozen=True)
class ParallelDims(Degrees):
    """The degrees (`shape.Degrees`: their rules, coordinates and mesh shapes) and the one
    thing shape/ cannot do: build the mesh."""

    @classmethod
    def from_config(cls, cfg: ParallelConfig) -> ParallelDims:
        return cls.of(cfg)

    def validate(self, world_size: int) -> ParallelDims:
        self.check(world_size)
        return self

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The named mesh, plus two flattened dimensions: `dp_shard_cp` (dp_shard × cp), FSDP's
        shard dimension (cp ranks hold the same parameters; see `parallelize`), and `dp_cp`
        (dp_replicate × dp_shard × cp), every rank holding the same parameters.

        Each rank creates only its own group of each dimension (`startup.own_group`: no barrier
        over the world, and no call per group of the world); NCCL with a bound device makes each
        dimension's groups with one communicator split (`split_group`), whatever its number of
        parts. The dimensions of size 1 share one group of the rank alone (one split, one
        communicator, whatever their number). The flattened dimensions are torch's (gloo: one `new_group` per group on every
        rank, with no barrier unless TORCH_DIST_INIT_BARRIER=1; NCCL: one split) — made only
        where two of its dimensions exceed 1: otherwise its groups are those of one named
        dimension, which stands in for it (`flat`), and start-up enters no group beyond its own
        whatever the number of pipelines."""
        shape = self.mesh_shape
        ranks = torch.arange(self.world_size).reshape(shape)
        groups, alone = [], None
        for d, name in enumerate(DIM_NAMES):
            if shape[d] == 1 and self.world_size > 1:
                # every dimension of size 1 shares one group of this rank alone: one split (one
                # communicator) for all of them, not one each — nothing travels on it
                if alone is None:
                    alone = startup.own_group([[r] for r in range(self.world_size)], "mesh_1")
                groups.append(alone)
            else:
                groups.append(_dim_group(ranks, d, name))
        mesh = DeviceMesh.from_group(groups, device_type, ranks, mesh_dim_names=DIM_NAMES)
        flattened = {}
        for name, parts in FLATTENED.items():
            if flat_name(mesh, name) == name:
                flattened[name] = mesh[parts]._flatten(name)
                if startup.group_timeout is not None:  # torch makes it with its default
                    from torch.distributed import distributed_c10d

                    group = flattened[name].get_group()
                    distributed_c10d._set_pg_timeout(startup.group_timeout, group)
        # torch deprecates slicing a flattened dimension from the root mesh: callers keep the
        # flattened meshes themselves (`flat`, `dp_mesh`)
        setattr(mesh, _FLAT_ATTR, flattened)
        return mesh


FLATTENED = {"dp_shard_cp": ("dp_shard", "cp"), "dp_cp": ("dp_replicate", "dp_shard", "cp")}
"""The flattened mesh dimensions and the named ones they span."""


def flat_name(mesh: DeviceMesh, name: str) -> str:
    """The dimension of `mesh` that holds the groups of `name`: `name` itself when it is a named
    dimension or spans two dimensions larger than 1, else the one of its dimensions that is larger
    than 1 (its last one, all being 1)."""
    parts = FLATTENED.get(name)
    if parts is None:
        return name
    names = mesh.mesh_dim_names or ()
    larger = [p for p in parts if mesh.size(names.index(p)) > 1]
    return name if len(larger) > 1 else (larger[0] if larger else parts[-1])


_FLAT_ATTR = "_depthscale_flattened"
"""The attribute of a mesh made by `build_mesh` holding its flattened dimensions' meshes."""


def flat(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """`mesh[name]`, for named and flattened dimensions alike (see `flat_name`); a flattened one
    is the mesh `_flatten` returned, never sliced from the root (which torch deprecates, with a
    warning on every rank)."""
    flattened = getattr(mesh, _FLAT_ATTR, {})
    name = flat_name(mesh, name)
    return flattened[name] if name in flattened else mesh[name]


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 2-D (dp_replicate, dp_shard × cp) mesh of HSDP: replicas over dp_replicate, shards over
    the rest. A flattened shard dimension is joined to dp_replicate (`DeviceMesh._concatenate`:
    the same root, their own groups, none new), not sliced from the root (deprecated)."""
    name = flat_name(mesh, "dp_shard_cp")
    flattened = getattr(mesh, _FLAT_ATTR, {})
    if name in flattened:
        return DeviceMesh._concatenate([mesh["dp_replicate"], flattened[name]])
    return mesh[("dp_replicate", name)]


_CP_ATTR = "_depthscale_cp_groups"
"""The attribute of a mesh holding its Ulysses/ring split of cp, per Ulysses degree."""


def cp_groups(
    mesh: DeviceMesh, ulysses: int
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(Ulysses group, ring group) of this rank for `parallel.cp_ulysses` = `ulysses`: each cp
    group cut into Ulysses groups of `ulysses` consecutive cp ranks, and rings across them (the
    members at the same place in every Ulysses group). A split of size 1 is None (nothing travels
    on it); one of the cp group's own size is the cp group, so only the hybrid (1 < ulysses < cp)
    makes groups, two per rank, once per mesh (every rank calls this, as for the dimensions)."""
    cp_group = mesh["cp"].get_group()
    cp = mesh["cp"].size()
    if ulysses == 1:
        return None, cp_group
    if ulysses == cp:
        return cp_group, None
    made = getattr(mesh, _CP_ATTR, {})
    if ulysses not in made:
        dim = DIM_NAMES.index("cp")
        rows = mesh.mesh.movedim(dim, -1).reshape(-1, cp).tolist()
        inner = [row[i : i + ulysses] for row in rows for i in range(0, cp, ulysses)]
        across = [row[i::ulysses] for row in rows for i in range(ulysses)]
        made[ulysses] = (
            startup.own_group(inner, "mesh_cp_ulysses"),
            startup.own_group(across, "mesh_cp_ring"),
        )
        setattr(mesh, _CP_ATTR, made)
    return made[ulysses]


def _dim_group(ranks: torch.Tensor, dim: int, name: str) -> dist.ProcessGroup:
    """This rank's group along mesh dimension `dim` of `ranks`. A dimension spanning every rank
    gets a group of its own, not the world group (which torch's DeviceMesh would reuse): the world
    group keeps the start-up timeout until the first step, and gloo's point-to-point waits keep
    the timeout a group was made with, so a pipeline or ring on it would wait that long for a
    dead peer (`shorten_timeout`). NCCL (`startup.splits_from_world`) has no such wait: there the
    world group serves, as in torch's own mesh, rather than a second communicator (and its
    buffers) over the same ranks."""
    if ranks.shape[dim] == ranks.numel() and startup.splits_from_world():
        return dist.group.WORLD
    parts = ranks.movedim(dim, -1).reshape(-1, ranks.shape[dim]).tolist()
    group = startup.own_group(parts, f"mesh_{name}")
    assert group is not None  # the parts cover every rank
    return group


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


def init_distributed(
    device_type: str, timeout_s: float | None = None, setup_timeout_s: float | None = None
) -> DistEnv:
    """Join the process group: gloo on CPU, nccl on CUDA. `timeout_s`: how long a collective or
    message may wait for its peers before it raises (torch's default when None), for every group
    made from now on; `setup_timeout_s` (default `timeout_s`): the same for the world group and
    the store until `shorten_timeout` — start-up's long waits (a node's tokenisation, checkpoint
    load) are on those two only.

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
    # the store's own timeout bounds every wait on a key (a node's ranks waiting for its data,
    # `startup.leader_first`): the groups' timeout, not TCPStore's default of 5 minutes
    setup_timeout_s = setup_timeout_s if setup_timeout_s is not None else timeout_s
    store_timeout = (
        {"timeout": datetime.timedelta(seconds=setup_timeout_s)} if setup_timeout_s else {}
    )
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        env.world_size,
        is_master=not agent_store and env.rank == 0,
        **store_timeout,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"depthscale/attempt{attempt}", store)
    # NCCL: bind the group to this rank's GPU, so communicators are created eagerly (and subgroups
    # split from them) instead of lazily by whichever operation comes first — a group's first
    # batched P2P call would otherwise need every rank of the group (batch_isend_irecv's contract)
    device_id = torch.device("cuda", env.local_rank) if device_type == "cuda" else None
    dist.init_process_group(
        backend,
        store=store,
        rank=env.rank,
        world_size=env.world_size,
        device_id=device_id,
        **store_timeout,
    )
    if timeout_s is not None:
        set_group_timeout(datetime.timedelta(seconds=timeout_s))
    return env


def set_group_timeout(timeout: datetime.timedelta) -> None:
    """Make `timeout` that of every process group depthscale makes from now on.

    `init_process_group(timeout=)` sets the world group's only: other groups fall back to torch's
    defaults (30 min on gloo, 10 on NCCL), so a pipeline receive or an FSDP collective over a
    sub-group would wait half an hour for a dead peer. Every group is made with torch's public
    `timeout=` (`split_group`, `new_group`) from `startup.group_timeout`; torch's defaults are
    left alone."""
    startup.group_timeout = timeout


def shorten_timeout(timeout_s: float) -> None:
    """Switch the world group and the store from the start-up timeout (`parallel.setup_timeout_s`)
    to the steady-state one (`parallel.timeout_s`), which the other groups have had from the start.

    Start-up legitimately waits long, on those two: the store for a node's tokenisation, the world
    group around checkpoint load; once steps run, a peer silent that long is dead, and the sooner
    its group fails the sooner the run restarts. (A live group's new default reaches its
    collectives; gloo's point-to-point waits keep the timeout the group was made with, which is
    why the sub-groups, where pipeline messages go, are made with `timeout_s`.) `_set_pg_timeout`
    is private, pinned by tests/unit/test_private_torch_apis.py. No-op without a process group."""
    if not dist.is_initialized():
        return
    from torch.distributed import distributed_c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    distributed_c10d._set_pg_timeout(timeout, distributed_c10d._get_default_group())
    distributed_c10d._get_default_store().set_timeout(timeout)


def destroy_distributed() -> None:
    """Barrier first: tearing down gloo while a peer is still in a collective aborts that peer."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
