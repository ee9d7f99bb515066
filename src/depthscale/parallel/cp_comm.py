"""The ring of context parallelism: each step's messages as one group, correct under NCCL.

Ring attention moves K/V blocks one hop per step: every rank sends to `next` (rank + 1) and receives
from `prev` (rank − 1). A step's sends and receives are posted together (`p2p.post`, one
`batch_isend_irecv` group) *before* the step's block is computed, so the transfer runs during the
compute, and the group is waited on when the next block is needed — which also frees the sent
buffer: double buffering, the block in use and the block arriving are the only two alive.

Messages carry no tags: NCCL pairs sends and receives between two ranks in posting order, so every
rank posts its groups in the same global order — by ring step, and within a step first the groups
posted before the compute, then those posted after it — and each message's `label` names it (block,
hop, kind) for `p2p.recording` and `nccl_rules.replay`. Every message is one contiguous buffer
(callers pack K and V together).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from depthscale.parallel import p2p

CommStats = p2p.Traffic
"""Counters of a ring: bytes and messages sent, seconds blocked, live send bytes and their peak."""


def kv_label(block: int, hop: int) -> str:
    return f"kv{block} hop{hop}"


def dkv_label(block: int, hop: int) -> str:
    return f"dkv{block} hop{hop}"


def home_label(block: int) -> str:
    return f"home{block}"


class Ring:
    """Send-to-next / receive-from-previous over `group` (ranks are group-local throughout)."""

    def __init__(self, group: ProcessGroup, stats: CommStats | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.next = (self.rank + 1) % self.size
        self.prev = (self.rank - 1) % self.size
        self.stats = stats if stats is not None else CommStats()

    def post(
        self, sends: list[p2p.Send], recvs: list[p2p.Recv], device: torch.device
    ) -> p2p.Batch | None:
        """Post one group (None if there is nothing to send or receive)."""
        if not sends and not recvs:
            return None
        return p2p.post(self.group, sends, recvs, device, self.stats)

    def to(self, peer: int, tensor: Tensor, label: str) -> p2p.Send:
        return p2p.Send(tensor, peer, label)

    def from_prev(self, shape: tuple[int, ...], dtype: torch.dtype, label: str) -> p2p.Recv:
        return p2p.Recv(shape, dtype, self.prev, label)
