"""The plan of a ring-attention call: who sends which keys at which step, and what each rank
computes — identical on every rank, built from all ranks' token positions: derived from a declared
sequence layout (no communication; cached for the run), or gathered (one small all-gather per call).

`Span` says which keys a query sees (causal or bidirectional, sliding window, padding). `RingPlan`
derives from it, per block, which keys travel how many hops (`carry`, `hops`: a block nobody further
needs is never sent, the ring stops early) and, per step, the tiles of work, cut by the kernels'
`TilePolicy` (`model/attention_dispatch.py`, chosen per backend):

* bounded (the reference, CUDA's efficient op alone): runs of at most `kv_tile` consecutive
  visible keys, each with only the query rows that see it, split into the rows that see all of
  the run (no mask) and the rest;
* whole (CUDA's and CPU's flash kernels): a step's visible keys in one tile when its mask is none, top-left causal
  or (with flash's window arguments) a square band — zigzag's diagonal block is one causal tile,
  its two chunks ordered by position; else the rows that see every key in one unmasked tile and
  the rest as one causal or band tile where it is one, cut into bounded tiles only where a bias is
  needed. One kernel call and one merge per step in every causal and contiguous-window ring.

Every row of a tile sees a contiguous range of its keys (positions sorted on both sides), so its
mask kind follows from each row's first and last visible key (`_kind`), never from a [rows, keys]
matrix. `Index` selects along one dim, as a `narrow` view when the selection is contiguous.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from depthscale.model.attention_dispatch import TilePolicy
from depthscale.model.attention_tiles import TileMask, additive_bias, fused
from depthscale.model.layers import attention_mask
from depthscale.observe import spans

BOUNDED = TilePolicy()
"""The default policy: every tile at most `kv_tile` keys."""
CALLS = itertools.count()
"""Ring-attention calls made by this process; every rank of a cp group makes the same ones, so the
number names a call's messages identically at both ends."""


class Index:
    """A sorted subset of indices along one dim: a `narrow` view when contiguous, else gathered."""

    def __init__(self, idx: Tensor, length: int, device: torch.device) -> None:
        self.count = idx.numel()
        self.full = self.count == length
        lo = int(idx[0]) if self.count else 0
        self.span = (lo, self.count) if self.count and int(idx[-1]) - lo + 1 == self.count else None
        self.cpu_idx = idx
        self.idx = None if self.span is not None else idx.to(device)

    def take(self, x: Tensor, dim: int) -> Tensor:
        if self.full:
            return x
        if self.span is not None:
            return x.narrow(dim, *self.span)
        return x.index_select(dim, self.idx)

    def put(self, acc: Tensor, value: Tensor, dim: int) -> None:
        if self.span is not None:
            acc.narrow(dim, *self.span).copy_(value)
        else:
            acc.index_copy_(dim, self.idx, value.to(acc.dtype))

    def add(self, acc: Tensor, value: Tensor, dim: int) -> None:
        if self.span is not None:
            acc.narrow(dim, *self.span).add_(value)
        else:
            acc.index_add_(dim, self.idx, value)


@dataclass(frozen=True)
class Span:
    """Which keys a query sees, as bounds on the position offset q - k (None: unbounded).

    causal: 0 <= q - k (< window); bidirectional: |q - k| < window, or every key. Keys at or past
    `seq_len` (padding) are seen by no query."""

    lo: int | None
    hi: int | None
    seq_len: int | None

    @classmethod
    def of(cls, window: int, causal: bool, seq_len: int | None) -> Span:
        hi = window - 1 if window > 0 else None
        lo = 0 if causal else (None if hi is None else -hi)
        return cls(lo, hi, seq_len)

    def keys_seen(self, q_sorted: Tensor, k_pos: Tensor) -> Tensor:
        """bool[Tk]: keys visible to at least one query (some q in [k + lo, k + hi]); queries sorted."""
        n = q_sorted.numel()
        if self.lo is None:
            first = torch.zeros_like(k_pos)
        else:
            first = torch.searchsorted(q_sorted, k_pos + self.lo)  # first query at k + lo or later
        seen = first < n
        if self.hi is not None and n:
            seen &= q_sorted[first.clamp(max=n - 1)] <= k_pos + self.hi
        if self.seq_len is not None:
            seen &= k_pos < self.seq_len
        return seen

    def rows_seeing(self, k_sorted: Tensor, q_pos: Tensor) -> Tensor:
        """bool[Tq]: queries that see at least one key (some k in [q - hi, q - lo]); keys sorted and
        all real (never padding)."""
        n = k_sorted.numel()
        if self.hi is None:
            first = torch.zeros_like(q_pos)
        else:
            first = torch.searchsorted(k_sorted, q_pos - self.hi)  # first key at q - hi or later
        sees = first < n
        if self.lo is not None and n:
            sees &= k_sorted[first.clamp(max=n - 1)] <= q_pos - self.lo
        return sees

    def rows_seeing_all(self, k_sorted: Tensor, q_pos: Tensor) -> Tensor:
        """bool[Tq]: queries that see every key of `k_sorted` (sorted, all real)."""
        sees = torch.ones_like(q_pos, dtype=torch.bool)
        if self.lo is not None:
            sees &= q_pos - k_sorted[-1] >= self.lo
        if self.hi is not None:
            sees &= q_pos - k_sorted[0] <= self.hi
        return sees

    def all_visible(self, q_pos: Tensor, k_pos: Tensor) -> bool:
        """Every (query, key) pair is visible (no mask needed); keys all real."""
        return (self.lo is None or bool(q_pos.min() - k_pos.max() >= self.lo)) and (
            self.hi is None or bool(q_pos.max() - k_pos.min() <= self.hi)
        )


@dataclass
class Tile:
    """One piece of work at a ring step: some of this rank's query rows × a run of held keys."""

    rows: Index
    """Local query rows that see at least one key of the tile."""
    cols: Index
    """The tile's keys, as entries of the payload held at this step."""
    grad_cols: Index
    """Where those keys' dK/dV go: the block itself at step 0, else the travelling hop-1 buffer."""
    q_pos: Tensor
    k_pos: Tensor
    """The rows' and keys' global positions (on the device; `host_q_pos`, `host_k_pos` on the
    host, for planning)."""
    host_q_pos: Tensor
    host_k_pos: Tensor
    dense: bool
    """Every (row, key) pair is visible: no mask is built."""
    causal: bool = False
    """Row i sees keys 0..i of the tile and no others (top-left causal: a kernel's causal flag)."""
    window: tuple[int, int] | None = None
    """Square, row i sees keys i − left … i + right (a window's band: flash's window arguments)."""
    _mask: TileMask | None = None


@dataclass
class RingPlan:
    """Who sends which keys at which step, and what each rank computes; identical on every rank
    (built from all ranks' positions).

    `carry[j][t]` (t >= 1): bool over block j's keys that hop t carries — keys some rank t or more
    hops downstream of j still needs. `hops[j]`: the last hop block j makes (0: it never leaves)."""

    rank: int
    size: int
    span: Span
    kv_tile: int
    device: torch.device
    pos: list[Tensor]
    carry: list[list[Tensor]]
    hops: list[int]
    policy: TilePolicy = BOUNDED
    _tiles: dict[tuple[int, bool], list[Tile]] = field(default_factory=dict)
    _payloads: dict[tuple[int, int], Tensor] = field(default_factory=dict)
    _selections: dict[int | str, Index] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        positions: Tensor,
        span: Span,
        kv_tile: int,
        group: ProcessGroup,
        policy: TilePolicy = BOUNDED,
    ) -> RingPlan:
        """From this rank's positions, all-gathered over `group` (a collective and a host copy)."""
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        gathered = [torch.empty_like(positions) for _ in range(size)]
        with spans.collective("all_gather", group, positions):
            dist.all_gather(gathered, positions.contiguous(), group=group)
        return cls.of([p.cpu() for p in gathered], rank, span, kv_tile, positions.device, policy)

    @classmethod
    def of(
        cls,
        pos: list[Tensor],
        rank: int,
        span: Span,
        kv_tile: int,
        device: torch.device,
        policy: TilePolicy = BOUNDED,
    ) -> RingPlan:
        """From every rank's positions (host tensors, rank order), without communication."""
        size = len(pos)
        sorted_pos = [p.sort().values for p in pos]
        carry, hops = [], []
        for j in range(size):
            need = [span.keys_seen(sorted_pos[(j + t) % size], pos[j]) for t in range(size)]
            need[0] = torch.zeros_like(need[0])
            c = [need[-1]]
            for t in range(size - 2, -1, -1):  # suffix OR: needed at this hop or further
                c.append(c[-1] | need[t])
            c.reverse()
            carry.append(c)
            hops.append(max((t for t in range(1, size) if need[t].any()), default=0))
        return cls(rank, size, span, kv_tile, device, pos, carry, hops, policy)

    def owner(self, step: int) -> int:
        """The block this rank holds at `step`."""
        return (self.rank - step) % self.size

    def holds(self, step: int) -> bool:
        return step == 0 or self.hops[self.owner(step)] >= step

    def arrives(self, step: int) -> bool:
        """Whether a block arrives over the ring for `step`."""
        return 0 < step < self.size and self.holds(step)

    def incoming(self, step: int, B: int, Hkv: int, d: int) -> tuple[int, ...] | None:
        """Shape of the [2, B, Hkv, keys, d] K/V payload arriving for `step`, None if none does."""
        if not self.arrives(step):
            return None
        return (2, B, Hkv, self.payload(self.owner(step), step).numel(), d)

    def sends(self, step: int) -> bool:
        """Whether this rank forwards its held block after `step` (hop step + 1)."""
        return step + 1 < self.size and self.hops[self.owner(step)] >= step + 1

    def payload(self, j: int, hop: int) -> Tensor:
        """Indices into block j of the keys present on `hop` (all of them at the owner)."""
        if (j, hop) not in self._payloads:
            self._payloads[(j, hop)] = (
                torch.arange(self.pos[j].numel())
                if hop == 0
                else self.carry[j][hop].nonzero().flatten()
            )
        return self._payloads[(j, hop)]

    def home_selection(self) -> Index:
        """Where this rank's keys that left on hop 1 sit in its own block (their dK/dV come home
        there), built once: the index is planned on the host, like the rest of the plan."""
        if "home" not in self._selections:
            self._selections["home"] = Index(
                self.payload(self.rank, 1), self.pos[self.rank].numel(), self.device
            )
        return self._selections["home"]

    def forward_selection(self, step: int) -> Index:
        """Which entries of the payload held at `step` travel on to hop step + 1."""
        if step not in self._selections:
            j = self.owner(step)
            here = self.payload(j, step)
            keep = self.carry[j][step + 1][here].nonzero().flatten()
            self._selections[step] = Index(keep, here.numel(), self.device)
        return self._selections[step]

    def tiles(self, step: int, bounded: bool = False) -> list[Tile]:
        """The work at `step` (empty: the whole held block is masked for every local query), cut
        by the plan's policy (see the module doc); `bounded`: by the bounded policy whatever the
        plan's (what a tile's per-batch bias needs: `ring_documents`).

        Only keys seen by some local query are used; each tile takes only the query rows that see
        it. Zigzag's masked chunk pairs are skipped exactly either way."""
        whole = self.policy.whole and not bounded
        if (step, whole) in self._tiles:
            return self._tiles[(step, whole)]
        j = self.owner(step)
        here = self.payload(j, step)
        q_pos, k_pos = self.pos[self.rank], self.pos[j][here]
        cols = self.span.keys_seen(q_pos.sort().values, k_pos).nonzero().flatten()
        grad_base = here if step == 0 else self.payload(j, 1)
        ordered = bool((q_pos[1:] > q_pos[:-1]).all() and (k_pos[1:] > k_pos[:-1]).all())
        tiles: list[Tile] = []
        rows: Tensor | None = torch.ones_like(q_pos, dtype=torch.bool)  # rows left to tile
        if cols.numel() and whole and ordered:  # positions sorted: every row sees a key range
            where = (cols, q_pos, k_pos, here, grad_base)
            seeing = self.span.rows_seeing(k_pos[cols], q_pos)
            rows = self._whole_tile(tiles, seeing, *where)
            if rows is not None:  # rows seeing every key in one tile, the others in another
                seeing_all = seeing & self.span.rows_seeing_all(k_pos[cols], q_pos)
                self._whole_tile(tiles, seeing_all, *where)
                rows = self._whole_tile(tiles, seeing & ~seeing_all, *where)
        if cols.numel() and rows is not None:
            self._bounded_tiles(tiles, rows, cols, q_pos, k_pos, here, grad_base)
        self._tiles[(step, whole)] = tiles
        return tiles

    def _whole_tile(
        self, tiles: list[Tile], row_mask, cols, q_pos, k_pos, here, grad_base
    ) -> Tensor | None:
        """Appends (rows in `row_mask`) × (the keys of `cols` they see) as one tile if it needs no
        bias (returns None; also when no row is given), else appends nothing and returns the
        rows."""
        if not row_mask.any():
            return None
        rows_pos = q_pos[row_mask]
        first, last = self._ranges(rows_pos, k_pos[cols])
        lo, hi = int(first.min()), int(last.max())
        cols, first, last = cols[lo:hi], first - lo, last - lo
        kind = _kind(first, last, cols.numel(), self.policy.window)
        if kind is None:
            return row_mask
        dense, causal = kind == "dense", kind == "causal"
        window = kind if isinstance(kind, tuple) else None
        keys_pos = k_pos[cols]
        tiles.append(
            self._tile(row_mask, cols, rows_pos, keys_pos, here, grad_base, dense, causal, window)
        )
        return None

    def _ranges(self, rows_pos: Tensor, keys: Tensor) -> tuple[Tensor, Tensor]:
        """Per row, the first and one past the last index of `keys` (sorted) it sees: a row sees
        the keys k with q − hi ≤ k ≤ q − lo, a contiguous range of sorted keys."""
        n = keys.numel()
        lo, hi = self.span.lo, self.span.hi
        first = (
            torch.zeros_like(rows_pos) if hi is None else torch.searchsorted(keys, rows_pos - hi)
        )
        last = (
            torch.full_like(rows_pos, n)
            if lo is None
            else torch.searchsorted(keys, rows_pos - lo, right=True)
        )
        return first, last

    def _bounded_tiles(self, tiles: list[Tile], rows, cols, q_pos, k_pos, here, grad_base):
        """Runs of at most `kv_tile` consecutive keys of `cols`, each with the rows (of `rows`)
        that see it: those that see all of the run in one unmasked tile, the others (the
        diagonal, a window's edge) in another — only the latter needs a mask."""
        kp = k_pos[cols]
        breaks = ((cols[1:] != cols[:-1] + 1) | (kp[1:] != kp[:-1] + 1)).nonzero().flatten() + 1
        bounds = [0, *breaks.tolist(), cols.numel()]
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            for a in range(lo, hi, self.kv_tile):
                c = cols[a : min(hi, a + self.kv_tile)]
                tile_pos = kp[a : a + c.numel()]  # consecutive, so already sorted
                seeing = rows & self.span.rows_seeing(tile_pos, q_pos)
                seeing_all = seeing & self.span.rows_seeing_all(tile_pos, q_pos)
                for row_mask in (seeing_all, seeing & ~seeing_all):
                    if not row_mask.any():
                        continue
                    rows_pos = q_pos[row_mask]
                    dense = self.span.all_visible(rows_pos, tile_pos)
                    n = rows_pos.numel()
                    causal = (
                        not dense
                        and self.span.lo == 0
                        and self.span.hi is None
                        and n <= tile_pos.numel()
                        and torch.equal(rows_pos, tile_pos[:n])
                    )
                    tiles.append(
                        self._tile(row_mask, c, rows_pos, tile_pos, here, grad_base, dense, causal)
                    )

    def _tile(
        self, row_mask, cols, rows_pos, keys_pos, here, grad_base, dense, causal, window=None
    ) -> Tile:
        return Tile(
            Index(row_mask.nonzero().flatten(), row_mask.numel(), self.device),
            Index(cols, here.numel(), self.device),
            Index(torch.searchsorted(grad_base, here[cols]), -1, self.device),
            rows_pos.to(self.device),
            keys_pos.to(self.device),
            rows_pos,
            keys_pos,
            dense,
            causal,
            window,
        )

    def mask(self, tile: Tile, host: bool = False) -> Tensor | None:
        """bool [rows, keys] (True = visible), None when all are; on the host with `host` (for
        planning on top of it without a device sync)."""
        if tile.dense:
            return None
        window = 0 if self.span.hi is None else self.span.hi + 1
        q, k = (tile.host_q_pos, tile.host_k_pos) if host else (tile.q_pos, tile.k_pos)
        return attention_mask(q, k, window, causal=self.span.lo == 0)

    def tile_mask(self, tile: Tile) -> TileMask:
        """The tile's mask in the form the tile kernels take, built once per tile: nothing for a
        dense tile; for fused kernels the causal flag where the tile is top-left causal, else an
        additive bias; for the reference a boolean mask."""
        if tile._mask is None:
            if tile.dense:
                tile._mask = TileMask(False, None, None)
            elif not fused(self.device):
                tile._mask = TileMask(False, None, self.mask(tile))
            elif tile.causal:
                tile._mask = TileMask(True, None, None)
            elif tile.window is not None:
                tile._mask = TileMask(False, None, None, tile.window)
            else:
                tile._mask = TileMask(False, additive_bias(self.mask(tile)), None)
        return tile._mask


def _kind(first: Tensor, last: Tensor, n_keys: int, window: bool) -> str | tuple[int, int] | None:
    """What one kernel call needs for rows that see keys [first, last) each: 'dense' (every
    key), 'causal' (row i sees 0..i: top-left), a square band (left, right) where `window`, or
    None (a bias)."""
    n = first.numel()
    if bool((first == 0).all() and (last == n_keys).all()):
        return "dense"
    i = torch.arange(n)
    if n <= n_keys and bool((first == 0).all() and (last == i + 1).all()):
        return "causal"
    if window and n == n_keys:
        left, right = int((i - first).max()), int((last - 1 - i).max())
        if (
            left >= 0
            and right >= 0
            and bool((first == (i - left).clamp(min=0)).all())
            and bool((last == (i + right + 1).clamp(max=n_keys)).all())
        ):
            return (left, right)
    return None
