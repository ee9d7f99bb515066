"""A weighted mixture of token streams (`[[data.sources]]`), with stages that change the weights
(`[[data.stages]]`), served with token-level accounting and O(1) state per source.

Each source keeps its own seeded window order, epoch and cursor (`order.EpochCursor`, seeded by the
run's seed and the source's name), the one a single stream keeps (`loader.PackedBatches`). A global
batch of B windows is dealt one window at a time, earliest deadline first (Tijdeman's solution
of the chairman assignment problem, 1980): after n windows of the current stage source s has
served c_s, its next window may go at window n only once w_s·n ≥ c_s + δ (not too early) and is
due by w_s·n = c_s + 1 − δ, with δ = 1/(2(S − 1)) for S sources; the released source due first
takes it (the first in source order on a tie). Every c_s then stays within 1 − δ < 1 window of
w_s·n after every window, so after every step (dealing by the largest deficit alone can drift
past one window). It looks at nothing but the counts, so the batches are a function of the state
alone: a resume (at any data-parallel degree: ranks take contiguous rows of the same global batch)
continues them exactly.

A stage change at step k starts a new count for the new weights; every source continues from its
own cursor, so no window of a source is served twice before that source's epoch ends. A source
that runs out starts its next epoch (a new order), which the logged `epoch/<name>` shows; a
source's `max_epochs` is checked against the whole run's schedule before training starts.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from depthscale.data.order import EpochCursor, rank_rows
from depthscale.data.stream import Batch, Position
from depthscale.errors import DataError

ORDER = "mixture-1/feistel-6"


@dataclass(frozen=True)
class Stage:
    """From optimizer step `start` on (0-based: the first batch of step start + 1), these
    weights (normalised; sources absent are weight 0)."""

    start: int
    weights: dict[str, float]


class _Source:
    def __init__(self, name: str, tokens: np.ndarray, seq_len: int, seed: int) -> None:
        self.name, self.tokens, self.seq_len = name, tokens, seq_len
        self.n_windows = max(len(tokens) - 1, 0) // seq_len
        if self.n_windows < 1:
            raise DataError(
                f"data source {name!r} has {len(tokens)} tokens, not one window of "
                f"data.seq_len={seq_len} + 1"
            )
        self.seed = (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**32
        self.epochs = EpochCursor(self.n_windows, self.seed)
        self.served = 0

    def take(self, n: int) -> np.ndarray:
        """The next `n` windows of this source's order, running on into the next epoch's (a
        source serves windows, not whole batches: none is passed over)."""
        out = []
        while n:
            self.epochs.fit(1)
            k = min(n, self.n_windows - self.epochs.cursor)
            out.append(self.epochs.take(k))
            self.served, n = self.served + k, n - k
        return np.concatenate(out) if out else np.empty(0, np.int64)

    def window(self, i: int) -> np.ndarray:
        t = self.seq_len
        return self.tokens[i * t : i * t + t + 1]


class MixedBatches:
    """Batches of (inputs, labels) [B, T] drawn from weighted sources: a `BatchStream`
    (`data/stream.py`), as one stream is; its position is (0, batch index)."""

    def __init__(
        self,
        streams: dict[str, np.ndarray],
        seq_len: int,
        batch_size: int,
        seed: int,
        stages: list[Stage],
    ) -> None:
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.sources = [_Source(name, t, seq_len, seed) for name, t in streams.items()]
        self.streams = streams
        self.stages = sorted(stages, key=lambda s: s.start)
        self.n_windows = sum(s.n_windows for s in self.sources)
        self.step = 0  # batches dealt
        self.stage_counts = [0] * len(self.sources)  # windows of each source in this stage
        self._excluded: set[Position] = set()
        self.position: Position | None = None

    # ------------------------------------------------------------------ serving

    def _weights(self, step: int) -> np.ndarray:
        stage = [s for s in self.stages if s.start <= step][-1]
        w = np.array([stage.weights.get(s.name, 0.0) for s in self.sources], dtype=np.float64)
        return w / w.sum()

    def _stage_start(self, step: int) -> int:
        return [s for s in self.stages if s.start <= step][-1].start

    def _deal(self) -> list[tuple[int, int]]:
        """One global batch: (source index, window) for each of its rows; advances the state."""
        if self.step and self._stage_start(self.step) == self.step:
            self.stage_counts = [0] * len(self.sources)  # a stage begins: its own count
        weights = self._weights(self.step).tolist()
        counts = list(self.stage_counts)
        dealt = sum(counts)
        used = [i for i, w in enumerate(weights) if w > 0]
        delta = 1 / (2 * (len(used) - 1)) if len(used) > 1 else 0.0
        order = []  # the source of each row, in row order
        for _ in range(self.batch_size):
            dealt += 1
            released = [i for i in used if weights[i] * dealt >= counts[i] + delta - 1e-9]
            if released:
                s = min(released, key=lambda i: ((counts[i] + 1 - delta) / weights[i], i))
            else:  # not reached (Tijdeman), kept as a guard
                s = max(used, key=lambda i: (weights[i] * dealt - counts[i], -i))
            counts[s] += 1
            order.append(s)
        taken = {s: iter(self.sources[s].take(order.count(s)).tolist()) for s in set(order)}
        rows = [(s, next(taken[s])) for s in order]
        self.stage_counts = [int(c) for c in counts]
        self.step += 1
        return rows

    def next_batch(self, rank: int = 0, world: int = 1) -> Batch:
        rows_of_rank = self._rows(rank, world)
        rows = self._deal()
        while (0, self.step - 1) in self._excluded:
            rows = self._deal()
        self.position = (0, self.step - 1)
        mine = rows[rows_of_rank]
        stacked = np.stack([self.sources[s].window(w) for s, w in mine]).astype(np.int64)
        return Batch(
            torch.from_numpy(stacked[:, :-1].copy()), torch.from_numpy(stacked[:, 1:].copy())
        )

    def iter_eval(self, n_batches: int, rank: int = 0, world: int = 1) -> Iterator[Batch]:
        """The mixture's first `n_batches` batches (as a new run deals them): the same every
        call, this loader's state untouched (`depthscale trace depth` reads one)."""
        fresh = MixedBatches(self.streams, self.seq_len, self.batch_size, self.seed, self.stages)
        for _ in range(n_batches):
            yield fresh.next_batch(rank, world)

    def _rows(self, rank: int, world: int) -> slice:
        return rank_rows(self.batch_size, rank, world)

    # ------------------------------------------------------------------ state

    def exclude(self, positions: Iterable[Position]) -> None:
        self._excluded.update(positions)

    def metrics(self, state: dict[str, Any]) -> dict[str, float]:
        """`tokens/<name>` and `epoch/<name>` of every source at `state`."""
        return mixture_metrics(state, self.seq_len)

    def state_dict(self) -> dict[str, Any]:
        return {
            "order": ORDER,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "step": self.step,
            "stage_counts": list(self.stage_counts),
            "sources": {
                s.name: {
                    "epoch": s.epochs.epoch,
                    "cursor": s.epochs.cursor,
                    "served": s.served,
                    "n_windows": s.n_windows,
                }
                for s in self.sources
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume every source where it was; refuses a state of another mixture or stream."""
        mine = self.state_dict()
        if state.get("order") != ORDER:
            raise DataError(
                "cannot resume the data stream: the checkpoint's data state is not a mixture's "
                "(data.sources changed since it was written)"
            )
        diffs = [
            f"{k}: saved {state[k]!r}, now {mine[k]!r}"
            for k in ("seed", "seq_len")
            if state[k] != mine[k]
        ]
        if list(state["sources"]) != list(mine["sources"]):
            diffs.append(f"sources: saved {list(state['sources'])}, now {list(mine['sources'])}")
        else:
            diffs += [
                f"source {name!r} windows: saved {saved['n_windows']}, now "
                f"{mine['sources'][name]['n_windows']}"
                for name, saved in state["sources"].items()
                if saved["n_windows"] != mine["sources"][name]["n_windows"]
            ]
        if diffs:
            raise DataError(
                "cannot resume the data stream: it differs from the saved one ("
                + "; ".join(diffs)
                + "); a source's corpus, the tokenizer, seq_len or the seed changed"
            )
        self.step = int(state["step"])
        self.stage_counts = [int(c) for c in state["stage_counts"]]
        for s in self.sources:
            saved = state["sources"][s.name]
            s.epochs.epoch, s.epochs.cursor, s.served = (
                int(saved["epoch"]),
                int(saved["cursor"]),
                int(saved["served"]),
            )

    # ------------------------------------------------------------------ accounting

    def check_epochs(self, steps: int, max_epochs: dict[str, float]) -> None:
        """Refuse a run whose schedule serves a source more epochs than its max_epochs: per
        stage, a source serves at most ⌈w·windows⌉ + 1 windows."""
        ends = [s.start for s in self.stages[1:]] + [steps]
        need = [0.0] * len(self.sources)
        for stage, end in zip(self.stages, ends):
            length = min(end, steps) - stage.start  # batches dealt with its weights
            if length <= 0:
                continue
            w = self._weights(stage.start)
            for i in range(len(self.sources)):
                if w[i] > 0:
                    need[i] += math.ceil(w[i] * length * self.batch_size) + 1
        for i, s in enumerate(self.sources):
            limit = max_epochs.get(s.name, 0.0)
            epochs = need[i] / s.n_windows
            if limit and epochs > limit:
                raise DataError(
                    f"data source {s.name!r}: the schedule serves up to {int(need[i])} of its "
                    f"{s.n_windows} windows ({epochs:.2f} epochs) over train.steps={steps}, "
                    f"beyond its max_epochs={limit:g}; allowed: a smaller weight, fewer steps, "
                    "a larger source or a larger max_epochs"
                )


def mixture_metrics(state: dict[str, Any], seq_len: int) -> dict[str, float]:
    """`tokens/<name>` (label tokens served so far) and `epoch/<name>` (epochs begun, from 0) of
    every source, from a mixture's state (`MixedBatches.state_dict`); {} for one stream."""
    if state.get("order") != ORDER:
        return {}
    out: dict[str, float] = {}
    for name, s in state["sources"].items():
        out[f"tokens/{name}"] = s["served"] * seq_len
        out[f"epoch/{name}"] = s["epoch"]
    return out


__all__ = ["MixedBatches", "Stage", "mixture_metrics"]
