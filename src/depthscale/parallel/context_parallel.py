"""Context parallelism: the sequence is split over the `cp` ranks and attention runs as a ring.

Everything except attention is per token (norms, projections, MLP, AttnRes depth reads), so those
layers run unchanged on each rank's slice of the sequence. Attention needs every earlier key, so each
rank keeps its queries and the K/V blocks travel around a ring (Ring Attention, Liu et al. 2023):

    step t: rank r holds the K/V block of rank (r - t) mod cp; it posts the send of that block to
            r + 1 and the receive of the next one from r - 1, then attends its queries to the block
            it holds, while the next block is in flight.

Per-block results are merged by log-sum-exp in fp32 (online softmax), so the order of blocks does not
matter and the result is exact. Masks use the *global* positions of queries and keys, which is what
makes any layout work — contiguous, or zigzag (head-tail) for causal load balance.

Backward rotates K/V again (nothing remote is saved: every rank saves only its own q, k, v, out and
the fp32 LSE) and recomputes each block's probabilities from the saved LSE. dQ accumulates locally;
each block's dK/dV accumulate in **fp32** while travelling with the block, and reach the owner once,
so rounding does not grow with the ring size.

What is skipped (causal masking, sliding windows, padding) is planned in `ring_schedule.py` from every
rank's positions: derived from the declared sharding (`RingAttention(layout=...)`, what
`apply_context_parallel` installs for the trainer — one plan per shape for the whole run, no
communication), or gathered per call (`ring_attention`: one small all-gather of int64 positions,
never of K/V):

* **compute**: a (local queries, K/V block) pair is skipped when no key of the block is visible to
  any local query (causal: every key is later; window: every key is `window` or more positions away;
  padding keys are seen by nobody). Bidirectional attention (`causal=False`) skips only by window.
  Inside a computed pair only keys some local query sees are used, and each tile only with the
  query rows that see it — for zigzag that skips exactly the masked chunk pairs, on the diagonal
  block too. How a step is cut into tiles is the backend's `TilePolicy` (`ring_schedule.py`): on
  CUDA's flash op a step's keys go to one kernel call (zigzag's diagonal block is one causal call,
  every other block one unmasked call, a contiguous window's diagonal and halo one call each on
  flash's window arguments), so a step costs one call and one merge — on CPU's flash kernel too
  (without window arguments: band tiles there take a bias); the reference takes runs of at most
  `kv_tile` consecutive keys. Either way the rows that see every key form one tile
  and the others (the diagonal, a window's edge) another: the first needs no mask, the causal
  diagonal only the kernel's causal flag, and only window edges without window arguments an
  additive bias (built once per plan). Tiles run on fused kernels (`model/attention_tiles.py`),
  a step's compute is `ring_steps.py`.
* **communication**: block j is forwarded on hop t only if a rank t or more hops further still needs
  it, and then only the keys such a rank needs. A block nobody else needs is never sent; the ring
  stops early once no block has to go further. With `contiguous` sharding and a window no longer than
  a rank's chunk that is a single hop carrying the last `window - 1` keys of each block (a halo).
  Zigzag with a window needs a neighbour's tail that is cp - 1 hops away on this one-directional
  ring, so it keeps rotating (but only the tails): prefer contiguous sharding with sliding windows —
  a window already balances causal work.
* **backward**: the same rotations; the fp32 dK/dV of block j cover the keys any other rank needs and
  travel with it; the last rank that uses block j sends them straight to the owner (for the full
  ring that is the usual final hop to the next rank).

`RingStats` counts computed and skipped blocks, bytes and messages sent, and time blocked in waits.

Under torch.compile (`train.compile` compiles each block) `RingAttention`, what
`apply_context_parallel` installs, is left out of the graph (`torch.compiler.disable`): its
point-to-point batches, host-side plan and statistics are Python a graph cannot hold, and dynamo's
attempts to trace them cut one call into 17 graphs; so a compiled layer is two graphs, before and
after its ring call. (`ring_attention`, the by-hand call, is not wrapped.)

Layout, padding and the loss, by hand (the trainer's `ParallelPlan` does the same through
`SequenceShard` and `TokenLoss`; the layout functions live in `sequence_layout.py`)::

    tokens, labels = pad_for_cp(tokens, labels, cp, "zigzag", pad_id)   # labels of padding: -100
    tok = shard_sequence(tokens, cp_rank, cp, dim=1, mode="zigzag")
    lab = shard_sequence(labels, cp_rank, cp, dim=1, mode="zigzag")
    pos = positions_for(tokens.shape[1], cp_rank, cp, "zigzag")
    logits = model(tok, positions=pos)
    loss, global_loss = cp_loss(logits, lab, cp_group)   # see its docstring
    loss.backward()
    # gradients: averaged over cp — FSDP shards over dp_shard × cp (`parallelize`); by hand,
    # data_parallel.average_replicated_grads(list(model.parameters()), cp_group)

Padding goes at the end of the sequence, so causally no real token ever attends to it, and its
labels are ignored: results are exact. The padded length must fit `model.max_seq_len` (RoPE table).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from depthscale.model import attention_tiles
from depthscale.model.attention_dispatch import TilePolicy
from depthscale.model.documents import Documents
from depthscale.model.transformer import Transformer
from depthscale.parallel import p2p, ring_steps
from depthscale.parallel.cp_balance import LAYOUT_KEY, CpLayout
from depthscale.parallel.cp_comm import CommStats, Ring
from depthscale.parallel.loss import TokenLoss
from depthscale.parallel.ring_documents import step_tiles
from depthscale.parallel.ring_schedule import BOUNDED, CALLS, RingPlan, Span
from depthscale.parallel.sequence_layout import (
    ShardMode,
    _layout,
    pad_for_cp,
    positions_for,
    shard_sequence,
    unshard_sequence,
)

__all__ = [
    "RingStats",
    "apply_context_parallel",
    "cp_loss",
    "pad_for_cp",
    "positions_for",
    "ring_attention",
    "shard_sequence",
    "unshard_sequence",
]


# --------------------------------------------------------------------------- loss and gradients


def cp_loss(logits: Tensor, labels: Tensor, cp_group: ProcessGroup) -> tuple[Tensor, Tensor]:
    """(loss to backpropagate, global mean loss) for a rank holding a slice of every sequence; see
    `loss.TokenLoss` for why the backward loss is the local sum scaled by cp / (the group's tokens)."""
    return TokenLoss(sequence_group=cp_group)(logits, labels)


# --------------------------------------------------------------------------- ring statistics


@dataclass
class RingStats(CommStats):
    """Counters accumulated over ring-attention calls (forward and backward) on one rank."""

    channel = "cp"

    calls: int = 0
    blocks_computed: int = 0
    """(local queries, K/V block) pairs computed; one call has cp blocks per rank."""
    blocks_skipped: int = 0
    """Pairs skipped because no key of the block is visible to any local query."""
    ring_s: float = 0.0
    """Seconds inside the ring loops (compute + communication; on a GPU, the compute stream's:
    `settle()` first)."""

    def reset(self) -> None:
        for f in self.__dataclass_fields__:
            setattr(self, f, type(getattr(self, f))())

    @property
    def exposed_comm_fraction(self) -> float:
        """Share of ring time spent blocked in waits (0 = communication fully hidden)."""
        return self.wait_s / self.ring_s if self.ring_s else 0.0


# --------------------------------------------------------------------------- the ring


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: RingPlan, group, stats: RingStats, documents):
        with stats.timing("ring_s", q.device):
            call = next(CALLS)
            ring = Ring(group, stats, f"call {call} forward")
            n, (B, H, _, d), Hkv = plan.size, q.shape, k.shape[1]
            scale = 1.0 / math.sqrt(d)
            with torch.autocast(q.device.type, enabled=False):
                qg = q.unflatten(1, (Hkv, H // Hkv)).to(attention_tiles.tile_dtype(q))
                out = torch.zeros(qg.shape, dtype=torch.float32, device=q.device)
                lse = torch.full(qg.shape[:-1], float("-inf"), device=q.device)
                held = torch.stack([k, v])  # [2, B, Hkv, T, d]: the block this rank holds, as sent
                for step in range(n):
                    incoming = plan.incoming(step + 1, B, Hkv, d)
                    batch = ring.post(
                        _kv_send(plan, ring, held, step),
                        _kv_recv(plan, ring, incoming, step, k.dtype),
                        q.device,
                    )
                    tiles = step_tiles(plan, step, documents) if held is not None else []
                    stats.blocks_computed += bool(tiles)
                    stats.blocks_skipped += not tiles
                    ring_steps.forward_step(tiles, held, qg, out, lse, scale, fresh=step == 0)
                    held = _next_block(batch, plan, ring, step)
            y = out.flatten(1, 2).to(q.dtype)
            ctx.save_for_backward(q, k, v, y, lse)
            ctx.plan, ctx.group, ctx.stats, ctx.call = plan, group, stats, call
            ctx.documents = documents
            stats.calls += 1
        return y

    @staticmethod
    def backward(ctx, dy):
        """The forward's rotation again, plus the fp32 dK/dV travelling with each block.

        One group per step, posted by every rank in the same order: the K/V of the next hop (as in
        forward), the dK/dV the previous step added to its block — to the next holder or, from the
        block's last holder, home to its owner — and the receives of the same messages. A final
        group after the last step sends the last dK/dV home."""
        q, k, v, y, lse = ctx.saved_tensors
        plan, stats = ctx.plan, ctx.stats
        with stats.timing("ring_s", q.device):
            ring = Ring(ctx.group, stats, f"call {ctx.call} backward")
            n, rank, (B, H, _, d), Hkv = plan.size, plan.rank, q.shape, k.shape[1]
            scale = 1.0 / math.sqrt(d)
            with torch.autocast(q.device.type, enabled=False):
                dtype = attention_tiles.tile_dtype(q)
                qg = q.unflatten(1, (Hkv, H // Hkv)).to(dtype)
                do = dy.unflatten(1, (Hkv, H // Hkv)).to(dtype)
                yg = y.unflatten(1, (Hkv, H // Hkv)).to(dtype)
                dq = torch.zeros(qg.shape, dtype=torch.float32, device=q.device)
                dkv_own = torch.zeros((2, *k.shape), dtype=torch.float32, device=q.device)
                home = None  # the group receiving this block's dK/dV computed by the others
                # its last holder sends them in the group after its last step with the block
                home_step = plan.hops[rank] + 1 if plan.hops[rank] >= 1 else None
                held = torch.stack([k, v])
                passing: list[p2p.Send] = []  # the dK/dV the previous step computed, to go on
                for step in range(n + 1):
                    sends, recvs = [], []  # K/V first, then dK/dV, on both ends of every pair
                    if step < n:
                        sends += _kv_send(plan, ring, held, step)
                        recvs += _kv_recv(
                            plan, ring, plan.incoming(step + 1, B, Hkv, d), step, k.dtype
                        )
                    sends += passing
                    j = plan.owner(step)
                    if step >= 2 and plan.arrives(step):  # the earlier holders' share of block j
                        shape = (2, B, Hkv, plan.payload(j, 1).numel(), d)
                        recvs.append(
                            p2p.Recv(shape, torch.float32, ring.prev, ring.dkv_label(j, step))
                        )
                    if step == home_step:
                        last = (rank + plan.hops[rank]) % n
                        shape = (2, B, Hkv, plan.payload(rank, 1).numel(), d)
                        recvs.append(p2p.Recv(shape, torch.float32, last, ring.home_label(rank)))
                    group = ring.post(sends, recvs, q.device)
                    if step == home_step:
                        home = group
                    if step == n:
                        if group is not None:
                            group.wait_sends()
                        break
                    tiles = step_tiles(plan, step, ctx.documents) if held is not None else []
                    stats.blocks_computed += bool(tiles)
                    stats.blocks_skipped += not tiles
                    if step == 0:
                        dkv = dkv_own
                    elif held is not None:  # this rank's share of the remote block's dK/dV
                        shape = (2, B, Hkv, plan.payload(j, 1).numel(), d)
                        dkv = torch.zeros(shape, dtype=torch.float32, device=q.device)
                    ring_steps.backward_step(tiles, held, (qg, do, yg, lse), dq, dkv, scale)
                    passing = []
                    if step > 0 and held is not None:  # add the earlier holders' share, pass it on
                        if step >= 2:
                            dkv += group.recv(ring.dkv_label(j, step))
                        if plan.sends(step):
                            passing = [p2p.Send(dkv, ring.next, ring.dkv_label(j, step + 1))]
                        else:  # the last holder: straight back to the owner
                            passing = [p2p.Send(dkv, j, ring.home_label(j))]
                    held = _next_block(group, plan, ring, step)
                if home is not None:
                    home_dkv = home.recv(ring.home_label(rank))
                    plan.home_selection().add(dkv_own, home_dkv, 3)
        dk, dv = dkv_own.to(k.dtype).unbind(0)
        return dq.flatten(1, 2).to(q.dtype), dk, dv, None, None, None, None


def _kv_send(plan: RingPlan, ring: Ring, held: Tensor | None, step: int) -> list[p2p.Send]:
    """The held block's keys that travel on to hop step + 1 (none if nobody further needs them)."""
    if not plan.sends(step):
        return []
    block = plan.forward_selection(step).take(held, 3)
    return [p2p.Send(block, ring.next, ring.kv_label(plan.owner(step), step + 1))]


def _kv_recv(
    plan: RingPlan, ring: Ring, shape: tuple[int, ...] | None, step: int, dtype: torch.dtype
) -> list[p2p.Recv]:
    if shape is None:
        return []
    return [p2p.Recv(shape, dtype, ring.prev, ring.kv_label(plan.owner(step + 1), step + 1))]


def _next_block(batch: p2p.Batch | None, plan: RingPlan, ring: Ring, step: int) -> Tensor | None:
    """The block for step + 1, received, once the held block's send has gone (double buffering)."""
    if batch is None:
        return None
    block = None
    if plan.arrives(step + 1):
        block = batch.recv(ring.kv_label(plan.owner(step + 1), step + 1))
    batch.wait_sends()
    return block


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: Tensor | None,
    k_pos: Tensor | None,
    window: int,
    group: ProcessGroup,
    stats: RingStats | None = None,
    kv_tile: int = 512,
    causal: bool = True,
    seq_len: int | None = None,
    documents: Documents | None = None,
) -> Tensor:
    """Causal or bidirectional (optionally sliding-window, GQA) attention over a sequence sharded
    across `group`.

    q [B, H, T, hd] and k/v [B, Hkv, T, hd] are this rank's tokens, `q_pos` (== `k_pos`) [T] their
    global positions — any layout (see `shard_sequence`), equal length on every rank. Same contract
    as `sdpa_attention` on the full sequence; K/V travel at the KV head count (never expanded).
    Each tile (a whole step on the flash kernels, else at most `kv_tile` keys: `TilePolicy`) runs
    a fused attention kernel that returns its LSE
    (`model/attention_tiles.py`: on CPU torch's flash kernel in fp32; on CUDA SDPA's flash or
    memory-efficient op in the model's half dtype — no score matrix either way), else a reference
    that materialises the tile's fp32 scores. Merging and the dK/dV sums stay fp32.
    `seq_len`: the unpadded length — keys at positions >= seq_len are padding and seen by no query
    (needed when `causal=False` and the sequence was padded; causally padding at the end is never
    seen anyway). A query that sees no key at all gets a zero output (SDPA would give NaN).
    `documents`: the packed documents of the full rows (`model/documents.py`, looked up by the
    global positions; see `ring_documents.py`): no key is seen from another document.
    Builds the call's plan from all ranks' positions (one all-gather); `RingAttention` with a
    declared layout plans once per shape instead."""
    _check_positions(q, k, q_pos, k_pos)
    span = Span.of(window, causal, seq_len)
    plan = RingPlan.build(q_pos, span, kv_tile, group, attention_tiles.policy(q))
    stats = stats if stats is not None else RingStats()
    return _RingAttention.apply(q, k, v, plan, group, stats, documents)


def _check_positions(q: Tensor, k: Tensor, q_pos: Tensor | None, k_pos: Tensor | None) -> None:
    if q_pos is None or k_pos is None:
        raise ValueError(
            "ring attention needs the global positions of the local tokens: call "
            "model(tokens, positions=positions_for(seq_len, cp_rank, cp_size, mode))"
        )
    if k_pos is not q_pos and not torch.equal(q_pos, k_pos):
        raise ValueError(
            "ring attention is self-attention over the sharded sequence (q_pos == k_pos); "
            "KV-cache decoding is not context-parallel — generate with the single-process model"
        )
    if q_pos.dim() != 1 or q_pos.numel() != q.shape[2] or k.shape[2] != q.shape[2]:
        raise ValueError(
            f"positions {tuple(q_pos.shape)} must be 1-D with one entry per local token "
            f"(q has {q.shape[2]}, k has {k.shape[2]})"
        )


class RingAttention:
    """The attention function context parallelism installs in every layer (causal, optionally
    sliding-window): `ring_attention` over `group`.

    With a declared `layout` ('zigzag' or 'contiguous': how the caller shards every sequence) each
    rank derives every rank's positions from the local length alone, so a plan is built once per
    (length, window) and reused by every layer, micro-batch and step — no collective, no host copy,
    no per-layer CPU work. The positions passed in must then be `positions_for(T, rank, cp,
    layout)`; on CPU (where it costs no device sync) that is checked. Without a layout every call
    gathers the positions and plans afresh (any layout). 'documents': each micro-batch's layout
    is the one `SequenceShard` balanced over its documents and left in their cache (`cp_balance`;
    zigzag for a batch without documents), a plan per distinct layout."""

    def __init__(
        self,
        group: ProcessGroup,
        stats: RingStats | None = None,
        layout: ShardMode | Literal["documents"] | None = None,
        kv_tile: int = 512,
    ) -> None:
        if layout not in (None, "documents"):
            _layout(0, 1, layout)  # a known mode
        self.group, self.layout, self.kv_tile = group, layout, kv_tile
        self.stats = stats if stats is not None else RingStats()
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self._plans: dict[tuple, RingPlan] = {}
        # outside any compiled graph (see the module doc); wrapped here, not at import, because
        # torch.compiler.disable imports dynamo (and Triton), which a plain import must not
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

    def _attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        q_pos: Tensor | None,
        k_pos: Tensor | None,
        window: int,
        documents: Documents | None = None,
    ) -> Tensor:
        if self.layout is None:
            return ring_attention(
                q, k, v, q_pos, k_pos, window, self.group, self.stats, self.kv_tile,
                documents=documents,
            )  # fmt: skip
        _check_positions(q, k, q_pos, k_pos)
        balanced = self._balanced(documents)
        plan = self.plan(q.shape[2], window, q.device, attention_tiles.policy(q), balanced)
        if q_pos.device.type == "cpu" and not torch.equal(q_pos, plan.pos[self.rank]):
            raise ValueError(
                f"ring attention was set up for {self.layout} sharding: pass "
                f"positions_for(seq_len, cp_rank, cp_size, {self.layout!r}) as the positions"
            )
        return _RingAttention.apply(q, k, v, plan, self.group, self.stats, documents)

    def _balanced(self, documents: Documents | None) -> CpLayout | None:
        """The batch's balanced layout (layout 'documents' with documents), else None."""
        if self.layout != "documents" or documents is None:
            return None
        balanced = documents.cache.get(LAYOUT_KEY)
        if balanced is None:
            raise ValueError(
                "ring attention was set up for cp_balance='documents': shard the batch with "
                "SequenceShard (it leaves the layout in the documents' cache), or use 'zigzag'"
            )
        return balanced

    def plan(
        self,
        local_len: int,
        window: int,
        device: torch.device,
        policy: TilePolicy = BOUNDED,
        balanced: CpLayout | None = None,
    ) -> RingPlan:
        chunks = None if balanced is None else (balanced.chunks, balanced.n_chunks)
        key = (local_len, window, device, policy, chunks)
        if key not in self._plans:
            if len(self._plans) >= _PLANS_KEPT:  # balanced layouts differ per batch
                del self._plans[next(iter(self._plans))]
            seq_len = local_len * self.size
            mode = "zigzag" if self.layout == "documents" else self.layout
            pos = [
                positions_for(seq_len, r, self.size, mode)
                if balanced is None
                else balanced.positions(r, seq_len)
                for r in range(self.size)
            ]
            span = Span.of(window, True, None)
            self._plans[key] = RingPlan.of(pos, self.rank, span, self.kv_tile, device, policy)
        return self._plans[key]


_PLANS_KEPT = 64
"""Ring plans a `RingAttention` keeps; more than one per shape only under balanced layouts."""


def apply_context_parallel(
    model: Transformer,
    cp_mesh: DeviceMesh,
    stats: RingStats | None = None,
    layout: ShardMode | Literal["documents"] | None = None,
) -> None:
    """Route every layer's attention through ring attention on the (1-D) cp mesh's group.

    The caller shards tokens, labels and positions (`shard_sequence`, `positions_for`) and calls
    `model(tokens_local, positions=positions_local)`; everything else in the model is per token.
    `stats`, if given, accumulates the ring counters of all layers. `layout`: the sharding every
    call uses, which lets all layers share one plan (see `RingAttention`)."""
    fn = RingAttention(cp_mesh.get_group(), stats, layout)
    for layer in model.layers.values():
        layer.attention.attention_fn = fn
