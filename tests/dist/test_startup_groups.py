"""Group creation where torch splits every group from the world's communicator (NCCL with a bound
device): each mesh dimension, and each `own_group`, is one `split_group` call — one collective over
the world — not one `new_group` per part, each of which would be a world-wide split of its own.

gloo cannot split, so the workers pretend (`splits_from_world` → True) and a recording stand-in
for `split_group` makes each rank's group the way the gloo path does; the groups are then used, so
a wrong split shows as a wrong sum. Counting goes through `count_synchronizations`, which sees
torch's group creations whoever calls them."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from depthscale.parallel import startup
from depthscale.parallel.mesh import DIM_NAMES, ParallelDims


def _split_like_nccl(layouts: list[dict], parts: list[list[int]]) -> dict:
    rank = dist.get_rank()
    make_group = distributed_c10d._new_group_with_tag  # the real one, before counting patches it
    splits: list[list[list[int]]] = []

    def split_group(parent_pg=None, split_ranks=None, timeout=None, pg_options=None, **kw):
        splits.append(split_ranks)
        mine = next((p for p in split_ranks if rank in p), None)
        group = make_group(mine or [rank], use_local_synchronization=True)
        return group if mine is not None else None

    real_splits, real_split = startup.splits_from_world, distributed_c10d.split_group
    startup.splits_from_world = lambda: True
    distributed_c10d.split_group = split_group
    out: dict = {"meshes": []}
    try:
        for layout in layouts:
            dims = ParallelDims(**layout)
            del splits[:]
            with startup.count_synchronizations() as counts:
                mesh = dims.build_mesh("cpu")
            sums = {}
            for name in DIM_NAMES:
                group = mesh.get_group(name)
                total = torch.tensor([float(rank)])
                dist.all_reduce(total, group=group)
                sums[name] = [sorted(dist.get_process_group_ranks(group)), total.item()]
            alone = [mesh.get_group(n).group_name for n in DIM_NAMES if mesh.size(
                DIM_NAMES.index(n)) == 1]  # fmt: skip
            out["meshes"].append(
                {"splits": len(splits), "new_groups": counts.new_groups, "sums": sums,
                 "world_groups": [n for n in DIM_NAMES if mesh.get_group(n) is dist.group.WORLD],
                 "alone": alone}
            )  # fmt: skip
        del splits[:]
        with startup.count_synchronizations() as counts:
            group = startup.own_group(parts, "tied_embedding")
        out["own_group"] = {
            "splits": len(splits),
            "new_groups": counts.new_groups,
            "ranks": None if group is None else sorted(dist.get_process_group_ranks(group)),
        }
    finally:
        startup.splits_from_world, distributed_c10d.split_group = real_splits, real_split
    return out


def _expected_ranks(dims: ParallelDims, rank: int, name: str) -> list[int]:
    """The ranks that share every mesh coordinate of `rank` but the one along `name`."""
    shape = [getattr(dims, n) for n in DIM_NAMES]
    grid = torch.arange(dims.world_size).reshape(shape)
    index = [int(i) for i in (grid == rank).nonzero()[0]]
    d = DIM_NAMES.index(name)
    index[d] = slice(None)
    return sorted(grid[tuple(index)].flatten().tolist())


def test_one_split_per_mesh_dimension_and_per_own_group(dist_pool):
    layouts = [{"dp_shard": 2, "tp": 2}, {"dp_shard": 4}]
    parts = [[0, 2], [1, 3]]
    results = dist_pool(4).run(_split_like_nccl, layouts, parts)
    for rank, out in enumerate(results):
        two_by_two, whole = out["meshes"]
        # five dimensions, three splits: none per part (the old loop made 4+4+2+4+2 new_groups),
        # and the three of size 1 share one (a communicator of this rank alone)
        assert (two_by_two["splits"], two_by_two["new_groups"]) == (3, []), rank
        assert two_by_two["world_groups"] == [], rank
        assert len(set(two_by_two["alone"])) == 1 and len(two_by_two["alone"]) == 3, rank
        # a dimension over every rank is the world group itself, as in torch's own mesh
        assert (whole["splits"], whole["new_groups"]) == (1, []), rank
        assert whole["world_groups"] == ["dp_shard"], rank
        for layout, mesh in zip(layouts, (two_by_two, whole)):
            dims = ParallelDims(**layout)
            for name in DIM_NAMES:
                members = _expected_ranks(dims, rank, name)
                assert mesh["sums"][name] == [members, float(sum(members))], (rank, name)
        assert out["own_group"] == {"splits": 1, "new_groups": [], "ranks": parts[rank % 2]}


def _clock_without_messages() -> dict:
    """`measure_offset` with every point-to-point call of torch.distributed refused."""
    import time

    from depthscale.parallel.clock_sync import measure_offset

    def refused(*args, **kwargs):
        raise AssertionError("clock sync sent a process-group message")

    names = ("isend", "irecv", "send", "recv", "batch_isend_irecv")
    real = {name: getattr(dist, name) for name in names}
    for name in names:
        setattr(dist, name, refused)
    try:  # every rank its own clock (as a drill's skew makes it): rank 0 measures all three
        return measure_offset(time.perf_counter_ns, torch.device("cpu"), dist.get_rank(), True)
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


def test_clock_sync_goes_through_the_store_not_point_to_point(dist_pool):
    """Under NCCL a first message between two ranks builds a communicator for the pair: rank 0
    measuring every node over P2P built one per node. One host, one clock: every offset's
    interval holds 0."""
    clocks = dist_pool(4).run(_clock_without_messages)
    assert clocks[0]["rtt_ns"] == 0
    for rank, clock in enumerate(clocks[1:], 1):
        assert clock["lo_ns"] <= 0 <= clock["hi_ns"], (rank, clock)
        assert 0 < clock["rtt_ns"] == clock["hi_ns"] - clock["lo_ns"], (rank, clock)


def _flattened_mesh(timeout_s: float) -> dict:
    """A dp_shard × cp mesh built with a group timeout: its flattened dimensions and the HSDP mesh
    as the trainer reaches them, every warning torch gives recorded."""
    import datetime
    import warnings

    from depthscale.parallel.mesh import dp_mesh, flat, set_group_timeout

    before = startup.group_timeout
    set_group_timeout(datetime.timedelta(seconds=timeout_s))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mesh = ParallelDims(dp_shard=2, cp=2).build_mesh("cpu")
            meshes = {n: flat(mesh, n) for n in ("dp_shard_cp", "dp_cp", "cp", "dp_shard")}
            hsdp = dp_mesh(mesh)
    finally:
        startup.group_timeout = before
    sums = {}
    for name, sub in [*meshes.items(), ("hsdp_0", hsdp), ("hsdp_1", hsdp)]:
        group = sub.get_group(int(name[-1])) if name.startswith("hsdp") else sub.get_group()
        total = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(total, group=group)
        sums[name] = [sorted(dist.get_process_group_ranks(group)), total.item()]
    groups = {sub.get_group() for sub in meshes.values()} | {mesh.get_group(n) for n in DIM_NAMES}
    timeouts = {
        g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        for g in groups
        if g is not dist.group.WORLD
    }
    return {"warnings": [str(w.message) for w in caught], "sums": sums, "timeouts": timeouts}


def test_flattened_dimensions_without_deprecated_slicing_and_with_the_group_timeout(dist_pool):
    """#50: torch warned 'Slicing a flattened dim from root mesh will be deprecated' on every
    rank of every run with cp beside data parallelism; the flattened meshes are now kept, and
    HSDP's 2-D mesh joined from its two 1-D ones. Every group, the torch-made flattened ones too,
    has the run's timeout through the public `timeout=` (not torch's patched default)."""
    results = dist_pool(4).run(_flattened_mesh, 123.0)
    for rank, out in enumerate(results):
        assert out["warnings"] == [], (rank, out["warnings"])
        assert out["timeouts"] == {123.0}, rank
        cp_pair = [rank - rank % 2, rank - rank % 2 + 1]  # cp is the inner dimension
        everyone = [[0, 1, 2, 3], 6.0]
        assert out["sums"]["dp_shard_cp"] == everyone and out["sums"]["dp_cp"] == everyone
        assert out["sums"]["cp"] == [cp_pair, float(sum(cp_pair))], rank
        assert out["sums"]["hsdp_0"] == [[rank], float(rank)]  # dp_replicate: 1
        assert out["sums"]["hsdp_1"] == everyone
