"""The order in which an epoch visits the windows: a seeded bijection of [0, n) computed per index.

A stored permutation costs 8 bytes per window on every rank (3.9 GB at a trillion tokens of
sequence 2048) and is redrawn each epoch. Here the order is a function: window `order(i)` is the
i-th visited, computed from (seed, epoch, i) alone, so the loader's state is (epoch, cursor)
whatever the corpus size, and any position is reached in O(1).

The bijection is a Feistel network over the smallest even-bit-width domain [0, 2^k) ⊇ [0, n)
(six rounds, each mixing one half with splitmix64 under a key drawn from seed, epoch and round),
restricted to [0, n) by cycle walking: an index that lands outside [0, n) is encrypted again
until it lands inside. That stays a bijection of [0, n), and since 2^k < 4n, the expected walk is
under four encryptions.
"""

from __future__ import annotations

import numpy as np

ROUNDS = 6
_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _splitmix64(x: int) -> int:
    """One step of splitmix64 on a Python int (round keys)."""
    x = (x + _GOLDEN) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over uint64 arrays (wrapping multiplication)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class WindowOrder:
    """order[i] for i in [0, n): the window visited i-th in one epoch of a seeded shuffle."""

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        if n < 1:
            raise ValueError(f"an order over {n} windows")
        self.n, self.epoch = n, epoch
        bits = max(2, (n - 1).bit_length())
        bits += bits % 2
        self._half = np.uint64(bits // 2)
        self._mask = np.uint64((1 << (bits // 2)) - 1)
        key = _splitmix64(seed & _M64) ^ _splitmix64((epoch + 1) * _GOLDEN & _M64)
        self._keys = []
        for _ in range(ROUNDS):
            key = _splitmix64(key)
            self._keys.append(np.uint64(key))

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self._half, x & self._mask
        for key in self._keys:
            left, right = right, left ^ (_mix(right ^ key) & self._mask)
        return (left << self._half) | right

    def __getitem__(self, positions: np.ndarray | slice) -> np.ndarray:
        """The windows at these positions of the epoch's order (int64)."""
        if isinstance(positions, slice):
            positions = np.arange(*positions.indices(self.n))
        x = np.asarray(positions, dtype=np.uint64)
        if x.size and int(x.max()) >= self.n:
            raise IndexError(f"position {int(x.max())} of an order over {self.n} windows")
        with np.errstate(over="ignore"):
            y = self._encrypt(x)
            outside = y >= np.uint64(self.n)
            while outside.any():
                y[outside] = self._encrypt(y[outside])
                outside = y >= np.uint64(self.n)
        return y.astype(np.int64)


class EpochCursor:
    """A place (epoch, cursor) in the epochs of seeded orders over `n` windows: the whole state of
    one stream (`loader.PackedBatches`) and of each source of a mixture (`mixture.MixedBatches`),
    O(1) whatever the corpus. Epoch e visits the windows in `WindowOrder(n, seed, e)`."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed = n, seed
        self.epoch = self.cursor = 0
        self._order: WindowOrder | None = None

    def fit(self, k: int) -> None:
        """Start the next epoch if fewer than `k` windows are left in this one (a stream of
        whole batches passes over the rest, a different few each epoch)."""
        if self.cursor + k > self.n:
            self.epoch, self.cursor = self.epoch + 1, 0

    def take(self, k: int) -> np.ndarray:
        """The next `k` windows of this epoch's order (at most what is left of it)."""
        if self._order is None or self._order.epoch != self.epoch:
            self._order = WindowOrder(self.n, self.seed, self.epoch)
        windows = self._order[self.cursor : self.cursor + k]
        self.cursor += k
        return windows


def rank_rows(batch_size: int, rank: int, world: int) -> slice:
    """The contiguous rows of a global batch that data-parallel `rank` of `world` trains on: the
    ranks' rows in rank order are the one-process batch, so any degree sees the same data."""
    if world < 1 or not 0 <= rank < world or batch_size % world:
        raise ValueError(
            f"rank={rank}, world={world}: need 0 <= rank < world and world "
            f"dividing batch_size={batch_size}"
        )
    per_rank = batch_size // world
    return slice(rank * per_rank, (rank + 1) * per_rank)
