"""From a DataConfig to batches: tokenize the corpus once (cached), hold out its end, pack windows.

The token stream is every document followed by EOS, concatenated. Training reads it as windows of
seq_len+1 tokens starting every seq_len tokens: inputs never overlap, and every token is a label
exactly once. Each epoch visits the windows in an order seeded by (seed, epoch) and computed per
position (`data/order.py`), so the order is reproducible, a run resumes exactly from (epoch,
cursor) alone, and no rank holds a permutation of the corpus.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from depthscale.config import DataConfig
from depthscale.data.cache import atomic_path, cache_key, cache_root, cache_writes
from depthscale.data.concat import ConcatTokens
from depthscale.data.encode import encode_documents
from depthscale.data.mixture import MixedBatches, Stage
from depthscale.data.order import EpochCursor, rank_rows
from depthscale.data.sources import (
    checked_source,
    corpus_identity,
    is_pretokenized,
    iter_documents,
    source_config,
    token_format,
)
from depthscale.data.stream import Batch, BatchStream, Position
from depthscale.data.token_files import token_dtype, write_npy_stream
from depthscale.data.token_stream import token_stream
from depthscale.data.tokenizer import Tokenizer, build_tokenizer
from depthscale.data.usage import TextUsage
from depthscale.errors import DataError

__all__ = ["DataBundle", "PackedBatches", "build_data", "split_stream", "tokenize_corpus"]

ORDER = "feistel-6"
"""The data order's name and version, kept in the loader state: resuming under another order
would not continue the same sequence of batches."""


@dataclass
class DataBundle:
    """What the trainer needs from the data side: the tokenizer and the train/val batch streams,
    each kept to one contract (`data/stream.py`)."""

    tokenizer: Tokenizer
    train: BatchStream
    val: BatchStream | None
    eval_sets: dict[str, BatchStream] = field(default_factory=dict)
    """The named held-out sets (`[[eval.sets]]`, `data/eval_sets.py`)."""


def build_data(
    cfg: DataConfig,
    seed: int,
    batch_size: int,
    ranks: int = 1,
    steps: int = 0,
    progress: Callable[[int], None] | None = None,
) -> DataBundle:
    """The one entry point: tokenizer, cached token stream, train/val split, batch streams.
    `ranks`: data-parallel ranks that split each batch (the held-out batch is sized to divide).
    A mixture (`data.sources`) holds out the end of every source; `steps` > 0 checks its
    sources' max_epochs against the run's schedule. `progress(n)`: told as tokenizing goes on."""
    for i, source in enumerate(cfg.sources):
        checked_source(cfg, source, f"data.sources[{i}]")
    tokenizer = build_tokenizer(cfg, lambda: iter_documents(cfg))
    if cfg.sources:
        train, val_tokens = _mixture(cfg, tokenizer, seed, batch_size, steps, progress)
    else:
        tokens = tokenize_corpus(cfg, tokenizer, progress)
        train_tokens, val_tokens = split_stream(tokens, cfg.val_fraction, cfg.seq_len)
        train = PackedBatches(train_tokens, cfg.seq_len, batch_size, seed)
    val = None
    if len(val_tokens):
        val = held_out_batches(
            val_tokens, cfg.seq_len, batch_size, ranks, seed,
            "the held-out split", "raise data.val_fraction or set it to 0",
        )  # fmt: skip
    return DataBundle(tokenizer, train, val)


def held_out_batches(
    tokens, seq_len: int, batch_size: int, ranks: int, seed: int, what: str, fix: str
) -> PackedBatches:
    """Evaluation batches over `tokens`: at most a training batch, a multiple of the
    data-parallel ranks (each takes its rows, as in training)."""
    windows = (len(tokens) - 1) // seq_len
    batch = min(batch_size, windows) // ranks * ranks
    if batch == 0:
        raise DataError(
            f"{what} has {windows} sequences, fewer than the {ranks} data-parallel ranks; {fix}"
        )
    return PackedBatches(tokens, seq_len, batch, seed)


def _mixture(
    cfg: DataConfig, tokenizer: Tokenizer, seed: int, batch_size: int, steps: int, progress=None
) -> tuple[MixedBatches, ConcatTokens]:
    """The sources' training streams as one MixedBatches, and their held-out ends joined."""
    streams, held_out = {}, []
    for source in cfg.sources:
        tokens = tokenize_corpus(source_config(cfg, source), tokenizer, progress)
        train, val = split_stream(tokens, cfg.val_fraction, cfg.seq_len)
        streams[source.name], held_out = train, [*held_out, val]
    stages = [Stage(0, {s.name: s.weight for s in cfg.sources})]
    stages += [Stage(stage.at_step - 1, dict(stage.weights)) for stage in cfg.stages]
    mixed = MixedBatches(streams, cfg.seq_len, batch_size, seed, stages)
    if steps:
        mixed.check_epochs(steps, {s.name: s.max_epochs for s in cfg.sources})
    return mixed, ConcatTokens(held_out)  # joined when read: never copied whole


def tokenize_corpus(
    cfg: DataConfig, tokenizer: Tokenizer, progress: Callable[[int], None] | None = None
) -> np.ndarray:
    """The corpus as one token stream (EOS after each document), memory-mapped from the cache:
    written there once, a piece at a time (never whole in memory), so later runs are instant.
    What `data.max_bytes` left out of a text corpus is said at every start (`data/usage.py`).

    A token file is already tokens: it is memory-mapped whole (`data.max_bytes` caps raw text
    only) and checked to fit the tokenizer's vocabulary.
    """
    if is_pretokenized(cfg):
        tokens = token_stream(cfg, tokenizer)
        checked = token_format(cfg) == "shards"  # against its manifest, without a read
        if len(tokens) and not checked and int(tokens.max()) >= tokenizer.vocab_size:
            raise DataError(
                f"data.path={cfg.path!r} holds token id {int(tokens.max())}, outside the "
                f"tokenizer's vocabulary ({tokenizer.vocab_size}); check data.tokenizer "
                "and data.bin_dtype"
            )
        if cfg.max_bytes:
            _say(
                f"data.max_bytes caps raw text only: {cfg.path!r} is tokens, all "
                f"{len(tokens):,} of them used"
            )
        return tokens
    key = cache_key("tokens", corpus_identity(cfg), tokenizer.fingerprint)
    path = cache_root(cfg) / "tokens" / f"{key}.npy"
    usage_path = path.with_suffix(".usage.json")  # written first: an entry without one is redone
    usage = None
    if path.is_file():
        with contextlib.suppress(OSError, ValueError):  # none, or unreadable: redone
            usage = TextUsage.from_json(json.loads(usage_path.read_text()))
    if usage is None:
        usage, dtype = TextUsage(), token_dtype(tokenizer.vocab_size)
        with cache_writes(path, "the tokenized corpus"), atomic_path(path) as tmp:
            with tmp.open("wb") as f:
                pieces = encode_documents(iter_documents(cfg, usage), tokenizer, progress)
                write_npy_stream(f, dtype, pieces)
            with atomic_path(usage_path) as usage_tmp:
                usage_tmp.write_text(json.dumps(usage.to_json()) + "\n")
    tokens = np.load(path, mmap_mode="r")
    left_out = usage.report(cfg.path, len(tokens))
    if left_out is not None:
        _say(left_out)
    return tokens


def _say(message: str) -> None:
    """A start-up fact, on stdout beside the others (the tokenizer, the model), from the first
    rank only: every rank builds the same data."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"depthscale: {message}", flush=True)


def split_stream(
    tokens: np.ndarray, val_fraction: float, seq_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """(train, val): val is the END of the stream, val_fraction of it and at least seq_len+1 tokens.

    A held-out tail (rather than random windows) keeps the two disjoint with no bookkeeping. With
    val_fraction 0 the val part is empty.
    """
    if val_fraction <= 0:
        return tokens, tokens[:0]
    n_val = max(int(len(tokens) * val_fraction), seq_len + 1)
    if n_val >= len(tokens):
        raise DataError(
            f"the corpus has {len(tokens)} tokens; holding out data.val_fraction="
            f"{val_fraction} (at least seq_len+1={seq_len + 1} tokens) leaves nothing to "
            "train on; use a larger corpus or data.val_fraction=0"
        )
    return tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]


class PackedBatches:
    """Batches of (inputs, labels) LongTensor[B, T] packed from one token stream, reproducibly.

    Window i is tokens[i*T : i*T + T + 1]; inputs = window[:-1], labels = window[1:]. Epoch e visits
    the windows in the order `WindowOrder(n_windows, seed, e)` (`order.EpochCursor`), B at a time; the < B windows left at an
    epoch's end are skipped (a different few each epoch). The position is just (epoch, cursor);
    `state_dict()` adds seed, seq_len and n_windows so resuming over a different stream is refused.

    A `BatchStream` (`data/stream.py`). Data parallel: every rank holds the same PackedBatches and
    calls `next_batch(rank, world)`,
    which returns the contiguous rows [rank*B/world, (rank+1)*B/world) of the global batch, so the
    ranks' slices concatenated in rank order are exactly the world=1 batch and all ranks' states
    stay identical.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int = 0) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.n_windows = max(len(tokens) - 1, 0) // seq_len
        if self.n_windows < batch_size:
            raise DataError(
                f"the token stream has {len(tokens)} tokens, too short for one batch of "
                f"batch_size={batch_size} sequences of seq_len={seq_len} (needs at least "
                f"{batch_size * seq_len + 1}); use a larger corpus (data.path, "
                "data.max_bytes for text) or a smaller train.batch_size or data.seq_len"
            )
        self.epochs = EpochCursor(self.n_windows, seed)
        self._excluded: set[Position] = set()
        self.position: Position | None = None
        """(epoch, cursor) of the batch `next_batch` returned last."""

    @property
    def batches_per_epoch(self) -> int:
        return self.n_windows // self.batch_size

    def next_batch(self, rank: int = 0, world: int = 1) -> Batch:
        """The next global batch (or this rank's contiguous slice of it); advances the state."""
        rows = self._rows(rank, world)
        at = self.epochs
        at.fit(self.batch_size)
        while (at.epoch, at.cursor) in self._excluded:
            at.cursor += self.batch_size
            at.fit(self.batch_size)
        self.position = (at.epoch, at.cursor)
        return self._gather(at.take(self.batch_size)[rows])

    def iter_eval(self, n_batches: int, rank: int = 0, world: int = 1) -> Iterator[Batch]:
        """The first n batches of windows in stream order: the same every call; state untouched."""
        rows = self._rows(rank, world)
        for b in range(min(n_batches, self.batches_per_epoch)):
            windows = np.arange(b * self.batch_size, (b + 1) * self.batch_size)
            yield self._gather(windows[rows])

    def exclude(self, positions: Iterable[Position]) -> None:
        self._excluded.update(positions)

    def metrics(self, state: dict[str, Any]) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epochs.epoch,
            "cursor": self.epochs.cursor,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "n_windows": self.n_windows,
            "order": ORDER,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at (epoch, cursor); refuses a state taken over a different stream or seed."""
        mine = self.state_dict()
        state = {"order": "permutation", **state}  # saved before orders were computed per index
        diffs = [
            f"{k}: saved {state[k]!r}, now {mine[k]!r}"
            for k in ("seed", "seq_len", "n_windows", "order")
            if k in state and state[k] != mine[k]
        ]
        if diffs:
            raise DataError(
                "cannot resume the data stream: it differs from the saved one ("
                + "; ".join(diffs)
                + "); the corpus, tokenizer, seq_len, seed or the data order's version changed"
            )
        self.epochs.epoch, self.epochs.cursor = int(state["epoch"]), int(state["cursor"])

    def _rows(self, rank: int, world: int) -> slice:
        return rank_rows(self.batch_size, rank, world)

    def _gather(self, windows: np.ndarray) -> Batch:
        t = self.seq_len
        rows = np.stack([self.tokens[i * t : i * t + t + 1] for i in windows.tolist()])
        rows = rows.astype(np.int64)
        return Batch(torch.from_numpy(rows[:, :-1].copy()), torch.from_numpy(rows[:, 1:].copy()))
