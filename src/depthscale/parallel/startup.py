"""Start-up without global synchronization: process groups built among their members only, ranks
that wait for one leader instead of for the whole world, and an instrument that counts what
start-up still synchronises.

MegaScale cut a 2,048-GPU job's initialisation from 1,047 s to under 5 s by removing the store
barrier over the whole world that `new_group` ran for every group (torch runs it when
TORCH_DIST_INIT_BARRIER=1, as it always did before 2.1). Here:

- `own_group(parts)`: each rank creates only the group it is in, with
  `use_local_synchronization=True` (its barrier, when torch runs one, spans the members). torch
  names such a group by hashing its ranks with the number of groups the rank has made so far, so
  every rank must have made as many groups as its future peers: each call makes exactly one group
  on every rank (a singleton for a rank in no part). A `dist.new_group` that leaves ranks out
  breaks that count for later calls; use `own_group`. NCCL with a bound device splits every group
  from the world communicator, which all ranks must enter: there all parts come from one
  `split_group` (one `ncclCommSplit` over the world, each rank passing its part's colour), not
  one `new_group` per part — each of those is a world-wide split of its own, so a mesh
  dimension of 512 parts cost 512 collectives over every rank.
- `leader_first(name, leader, work)`: the leader runs `work` and posts the outcome to the store;
  the others wait for that one key (not for each other), then run `work` themselves.
- `count_synchronizations()`: counts barriers, store barriers and group creations, for tests and
  benchmarks/startup.py.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import torch.distributed as dist
from torch.distributed import distributed_c10d

T = TypeVar("T")

_rounds: collections.Counter[str] = collections.Counter()

group_timeout: datetime.timedelta | None = None
"""The timeout of every group depthscale makes (`own_group`, and the gloo side groups), passed to
torch's public `timeout=`; `mesh.init_distributed` sets it from `parallel.timeout_s`. None:
torch's default (30 min on gloo, 10 on NCCL)."""


def splits_from_world() -> bool:
    """True where torch creates every subgroup by splitting the world's communicator (NCCL with a
    bound device): every rank must then enter every group's creation."""
    return dist.group.WORLD.bound_device_id is not None


def own_group(
    parts: list[list[int]], desc: str, backend: str | None = None
) -> dist.ProcessGroup | None:
    """This rank's group among the disjoint `parts` (global ranks), created by its members only;
    None for a rank in no part. Every rank calls it with the same `parts`, in the same order.
    `backend`: the world's when None; "gloo" for a host-side group beside an NCCL world (made
    with `new_group` by its members: only the device communicator splits)."""
    rank = dist.get_rank()
    if splits_from_world() and backend is None:
        # looked up at call time: `count_synchronizations` and tests replace it
        return distributed_c10d.split_group(
            split_ranks=parts, group_desc=desc, timeout=group_timeout
        )
    part = next((p for p in parts if rank in p), None)
    # a rank in no part still makes one group (of itself), so all ranks' group counts stay equal
    group = dist.new_group(
        part or [rank],
        timeout=group_timeout,
        backend=backend,
        use_local_synchronization=True,
        group_desc=desc,
    )
    return group if part is not None else None


def leader_first(name: str, leader: int, work: Callable[[], T]) -> T:
    """`work()` on every rank, the `leader` (global rank) first: the others start theirs once the
    leader's has returned. A leader that fails posts its error, so the others raise at once rather
    than time out. Every rank calls it with the same `name` the same number of times (the key of
    each call is numbered)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return work()
    _rounds[name] += 1
    key = f"depthscale/leader_first/{name}/{leader}/{_rounds[name]}"
    store = distributed_c10d._get_default_store()
    if dist.get_rank() == leader:
        try:
            result = work()
        except BaseException as err:
            store.set(key, f"failed: {err!r}"[:500])
            raise
        store.set(key, "ok")
        return result
    store.wait([key])  # the store's timeout is the world group's (parallel.timeout_s)
    outcome = store.get(key).decode()
    if outcome != "ok":
        raise RuntimeError(
            f"rank {leader} failed {name} before this rank could start it: {outcome}"
        )
    return work()


@dataclass
class SyncCounts:
    """What one rank did that synchronises with other ranks, counted by `count_synchronizations`."""

    world_size: int = 0
    barriers: int = 0
    """`dist.barrier` calls (any group)."""
    world_store_barriers: int = 0
    """Store barriers over every rank: `init_process_group`'s and each `new_group` that every rank
    enters (both only with TORCH_DIST_INIT_BARRIER=1)."""
    local_store_barriers: int = 0
    """Store barriers over a group's members only (`use_local_synchronization=True`)."""
    new_groups: list[tuple[list[int], bool]] = field(default_factory=list)
    """(ranks, local) for every group creation this rank entered; `local`: members only."""
    splits: int = 0
    """`split_group` calls: a collective over the parent group (NCCL's communicator split)."""

    @property
    def world_group_calls(self) -> int:
        """Group creations that every rank had to enter."""
        return sum(1 for _, local in self.new_groups if not local)

    def summary(self) -> dict[str, int]:
        return {
            "barriers": self.barriers,
            "world_store_barriers": self.world_store_barriers,
            "local_store_barriers": self.local_store_barriers,
            "new_groups_world": self.world_group_calls,
            "new_groups_local": len(self.new_groups) - self.world_group_calls,
            "splits": self.splits,
        }


@contextlib.contextmanager
def count_synchronizations() -> Iterator[SyncCounts]:
    """Count, in this process, the barriers and group creations torch runs inside the block
    (process-group init included when it happens inside). Patches torch's functions for the
    block's duration; the private ones are pinned by tests/unit/test_private_torch_apis.py."""
    counts = SyncCounts()
    c10d = distributed_c10d
    barrier, store_barrier = c10d.barrier, c10d._store_based_barrier
    new_group, split_group = c10d._new_group_with_tag, c10d.split_group
    from torch.distributed import device_mesh  # holds its own reference to split_group

    def counted_barrier(*args, **kwargs):
        counts.barriers += 1
        return barrier(*args, **kwargs)

    def counted_store_barrier(rank, store, group_name, rendezvous_count, *args, **kwargs):
        world = dist.get_world_size() if dist.is_initialized() else rendezvous_count
        if rendezvous_count == world:
            counts.world_store_barriers += 1
        else:
            counts.local_store_barriers += 1
        return store_barrier(rank, store, group_name, rendezvous_count, *args, **kwargs)

    def counted_new_group(ranks=None, *args, use_local_synchronization=False, **kwargs):
        members = list(ranks) if ranks is not None else list(range(dist.get_world_size()))
        counts.new_groups.append((members, use_local_synchronization))
        return new_group(
            ranks, *args, use_local_synchronization=use_local_synchronization, **kwargs
        )

    def counted_split(*args, **kwargs):
        counts.splits += 1
        return split_group(*args, **kwargs)

    patches = {
        "barrier": counted_barrier,
        "_store_based_barrier": counted_store_barrier,
        "_new_group_with_tag": counted_new_group,
        "split_group": counted_split,
    }
    originals = {name: getattr(c10d, name) for name in patches}
    for name, fn in patches.items():
        setattr(c10d, name, fn)
    dist.barrier = counted_barrier  # callers reach it as `dist.barrier`
    device_mesh.split_group = counted_split
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(c10d, name, fn)
        dist.barrier = barrier
        device_mesh.split_group = split_group
        counts.world_size = dist.get_world_size() if dist.is_initialized() else 1
