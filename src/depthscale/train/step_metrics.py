"""Step metrics read without holding the host back.

Reading a device number (`.item()`, `float(t)`, `.tolist()`) waits for every kernel queued before
it: once per step, the CPU can never run ahead into the next step's launches. So a step leaves its
loss share and gradient norm on the device (`PendingMetrics.add`), and they are reduced over ranks
and read together once per `logging.log_every` steps (`resolve`: one all-reduce, one read), as
torchtitan does.

What the ranks must agree on every step but lives on the host anyway — whether any rank received a
stop signal, and each rank's busy time per phase for the straggler detector — travels in a host
tensor over gloo, posted at the end of one step and read at the end of the next (`HostVote`): the
exchange overlaps a whole step, and every rank reads the same result at the same step, so all still
stop after the same step (one step later than the signal).

Across nodes it goes in two levels, never over a gloo group spanning the world (whose creation
connects every rank to every other: ~N² connections, and whose collectives take O(N) hops): within
each node (a gloo group of its ranks), then among the nodes' first ranks (one per node), then back
within each node — the three collectives run one after the other in a thread of their own, so the
exchange still overlaps the step.

The stop flag is one number a step, whatever the world size. The busy rows are world × phases
numbers, too many to send every step at scale: every `gather_every(world)` steps each rank sends the
median of its own rows over those steps (per phase), and all ranks gather them — every step below
`ROWS_PER_STEP` ranks, as before; at 512 ranks every 8th — so straggler detection costs at most
`ROWS_PER_STEP` rows a step, amortised, however many ranks train. The detector then judges one
row per rank per gather (medians, as it judges them; `observe/stragglers.py`), still a step late.
"""

from __future__ import annotations

import math
import os
import statistics
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from depthscale.observe import spans
from depthscale.parallel import startup


class PendingMetrics:
    """Per-step metric dicts whose "loss" (this rank's share of the mean loss), "grad_norm" and
    "finite" (the NaN guard's flag; both the same on every rank) are device tensors until
    `resolve` turns them into floats (and a bool), in place."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._pending: list[dict[str, Any]] = []

    def add(self, metrics: dict[str, Any]) -> None:
        self._pending.append(metrics)

    def resolve(self) -> list[dict[str, Any]]:
        """Every pending step's loss (mean over ranks) and gradient norm as floats: one all-reduce
        and one device-to-host read for all of them. Every rank calls it at the same steps."""
        pending, self._pending = self._pending, []
        if not pending:
            return pending
        losses = torch.stack([m["loss"].detach().reshape(()) for m in pending]).double()
        if self.world > 1:
            with spans.collective("all_reduce", None, losses):
                dist.all_reduce(losses)
            losses = losses / self.world
        norms = torch.stack([m["grad_norm"].reshape(()).to(losses.device) for m in pending])
        finite = torch.stack([m["finite"].reshape(()).to(losses.device) for m in pending])
        values = torch.cat([losses, norms.double(), finite.double()]).tolist()
        n = len(pending)
        for i, m in enumerate(pending):
            m["loss"], m["grad_norm"] = values[i], values[n + i]
            m["finite"] = values[2 * n + i] > 0
        return pending


ROWS_PER_STEP = 64
"""Busy rows gathered per step, amortised: the bound on what straggler detection sends."""


def gather_every(world: int) -> int:
    """Steps between two gathers of every rank's busy rows: 1 up to ROWS_PER_STEP ranks, then as
    few as keep the rows per step at most ROWS_PER_STEP (8 at 512 ranks)."""
    return max(1, math.ceil(world / ROWS_PER_STEP))


def node_size(world: int) -> int:
    """Ranks per node as torchrun lays them out (LOCAL_WORLD_SIZE, global ranks contiguous per
    node); the whole world — one level — where that is unset or does not divide the world."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return local if 0 < local < world and world % local == 0 else world


class HostVote:
    """Stop flags and busy rows agreed over the ranks one step late, never touching the device.

    `exchange(stop, busy)` posts this step's values and returns the previous step's agreement:
    (any rank asked to stop, every rank's busy row — the median of its rows over the `every` steps
    up to the previous one — or None on the steps that end no gather). One process has nothing to
    agree on: its stop is returned at once. `every`: steps between gathers of the rows (default
    `gather_every(world)`); `group`: a group to agree over in one level (tests pass stand-ins);
    else per node and among the nodes (`node`: ranks per node, default `node_size(world)`), or
    over the world's gloo group (a gloo group of its own under NCCL) on one node."""

    def __init__(
        self,
        world: int,
        rank: int,
        every: int | None = None,
        group: dist.ProcessGroup | None = None,
        node: int | None = None,
    ) -> None:
        self.world, self.rank = world, rank
        self.every = every if every is not None else gather_every(world)
        self.node = node if node is not None else node_size(world)
        self._group = group
        self._levels: tuple[dist.ProcessGroup, dist.ProcessGroup | None] | None = None
        self._posted: tuple[Any, Tensor, list[Tensor], int] | None = None
        self._mine: list[list[float]] = []
        """This rank's rows since the last gather."""
        self._busy: list[float] | None = None

    @property
    def group(self) -> dist.ProcessGroup:
        """The one-level group: the world's when it is gloo, else a gloo group over it."""
        if self._group is None:
            gloo = dist.get_backend() == "gloo"
            self._group = (
                dist.group.WORLD
                if gloo
                else dist.new_group(backend="gloo", timeout=startup.group_timeout)
            )
        return self._group

    @property
    def two_levels(self) -> bool:
        return self._group is None and self.node < self.world

    def levels(self) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
        """(this node's gloo group, the gloo group of the nodes' first ranks — None on the other
        ranks), made by their members only, at the first exchange (every rank makes both)."""
        if self._levels is None:
            n = self.node
            nodes = [list(range(i, i + n)) for i in range(0, self.world, n)]
            node = startup.own_group(nodes, "host_vote_node", backend="gloo")
            leaders = startup.own_group([[p[0] for p in nodes]], "host_vote_leaders", "gloo")
            assert node is not None
            self._levels = (node, leaders)
        return self._levels

    def exchange(
        self, stop: bool, busy: list[float] | None
    ) -> tuple[bool, list[list[float]] | None]:
        if self.world == 1:  # nothing to agree: the stop at once, the rows a step late as below
            previous, self._busy = self._busy, busy
            return stop, [previous] if previous is not None else None
        previous = self._take()
        if busy is not None:
            self._mine.append(list(busy))
        if busy is not None and len(self._mine) == self.every:
            median = [statistics.median(phase) for phase in zip(*self._mine)]
            self._mine = []
            mine = torch.tensor([float(stop), *median], dtype=torch.float64)
            gathered = [torch.empty_like(mine) for _ in range(self.world)]
            self._posted = (self._post(mine, gathered), mine, gathered, len(median))
        else:
            flag = torch.tensor([float(stop)], dtype=torch.float64)
            self._posted = (self._post(flag, None), flag, [flag], 0)
        return previous

    def _post(self, mine: Tensor, gathered: list[Tensor] | None) -> Any:
        """Start the all-gather of `mine` into `gathered` (None: the sum of `mine` in place); a
        work to wait for."""
        if not self.two_levels:
            if gathered is None:
                return dist.all_reduce(mine, group=self.group, async_op=True)
            return dist.all_gather(gathered, mine, group=self.group, async_op=True)
        levels = self.levels()  # made here, on the caller's thread, in every rank's order
        return _Thread(lambda: _two_levels(mine, gathered, *levels))

    def _take(self) -> tuple[bool, list[list[float]] | None]:
        if self._posted is None:
            return False, None
        work, sent, out, width = self._posted
        self._posted = None
        group = self._levels[0] if self._levels is not None else self._group
        with spans.collective("all_gather" if width else "all_reduce", group, sent):
            work.wait()
        values = torch.stack(out).numpy()  # host memory: no device is waited for
        rows = values[:, 1:].tolist() if width else None
        return bool((values[:, 0] > 0).any()), rows

    def close(self) -> None:
        """Finish the posted exchange (every rank posts the same number)."""
        self._take()


def _two_levels(
    mine: Tensor,
    gathered: list[Tensor] | None,
    node: dist.ProcessGroup,
    leaders: dist.ProcessGroup | None,
) -> None:
    """The exchange in two levels, blocking (run on `_Thread`): within the node to its first rank,
    among the first ranks, back within the node. `gathered` None: `mine` becomes the world's sum."""
    if gathered is None:
        dist.all_reduce(mine, group=node)
        if leaders is not None:
            dist.all_reduce(mine, group=leaders)
        dist.broadcast(mine, group=node, group_src=0)
        return
    n, width = dist.get_world_size(node), mine.numel()
    block = torch.empty(n, width, dtype=mine.dtype)
    lead = leaders is not None
    dist.gather(mine, list(block) if lead else None, group=node, group_dst=0)
    world = torch.empty(len(gathered) // n, n, width, dtype=mine.dtype)
    if lead:
        dist.all_gather(list(world), block, group=leaders)
    dist.broadcast(world, group=node, group_src=0)
    for out, row in zip(gathered, world.reshape(-1, width)):
        out.copy_(row)


class _Thread:
    """`fn()` on a daemon thread of its own, with a work's `wait()` (its exception re-raised
    there). Daemon: a collective stuck on a dead peer must not hold the process at exit."""

    def __init__(self, fn) -> None:
        self._error: BaseException | None = None

        def run() -> None:
            try:
                fn()
            except BaseException as err:  # noqa: BLE001 - re-raised by wait()
                self._error = err

        self._thread = threading.Thread(target=run, name="host-vote", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error
