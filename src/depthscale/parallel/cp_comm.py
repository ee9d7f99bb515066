"""The ring of context parallelism: each step's messages as one group, correct under NCCL.

Ring attention moves K/V blocks one hop per step: every rank sends to `next` (rank + 1) and receives
from `prev` (rank − 1). A step's sends and receives are posted together (`p2p.post`, one
`batch_isend_irecv` group) *before* the step's block is computed, so the transfer runs during the
compute, and the group is waited on when the next block is needed — which also frees the sent
buffer: double buffering, the block in use and the block arriving are the only two alive.

Messages carry no tags: NCCL pairs sends and receives between two ranks in posting order, so every
rank posts one group per ring step, all in step order, and inside a group the K/V before the dK/dV
before the dK/dV going home — the same order at both ends of every pair. Backward sends the dK/dV a
step computed in the next step's group (and the last ones in a final group after the ring). Each
message's `label` names it (call, direction, block, hop, kind) for `p2p.recording` and
`nccl_rules.replay`. Every message is one contiguous buffer (callers pack K and V together).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from depthscale.parallel import p2p

CommStats = p2p.Traffic
"""Counters of a ring: bytes and messages sent, seconds blocked, live send bytes and their peak."""


class Ring:
    """Send-to-next / receive-from-previous over `group` (ranks are group-local throughout)."""

    def __init__(
        self, group: ProcessGroup, stats: CommStats | None = None, name: str = "ring"
    ) -> None:
        self.name = name
        """Prefix of this ring's message labels, e.g. "call 7 backward": the same on every rank."""
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

    def kv_label(self, block: int, hop: int) -> str:
        return f"{self.name}: kv{block} hop{hop}"

    def dkv_label(self, block: int, hop: int) -> str:
        return f"{self.name}: dkv{block} hop{hop}"

    def home_label(self, block: int) -> str:
        return f"{self.name}: home{block}"
