"""Step metrics read without holding the host back.

Reading a device number (`.item()`, `float(t)`, `.tolist()`) waits for every kernel queued before
it: once per step, the CPU can never run ahead into the next step's launches. So a step leaves its
loss share and gradient norm on the device (`PendingMetrics.add`), and they are reduced over ranks
and read together once per `logging.log_every` steps (`resolve`: one all-reduce, one read), as
torchtitan does.

What the ranks must agree on every step but lives on the host anyway — whether any rank received a
stop signal, and each rank's busy time per phase for the straggler detector — travels in a host
tensor over a gloo group, posted at the end of one step and read at the end of the next
(`HostVote`): the exchange overlaps a whole step, and every rank reads the same result at the same
step, so all still stop after the same step (one step later than the signal).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from depthscale.observe import spans


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


class HostVote:
    """Stop flags and busy rows agreed over the ranks one step late, never touching the device.

    `exchange(stop, busy)` posts this step's values and returns the previous step's agreement:
    (any rank asked to stop, every rank's busy row). The first call returns (False, None). One
    process has nothing to agree on: its stop is returned at once."""

    def __init__(self, world: int, rank: int) -> None:
        self.world, self.rank = world, rank
        self._group: dist.ProcessGroup | None = None
        if world > 1:
            # host tensors need a host backend; a gloo world group serves as it is
            gloo = dist.get_backend() == "gloo"
            self._group = dist.group.WORLD if gloo else dist.new_group(backend="gloo")
        self._posted: tuple[Any, Tensor, int] | None = None
        self._busy: list[float] | None = None

    def exchange(
        self, stop: bool, busy: list[float] | None
    ) -> tuple[bool, list[list[float]] | None]:
        if self.world == 1:  # nothing to agree: the stop at once, the rows a step late as below
            previous, self._busy = self._busy, busy
            return stop, [previous] if previous is not None else None
        previous = self._take()
        width = len(busy) if busy is not None else 0
        packed = torch.zeros(1 + self.world * width, dtype=torch.float64)
        packed[0] = float(stop)
        if busy is not None:
            packed[1 + self.rank * width : 1 + (self.rank + 1) * width] = torch.tensor(busy)
        work = dist.all_reduce(packed, group=self._group, async_op=True)
        self._posted = (work, packed, width)
        return previous

    def _take(self) -> tuple[bool, list[list[float]] | None]:
        if self._posted is None:
            return False, None
        work, packed, width = self._posted
        self._posted = None
        with spans.collective("all_reduce", self._group, packed):
            work.wait()
        values = packed.numpy()  # host memory: no device is waited for
        rows = None
        if width:
            rows = [values[1 + r * width : 1 + (r + 1) * width].tolist() for r in range(self.world)]
        return bool(values[0] > 0), rows

    def close(self) -> None:
        """Finish the posted exchange (every rank posts the same number)."""
        self._take()
