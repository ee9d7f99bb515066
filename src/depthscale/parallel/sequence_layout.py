"""How context parallelism cuts sequences over the cp ranks: zigzag (head-tail) or contiguous
shards, their global positions, padding to a length the layout divides, and the inverse.

Everything here is per token and pure (no communication): the ring (`context_parallel`) needs only
the positions, and the trainer's plan cuts every micro-batch with `SequenceShard`.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

ShardMode = Literal["zigzag", "contiguous"]


def _layout(cp_rank: int, cp_size: int, mode: ShardMode) -> tuple[list[int], int]:
    """(chunks this rank holds, in order; number of chunks the sequence is cut into)."""
    if mode == "contiguous":
        return [cp_rank], cp_size
    if mode == "zigzag":
        return [cp_rank, 2 * cp_size - 1 - cp_rank], 2 * cp_size
    raise ValueError(
        f"unknown context-parallel shard mode {mode!r}; allowed: 'zigzag', 'contiguous'"
    )


def shard_sequence(
    x: Tensor, cp_rank: int, cp_size: int, dim: int = 1, mode: ShardMode = "zigzag"
) -> Tensor:
    """This rank's part of `x` along the sequence dim `dim`.

    zigzag (head-tail): the sequence is cut into 2·cp chunks and rank r takes chunks r and 2·cp-1-r —
    one early, one late — so every rank does the same causal work. contiguous: chunk r of cp.
    Tokens, labels and positions must be sharded with the same mode. The length must be divisible by
    the number of chunks: use `pad_for_cp` first."""
    chunks, n = _layout(cp_rank, cp_size, mode)
    if x.shape[dim] % n:
        raise ValueError(
            f"sequence length {x.shape[dim]} is not divisible by {n} ({mode} sharding over cp="
            f"{cp_size}); pad it with pad_for_cp first"
        )
    parts = x.chunk(n, dim)
    return torch.cat([parts[c] for c in chunks], dim)


def unshard_sequence(shards: list[Tensor], dim: int = 1, mode: ShardMode = "zigzag") -> Tensor:
    """Inverse of `shard_sequence`: the per-rank shards (rank order) back to the full sequence."""
    if mode == "contiguous":
        return torch.cat(shards, dim)
    _layout(0, len(shards), mode)
    heads = [s.chunk(2, dim)[0] for s in shards]
    tails = [s.chunk(2, dim)[1] for s in reversed(shards)]
    return torch.cat(heads + tails, dim)


def positions_for(
    seq_len: int,
    cp_rank: int,
    cp_size: int,
    mode: ShardMode = "zigzag",
    device: torch.device | str | None = None,
) -> Tensor:
    """Global positions [seq_len / cp] of this rank's tokens: pass as `model(tokens, positions=...)`."""
    return shard_sequence(torch.arange(seq_len, device=device), cp_rank, cp_size, 0, mode)


def pad_for_cp(
    tokens: Tensor, labels: Tensor, cp_size: int, mode: ShardMode = "zigzag", pad_id: int = 0
) -> tuple[Tensor, Tensor]:
    """Right-pad [B, T] tokens and labels so T divides into the layout's chunks (2·cp for zigzag,
    cp for contiguous). Padding tokens are `pad_id`; their labels are -100 (the `cross_entropy`
    ignore_index), so they add nothing to the loss; being last, causal attention never lets a real
    token see them. Returns the inputs unchanged when no padding is needed."""
    _, n = _layout(0, cp_size, mode)
    pad = -tokens.shape[-1] % n
    if pad == 0:
        return tokens, labels
    return F.pad(tokens, (0, pad), value=pad_id), F.pad(labels, (0, pad), value=-100)


class SequenceShard:
    """How each sequence of a batch is cut over the cp ranks: zigzag (head-tail) shards, padded to
    a multiple of 2·cp, with the global positions of the kept tokens. cp = 1: unchanged."""

    def __init__(self, rank: int = 0, size: int = 1) -> None:
        self.rank, self.size = rank, size

    def __call__(self, tokens: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        if self.size == 1:
            return tokens, labels, None
        from depthscale.parallel import context_parallel as cpar

        tokens, labels = cpar.pad_for_cp(tokens, labels, self.size, "zigzag")
        positions = cpar.positions_for(
            tokens.shape[1], self.rank, self.size, "zigzag", tokens.device
        )
        tokens = cpar.shard_sequence(tokens, self.rank, self.size, 1, "zigzag")
        labels = cpar.shard_sequence(labels, self.rank, self.size, 1, "zigzag")
        return tokens, labels, positions
