"""How context parallelism cuts sequences over the cp ranks: zigzag (head-tail) or contiguous
shards, their global positions, padding to a length the layout divides, and the inverse.

Everything here is per token and pure (no communication): the ring (`context_parallel`) needs only
the positions (and, with packed documents, the documents of the full rows), and the trainer's plan
cuts every micro-batch with `SequenceShard`.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from depthscale.model.documents import DocumentPacking, Documents
from depthscale.parallel.cp_balance import Balancing

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


class MicroBatch(NamedTuple):
    """One micro-batch as this rank's model takes it: its tokens and labels (a sequence shard
    under cp), the tokens' global positions (None: the whole row, 0..T−1) and the rows' packed
    documents (None: no document masking, or no boundary in any row)."""

    tokens: Tensor
    labels: Tensor
    positions: Tensor | None = None
    documents: Documents | None = None

    def model_inputs(self) -> dict[str, Tensor | Documents]:
        """The keyword arguments of `Transformer.forward` besides the tokens."""
        given = {"positions": self.positions, "documents": self.documents}
        return {k: v for k, v in given.items() if v is not None}


class SequenceShard:
    """How each row of a batch reaches this rank's model: cut into its packed documents when
    `packing` is set (`data.document_mask`; computed on the full row, before any shard), and
    over the cp ranks, padded to a multiple of 2·cp, with the global positions of the kept tokens:
    in zigzag (head-tail) shards, or in chunks balanced by attention work over the documents
    (`balancing`, `cp_balance.py`). cp = 1: the whole row."""

    def __init__(
        self,
        rank: int = 0,
        size: int = 1,
        packing: DocumentPacking | None = None,
        balancing: Balancing | None = None,
    ) -> None:
        self.rank, self.size, self.packing = rank, size, packing
        self.balancing = balancing if balancing is not None else Balancing("zigzag")

    def __call__(
        self, tokens: Tensor, labels: Tensor, device: torch.device | None = None
    ) -> MicroBatch:
        device = tokens.device if device is None else device
        if self.packing is not None:
            labels = self.packing.labels(labels)
        if self.size > 1:
            tokens, labels = pad_for_cp(tokens, labels, self.size, "zigzag")
        documents = None if self.packing is None else self.packing.documents(tokens, device)
        if self.size == 1:
            return MicroBatch(_to(tokens, device), _to(labels, device), None, documents)
        layout = self.balancing.layout(documents, tokens.shape[1], self.size)
        return MicroBatch(
            _to(layout.shard(tokens, self.rank), device),
            _to(layout.shard(labels, self.rank), device),
            layout.positions(self.rank, tokens.shape[1], device),
            documents,
        )


def _to(x: Tensor, device: torch.device) -> Tensor:
    return x.to(device, non_blocking=True)
