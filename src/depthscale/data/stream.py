"""The one contract every batch stream keeps: one token stream (`loader.PackedBatches`), a mixture
of them (`mixture.MixedBatches`), and what the trainer, evaluation and `depthscale trace` read
(`DataBundle.train`, `.val`, `.eval_sets`). The prefetch thread (`data/prefetch.py`) wraps any of
them and passes the contract on; nothing outside `data/` looks at a stream's attributes or its
state's keys.

The state means the same everywhere: `state_dict()` is the position right after the last batch
`next_batch` returned, as plain JSON-able numbers plus what identifies the stream (seed, seq_len,
windows); `load_state_dict(state)` continues from exactly there, at any data-parallel degree, or
refuses (a `DataError` naming what differs) a state taken over another stream. Checkpoints store
it as it is.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

Position = tuple[int, int]
"""A batch's place in its stream, (epoch, cursor) for one stream, (0, batch index) for a mixture:
what the NaN guard records in skipped_batches.json and `exclude` takes."""


class Batch(NamedTuple):
    """LongTensor[B, T] inputs and the labels (the same windows shifted by one token)."""

    inputs: torch.Tensor
    labels: torch.Tensor


@runtime_checkable
class BatchStream(Protocol):
    """Batches of `batch_size` windows of `seq_len` + 1 tokens, reproducibly, resumable."""

    seq_len: int
    batch_size: int
    position: Position | None
    """The position of the batch `next_batch` returned last (None before the first)."""

    def next_batch(self, rank: int = 0, world: int = 1) -> Batch:
        """The next global batch, or data-parallel rank `rank`'s contiguous rows of it (every
        rank calls it, so all ranks' states stay equal); advances the state."""
        ...

    def iter_eval(self, n_batches: int, rank: int = 0, world: int = 1) -> Iterator[Batch]:
        """The stream's first `n_batches` batches, the same every call; the state untouched."""
        ...

    def exclude(self, positions: Iterable[Position]) -> None:
        """Never serve the batches at `positions` (ones the NaN guard found non-finite on every
        try); passed over as if consumed."""
        ...

    def metrics(self, state: dict[str, Any]) -> dict[str, float]:
        """The stream's own metrics at `state` (a state of this stream), logged beside the
        trainer's: a mixture's tokens and epochs per source; none for one stream."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


__all__ = ["Batch", "BatchStream", "Position"]
