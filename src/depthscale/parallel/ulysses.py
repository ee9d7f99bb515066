"""Ulysses context parallelism, alone or inside the ring (hybrid, USP): all-to-alls that trade the
sequence shard for a head shard around attention.

The cp ranks form `parallel.cp_ulysses`-sized Ulysses groups of consecutive cp ranks (cp rank
c = ring rank · u + member); the groups are the ranks of a ring (`context_parallel.py`) over the
remaining cp / u. Before attention each member sends head group g of its q, k, v to member g and
receives, from every member, its tokens of head group `member`: afterwards it holds H / u heads
over the u members' tokens. Because the zigzag layout gives member i of group j the chunks
j·u + i and 2·cp − 1 − (j·u + i), the union of a group's chunks, in order, is exactly chunk j and
2·r − 1 − j of the sequence cut for a zigzag ring of r = cp / u ranks — `unshard_sequence` over the
members puts the gathered tokens in that order, and the tokens' positions travel with them:

* u = cp (pure Ulysses): the group holds the whole row, in order: attention is the model's own
  full-row attention (`sdpa_attention`: causal, sliding windows, packed documents with their
  whole rows — no tile planning), over the local heads;
* 1 < u < cp (hybrid): the ring over the ring group with the declared zigzag layout of r ranks, on
  the local heads — causal balance, windows, documents and the planning are the ring's own.

With packed documents the rows may be laid out by attention work instead (`cp_balance.py`): the
members' positions are then gathered once per micro-batch (kept in the documents' cache), the
gathered tokens sorted by position, and the hybrid's ring plans from them per call.

After attention one all-to-all sends each member's tokens of this head group back
(`shard_sequence`), and the output is [B, H, T_local, d] again. Both all-to-alls are
`expert_parallel.all_to_all` (an autograd Function whose backward is the transposed exchange).

GQA: member g needs the K/V heads its q heads read. When the KV head count is a multiple of u each
member gets Hkv / u of them; when it divides u (fewer KV heads than members), each KV head is
repeated u / Hkv times before the exchange (one per member that reads it), and autograd sums
their gradients back. `config/validation.py` refuses the other layouts before any group starts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from depthscale.model.documents import Documents
from depthscale.model.layers import sdpa_attention
from depthscale.model.transformer import Transformer
from depthscale.parallel.context_parallel import RingAttention, RingStats, ring_attention
from depthscale.parallel.expert_parallel import all_to_all
from depthscale.parallel.mesh import cp_groups
from depthscale.parallel.sequence_layout import positions_for, shard_sequence, unshard_sequence
from depthscale.parallel.tp_comm import all_gather_blocks
from depthscale.shape.ulysses import kv_heads_sent


class UlyssesAttention:
    """The attention function of a layer under Ulysses (or hybrid) context parallelism.

    `group`: this rank's Ulysses group (u ranks); `ring_group`: its ring across the groups (None:
    pure Ulysses); `cp_rank`, `cp`: where this rank sits in the whole cp group, whose sharding the
    caller makes (`SequenceShard`): zigzag (`positions_for(T·cp, cp_rank, cp, 'zigzag')`, checked
    on CPU), or with packed documents any layout, whose positions are gathered."""

    def __init__(
        self,
        group: ProcessGroup,
        ring_group: ProcessGroup | None,
        cp_rank: int,
        cp: int,
        stats: RingStats | None = None,
    ) -> None:
        self.group, self.cp_rank, self.cp = group, cp_rank, cp
        self.size = dist.get_world_size(group)
        if cp % self.size or cp_rank % self.size != dist.get_rank(group):
            raise ValueError(
                f"the Ulysses group of cp rank {cp_rank} must be the consecutive cp ranks of its "
                f"block of {self.size}; got member {dist.get_rank(group)} of cp={cp}"
            )
        self.ring = None
        if ring_group is not None:
            self.ring = RingAttention(ring_group, stats, layout="zigzag")
        # outside any compiled graph, as the ring (see context_parallel's module doc)
        self._attend = torch.compiler.disable(self._attend)

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        q_pos: Tensor | None,
        k_pos: Tensor | None,
        window: int,
        documents: Documents | None = None,
    ) -> Tensor:
        return self._attend(q, k, v, q_pos, k_pos, window, documents)

    def _attend(self, q, k, v, q_pos, k_pos, window, documents=None) -> Tensor:
        T, u = q.shape[2], self.size
        seq_len = T * self.cp
        if q_pos is None or (k_pos is not q_pos and not torch.equal(q_pos, k_pos)):
            raise ValueError(
                "Ulysses attention is self-attention over the sharded sequence: pass the global "
                "positions of the local tokens (positions_for(seq_len, cp_rank, cp_size, mode))"
            )
        order = None
        if documents is not None:  # the batch's own layout (`cp_balance`): its tokens' order
            order = self._order(q_pos, documents)
        elif q_pos.device.type == "cpu" and not torch.equal(
            q_pos, positions_for(seq_len, self.cp_rank, self.cp, "zigzag")
        ):
            raise ValueError(
                "Ulysses attention without packed documents takes zigzag sharding: pass "
                "positions_for(seq_len, cp_rank, cp_size, 'zigzag') as the positions"
            )
        H, Hkv = q.shape[1], k.shape[1]
        if H % u or (Hkv % u and u % Hkv):
            raise ValueError(
                f"Ulysses over {u} ranks splits the heads: {H} query heads and {Hkv} KV heads "
                f"per rank must be multiples of {u} (or the KV heads a divisor of it)"
            )
        sent = kv_heads_sent(Hkv, u)
        if sent != Hkv:  # fewer KV heads than members: one copy for each member reading it
            k = k.repeat_interleave(sent // Hkv, dim=1)
            v = v.repeat_interleave(sent // Hkv, dim=1)
        hq, hkv = H // u, k.shape[1] // u
        merged = _to_heads((q, k, v), u, self.group, None if order is None else order[0])
        q, k, v = merged.split((hq, hkv, hkv), dim=1)
        if self.ring is None:  # the whole row, in order
            y = sdpa_attention(q, k, v, None, None, window, documents)
        elif order is None:  # the ring's zigzag chunks of r = cp / u ranks
            r, ring_rank = self.cp // u, self.cp_rank // u
            pos = positions_for(seq_len, ring_rank, r, "zigzag", q.device)
            y = self.ring(q, k, v, pos, pos, window, documents)
        else:  # the group's tokens of a balanced layout: the ring plans for them per call
            ring = self.ring
            y = ring_attention(
                q, k, v, order[2], order[2], window, ring.group, ring.stats, ring.kv_tile,
                documents=documents,
            )  # fmt: skip
        return _to_sequence(y, u, self.group, None if order is None else order[1])

    def _order(self, q_pos: Tensor, documents: Documents) -> tuple[Tensor, Tensor, Tensor]:
        """(order, inverse, positions): the group's tokens, as the exchange delivers them (member
        by member), sorted by position, the inverse permutation, and the sorted positions. One
        all-gather of the members' positions per batch, kept in the documents' cache (every
        layer and backward reuse it)."""
        key = ("ulysses order", id(self))
        hit = documents.cache.get(key)
        if hit is None:
            gathered, _ = all_gather_blocks(q_pos, self.group)  # synchronous
            flat = gathered.flatten()
            order = flat.argsort()
            hit = (order, order.argsort(), flat[order])
            documents.cache[key] = hit
        return hit


def _to_heads(
    xs: tuple[Tensor, ...], u: int, group: ProcessGroup, order: Tensor | None = None
) -> Tensor:
    """Sequence-sharded [B, h·u, T, d] tensors → [B, Σh, u·T, d] in one all-to-all: head group g
    of each to member g, the members' tokens in sequence order — the group's zigzag chunks merged
    into the ring's (`unshard_sequence`), or, for another layout, sorted by `order`."""
    parts = torch.cat([x.unflatten(1, (u, -1)) for x in xs], 2).movedim(1, 0)  # [u, B, Σh, T, d]
    got = all_to_all(parts.contiguous(), [1] * u, [1] * u, group)
    if order is not None:
        return got.movedim(0, 2).flatten(2, 3).index_select(2, order)
    return unshard_sequence(list(got.unbind(0)), dim=2, mode="zigzag")


def _to_sequence(y: Tensor, u: int, group: ProcessGroup, inverse: Tensor | None = None) -> Tensor:
    """Inverse of `_to_heads` for the output: [B, h, u·T, d] → [B, h·u, T, d]."""
    if inverse is not None:
        parts = y.index_select(2, inverse).unflatten(2, (u, -1)).movedim(2, 0)
    else:
        parts = torch.stack([shard_sequence(y, i, u, 2, "zigzag") for i in range(u)])
    got = all_to_all(parts.contiguous(), [1] * u, [1] * u, group)
    return got.movedim(0, 1).flatten(1, 2)


def apply_ulysses(
    model: Transformer, mesh: DeviceMesh, ulysses: int, stats: RingStats | None = None
) -> None:
    """Route every layer's attention through `UlyssesAttention` over the root `mesh`'s cp
    dimension split into Ulysses groups of `ulysses` and rings across them (`mesh.cp_groups`);
    the caller shards every sequence zigzag over the whole cp group, as for the ring."""
    group, ring_group = cp_groups(mesh, ulysses)
    fn = UlyssesAttention(group, ring_group, mesh.get_local_rank("cp"), mesh["cp"].size(), stats)
    for layer in model.layers.values():
        layer.attention.attention_fn = fn
