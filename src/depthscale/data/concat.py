"""One read-only token sequence over several arrays (shards, a mixture's held-out ends), without
copying them: a window that crosses from one part into the next is joined when it is read.

It offers what the data path reads of a token stream: its length and dtype, slices (a view, or
the part's own slice when it lies in one part), integer-array indexing (`data/agreement.py`'s
samples), `max()` and conversion to an array (`np.asarray`, which `np.stack` uses).
"""

from __future__ import annotations

import numpy as np


class ConcatTokens:
    def __init__(self, parts: list[np.ndarray], start: int = 0, stop: int | None = None) -> None:
        self.parts = [p for p in parts if len(p)]
        self._ends = np.cumsum([len(p) for p in self.parts], dtype=np.int64)
        total = int(self._ends[-1]) if len(self._ends) else 0
        self.start, self.stop = start, total if stop is None else stop
        self.dtype = np.result_type(*[p.dtype for p in self.parts]) if self.parts else np.uint16
        self.dtype = np.dtype(self.dtype)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    ndim = 1

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, key):
        if isinstance(key, slice):
            first, last, step = key.indices(len(self))
            if step != 1:
                raise IndexError("token sequences take contiguous slices only")
            first, last = self.start + first, self.start + max(first, last)
            part = int(np.searchsorted(self._ends, first, side="right"))
            if part < len(self.parts) and last <= self._ends[part]:  # inside one part
                base = int(self._ends[part] - len(self.parts[part]))
                return self.parts[part][first - base : last - base]
            return ConcatTokens(self.parts, first, last)
        positions = np.asarray(key, dtype=np.int64) + self.start
        if positions.size and (positions.min() < self.start or positions.max() >= self.stop):
            raise IndexError(f"a position outside a token sequence of {len(self)}")
        part = np.searchsorted(self._ends, positions, side="right")
        out = np.empty(positions.shape, self.dtype)
        for p in np.unique(part):
            at = part == p
            base = int(self._ends[p] - len(self.parts[p]))
            out[at] = self.parts[p][positions[at] - base]
        return out

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        pieces = [self[a:b] for a, b in self._spans()]  # each inside one part: a numpy slice
        if not pieces:
            return np.empty(0, dtype or self.dtype)
        out = np.concatenate(pieces).astype(self.dtype, copy=False)
        return out if dtype is None else out.astype(dtype, copy=False)

    def max(self) -> int:
        """The largest id (reads every part in range once)."""
        if not len(self):
            raise ValueError("max() of an empty token sequence")
        return max(int(self[a:b].max()) for a, b in self._spans())

    def _spans(self) -> list[tuple[int, int]]:
        """(first, last) offsets of this view's piece in each part, relative to the view."""
        spans, at = [], self.start
        while at < self.stop:
            part = int(np.searchsorted(self._ends, at, side="right"))
            end = min(self.stop, int(self._ends[part]))
            spans.append((at - self.start, end - self.start))
            at = end
        return spans


__all__ = ["ConcatTokens"]
