"""Context-parallel chunks balanced by attention work over packed documents
(`parallel.cp_balance = "documents"`).

Zigzag (head-tail) cuts a row into 2·cp chunks and gives rank r chunks r and 2·cp−1−r, which
balances one causal sequence. Packed documents (`data.document_mask`) break that assumption: a
query sees only the keys of its own document, so its work is its offset in the document (capped by
the sliding window), and a rank whose chunks fall into many short documents does far less attention
than one holding the end of a long one — and every ring step waits for the slowest rank.

Here the work is counted per query on the host, from the documents the step plans anyway
(`Documents.host_starts`, the full rows): query p of a row does min(p − start(p) + 1, window) (q, k)
pairs, summed over the micro-batch's rows (they share one layout). The row is cut into
n = 2·cp·k equal chunks (k as large as chunks of at least `min_chunk` tokens allow) and each rank
takes n / cp of them — equal token counts, as the ring needs — assigned by longest-processing-time
first (the heaviest chunk to the least loaded rank that still has room), then improved by swaps
with the most loaded rank while one lowers the maximum. Zigzag at the same granularity is a
candidate too, so the result is never worse than zigzag (and is zigzag, exactly, where that is
already best: rows without boundaries).

Each rank holds its chunks in position order and passes their global positions to the model, so
masks, RoPE and the document lookups stay exact in any assignment (the ring plans from every rank's
positions; `RingAttention(layout="documents")`); `unshard` restores row order for outputs. The
loss is a sum over tokens and needs no reordering.

Everything here is pure and host-side: every rank derives the same layout from the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from depthscale.model.documents import Documents

Balance = Literal["zigzag", "documents"]
BALANCES = ("zigzag", "documents")
LAYOUT_KEY = "cp_layout"
"""Where `SequenceShard` leaves a batch's `CpLayout` in `Documents.cache` for the ring to plan on."""


def query_work(starts: Tensor | None, seq_len: int, window: int = 0) -> Tensor:
    """float64 [seq_len]: (query, key) pairs each position's queries attend to, summed over the
    rows of `starts` [B, seq_len] (each token's document start; None: one causal sequence per row,
    counted once). `window` > 0: a query sees at most `window` keys."""
    pos = torch.arange(seq_len, dtype=torch.float64)
    seen = (pos + 1)[None] if starts is None else pos - starts.to(torch.float64) + 1
    if window > 0:
        seen = seen.clamp(max=window)
    return seen.sum(0)


def chunk_count(seq_len: int, cp: int, min_chunk: int) -> int:
    """The chunks a row of `seq_len` tokens (a multiple of 2·cp) is cut into: 2·cp·k with k the
    largest divisor of seq_len / (2·cp) that leaves chunks of at least `min_chunk` tokens (k = 1:
    zigzag's chunks)."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not a multiple of 2·cp = {2 * cp}")
    half = seq_len // (2 * cp)
    k = max((d for d in range(1, half + 1) if half % d == 0 and half // d >= min_chunk), default=1)
    return 2 * cp * k


def zigzag_chunks(n: int, cp: int) -> list[list[int]]:
    """Zigzag's assignment with each of its 2·cp chunks cut into n / (2·cp) pieces."""
    k = n // (2 * cp)
    return [
        [*range(r * k, (r + 1) * k), *range((2 * cp - 1 - r) * k, (2 * cp - r) * k)]
        for r in range(cp)
    ]


def assign(work: Tensor, cp: int) -> list[list[int]]:
    """Chunks (by index into `work`, float64 [n], n a multiple of cp) per rank, n / cp each, with
    the most loaded rank as light as LPT and swaps make it (see the module doc); sorted."""
    n = work.numel()
    per = n // cp
    owner = torch.empty(n, dtype=torch.long)
    loads = torch.zeros(cp, dtype=torch.float64)
    counts = [0] * cp
    for c in torch.argsort(work, descending=True, stable=True).tolist():
        open_loads = [(loads[r].item(), r) for r in range(cp) if counts[r] < per]
        r = min(open_loads)[1]
        owner[c], counts[r] = r, counts[r] + 1
        loads[r] += work[c]
    for _ in range(4 * n):  # swaps: each strictly lowers (max load, its rank's count of maxima)
        top = int(loads.argmax())
        mine = (owner == top).nonzero().flatten()
        # delta[i, j]: the load moved off the top rank by swapping its chunk i with chunk j
        delta = work[mine][:, None] - work[None, :]
        other = loads[owner]
        new_top = loads[top] - delta
        new_other = other[None, :] + delta
        worst = torch.maximum(new_top, new_other)
        worst[:, owner == top] = float("inf")
        worst[delta <= 0] = float("inf")
        best = int(worst.argmin())
        i, j = divmod(best, n)
        if not worst.view(-1)[best] < loads[top]:
            break
        a, b = int(mine[i]), j
        rb = int(owner[b])
        owner[a], owner[b] = rb, top
        loads[top] -= delta[i, j]
        loads[rb] += delta[i, j]
    return [sorted((owner == r).nonzero().flatten().tolist()) for r in range(cp)]


@dataclass(frozen=True)
class CpLayout:
    """Which of a row's `n_chunks` equal chunks each cp rank holds (sorted), and the attention
    work each rank does under it."""

    chunks: tuple[tuple[int, ...], ...]
    n_chunks: int
    work: tuple[float, ...]

    @property
    def size(self) -> int:
        return len(self.chunks)

    @property
    def imbalance(self) -> float:
        """max / mean of the ranks' work (1.0: perfectly balanced)."""
        mean = sum(self.work) / len(self.work)
        return max(self.work) / mean if mean else 1.0

    def positions(
        self, rank: int, seq_len: int, device: torch.device | str | None = None
    ) -> Tensor:
        """Global positions [seq_len / cp] of the rank's tokens, ascending."""
        step = seq_len // self.n_chunks
        chunks = torch.tensor(self.chunks[rank], dtype=torch.long)
        pos = (chunks[:, None] * step + torch.arange(step)).flatten()
        return pos.to(device) if device is not None else pos

    def shard(self, x: Tensor, rank: int, dim: int = 1) -> Tensor:
        """The rank's tokens of `x` along `dim` (in position order)."""
        return x.index_select(dim, self.positions(rank, x.shape[dim], x.device))

    def unshard(self, shards: list[Tensor], dim: int = 1) -> Tensor:
        """Inverse of `shard`: the per-rank shards (rank order) back to row order."""
        seq_len = sum(s.shape[dim] for s in shards)
        order = torch.cat([self.positions(r, seq_len) for r in range(self.size)])
        joined = torch.cat(shards, dim)
        return joined.index_select(dim, torch.argsort(order).to(joined.device))


def layout_for(
    starts: Tensor | None,
    seq_len: int,
    cp: int,
    window: int = 0,
    min_chunk: int = 64,
    balance: Balance = "documents",
) -> CpLayout:
    """The layout of a micro-batch whose rows have document starts `starts` [B, seq_len] (None:
    no boundaries): zigzag, or balanced by attention work (`balance="documents"`), whichever has
    the lighter most-loaded rank (zigzag on ties)."""
    if balance not in BALANCES:
        raise ValueError(f"unknown cp balance {balance!r}; allowed: {', '.join(BALANCES)}")
    n = chunk_count(seq_len, cp, min_chunk) if balance == "documents" else 2 * cp
    # numpy from here: host numbers stay host numbers (a torch scalar read looks like a device
    # read to the host-sync checks, and on a GPU `.numpy()` of a device tensor would fail loudly)
    chunk_work = query_work(starts, seq_len, window).numpy().reshape(n, -1).sum(1)

    def of(chunks: list[list[int]]) -> CpLayout:
        loads = tuple(float(chunk_work[c].sum()) for c in chunks)
        return CpLayout(tuple(tuple(c) for c in chunks), n, loads)

    zigzag = of(zigzag_chunks(n, cp))
    if balance == "zigzag":
        return zigzag
    balanced = of(assign(torch.from_numpy(chunk_work), cp))
    return balanced if max(balanced.work) < max(zigzag.work) else zigzag


@dataclass(frozen=True)
class Balancing:
    """How `SequenceShard` lays out each micro-batch over the cp ranks (`parallel.cp_balance`,
    `cp_balance_chunk`, the model's sliding window), and the work it measured: per micro-batch
    the most loaded rank's and the mean rank's work, summed over the step (the ranks meet at every
    ring step, so a step lasts as long as its most loaded rank's share)."""

    mode: Balance = "documents"
    window: int = 0
    min_chunk: int = 64
    measured: list[float] = field(default_factory=lambda: [0.0, 0.0], compare=False)

    def __post_init__(self) -> None:
        if self.mode not in BALANCES:
            raise ValueError(f"unknown cp balance {self.mode!r}; allowed: {', '.join(BALANCES)}")

    def layout(self, documents: Documents | None, seq_len: int, cp: int) -> CpLayout:
        """The micro-batch's layout; with documents (balanced or not) it is left in their cache
        for the ring (`LAYOUT_KEY`). Without documents: zigzag, which the ring then assumes."""
        starts = None if documents is None else documents.host_starts
        mode = self.mode if documents is not None else "zigzag"
        layout = layout_for(starts, seq_len, cp, self.window, self.min_chunk, mode)
        if documents is not None:
            documents.cache[LAYOUT_KEY] = layout
        self.measured[0] += max(layout.work)
        self.measured[1] += sum(layout.work) / cp
        return layout

    def reset(self) -> None:
        """Forget what was measured (evaluation batches, a step tried again)."""
        self.measured[:] = [0.0, 0.0]

    def take_imbalance(self) -> float | None:
        """max / mean attention work over the micro-batches since the last reset (None: none)."""
        top, mean = self.measured
        self.reset()
        return top / mean if mean else None
