"""Point-to-point primitives for context parallelism: a ring over one process group.

Ring attention moves K/V blocks one hop per step: every rank sends to `next` (rank + 1) and receives
from `prev` (rank - 1). The next block is posted (`isend`/`irecv`) *before* the current one is
computed, so the transfer is in flight during the compute — double buffering: the block being used
and the block arriving are the only two alive. `Ring` also offers a direct send to any group rank
(ring attention's backward returns a block's dK/dV to its owner that way) and keeps the counters
the tests and benchmarks read: bytes sent, messages, and seconds spent blocked in `wait()`.

Every message is one contiguous buffer (callers pack K and V together), and every message carries a
tag that names its step and kind, so gloo — which matches messages by (source, tag) — can never pair a
receive with the wrong send when several are in flight between the same two ranks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup


@dataclass
class CommStats:
    """Counters of one `Ring` (or accumulated over many by the caller)."""

    bytes_sent: int = 0
    messages: int = 0
    wait_s: float = 0.0
    """Seconds blocked in `wait()` on receives and sends: communication not hidden by compute."""


class Pending:
    """A posted receive: `wait()` blocks until the buffer is filled and returns it."""

    def __init__(self, work: dist.Work | None, buf: Tensor, stats: CommStats) -> None:
        self._work, self._buf, self._stats = work, buf, stats

    def wait(self) -> Tensor:
        if self._work is not None:
            t0 = time.perf_counter()
            self._work.wait()
            self._stats.wait_s += time.perf_counter() - t0
            self._work = None
        return self._buf


class Ring:
    """Send-to-next / receive-from-previous over `group` (ranks are group-local throughout)."""

    def __init__(self, group: ProcessGroup, stats: CommStats | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.next = (self.rank + 1) % self.size
        self.prev = (self.rank - 1) % self.size
        self.stats = stats if stats is not None else CommStats()
        self._sends: list[tuple[dist.Work, Tensor]] = []

    def send(self, tensor: Tensor, peer: int, tag: int) -> None:
        """Non-blocking send of `tensor` (made contiguous; kept alive until `wait_sends`)."""
        buf = tensor.contiguous()
        work = dist.isend(buf, group=self.group, group_dst=peer, tag=tag)
        self._sends.append((work, buf))
        self.stats.bytes_sent += buf.numel() * buf.element_size()
        self.stats.messages += 1

    def recv(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, peer: int, tag: int
    ) -> Pending:
        """Post a receive into a fresh buffer; nothing blocks until `Pending.wait()`."""
        buf = torch.empty(shape, dtype=dtype, device=device)
        work = dist.irecv(buf, group=self.group, group_src=peer, tag=tag)
        return Pending(work, buf, self.stats)

    def send_next(self, tensor: Tensor, tag: int) -> None:
        self.send(tensor, self.next, tag)

    def recv_prev(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, tag: int
    ) -> Pending:
        return self.recv(shape, dtype, device, self.prev, tag)

    def shift(
        self,
        send: Tensor | None,
        recv_shape: tuple[int, ...] | None,
        dtype: torch.dtype,
        device: torch.device,
        tag: int,
    ) -> Pending | None:
        """One ring step, double-buffered: post the send of the current block to `next` and the
        receive of the next block from `prev` (either may be None: nothing to pass on / nothing
        coming), and return at once; compute on the current block, then `wait()` for the next."""
        if send is not None:
            self.send_next(send, tag)
        if recv_shape is None:
            return None
        return self.recv_prev(recv_shape, dtype, device, tag)

    def wait_sends(self) -> None:
        """Complete every outstanding send (their buffers may be freed afterwards); time spent here
        counts as blocked too."""
        t0 = time.perf_counter()
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        self.stats.wait_s += time.perf_counter() - t0
