"""The data order (`data/order.py`): a bijection per (seed, epoch), computed per position, so the
loader's state and memory do not grow with the corpus; and the streamed token cache."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from depthscale.data.loader import PackedBatches
from depthscale.data.order import WindowOrder
from depthscale.data.token_files import write_npy_stream


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 100, 1000, 4097, 65_537])
def test_the_order_visits_every_window_once(n):
    order = WindowOrder(n, seed=3, epoch=1)[0:n]
    assert sorted(order.tolist()) == list(range(n))


def test_the_order_depends_on_seed_and_epoch_and_only_on_them():
    n = 10_000
    base = WindowOrder(n, seed=0, epoch=0)[0:n]
    assert np.array_equal(base, WindowOrder(n, seed=0, epoch=0)[0:n])  # reproducible
    for other in (WindowOrder(n, 1, 0), WindowOrder(n, 0, 1)):
        # two independent shuffles of 10,000 share ~1 fixed position on average
        assert (other[0:n] == base).sum() < 20
    # a shuffle, not a shift: neighbours in the order are not neighbours in the stream
    assert np.abs(np.diff(base)).mean() > n / 10


def test_any_position_is_computed_alone():
    order = WindowOrder(1_000_003, seed=5, epoch=2)
    whole = order[0:1_000_003]
    picks = np.array([0, 17, 999_999, 1_000_002])
    assert np.array_equal(order[picks], whole[picks])
    with pytest.raises(IndexError):
        order[np.array([1_000_003])]


def test_loader_state_and_memory_do_not_grow_with_the_corpus():
    sizes = {}
    for n_tokens in (10_000, 10_000_000):
        tokens = np.zeros(n_tokens, np.uint16)
        loader = PackedBatches(tokens, seq_len=16, batch_size=4, seed=0)
        loader.next_batch()
        state = loader.state_dict()
        assert all(isinstance(v, int | str) for v in state.values())  # scalars only
        sizes[n_tokens] = len(pickle.dumps(state))
        kept = [*vars(loader).values(), *vars(loader.epochs).values()]
        held = [v for v in kept if isinstance(v, np.ndarray) and v is not tokens]
        assert held == []  # nothing per window: no permutation
        assert all(
            not isinstance(v, np.ndarray) for v in vars(loader.epochs._order).values()
        )  # the order holds keys, not indices
    assert abs(sizes[10_000] - sizes[10_000_000]) <= 8  # the digits of n_windows


def test_resume_continues_the_same_batches_across_epochs():
    tokens = np.arange(16 * 13 + 1, dtype=np.uint16)  # 13 windows: 3 batches of 4 per epoch
    ref = PackedBatches(tokens, 16, 4, seed=9)
    expected = [ref.next_batch()[0] for _ in range(8)]
    first = PackedBatches(tokens, 16, 4, seed=9)
    got = [first.next_batch()[0] for _ in range(4)]
    second = PackedBatches(tokens, 16, 4, seed=9)
    second.load_state_dict(first.state_dict())
    got += [second.next_batch()[0] for _ in range(4)]
    assert all((a == b).all() for a, b in zip(got, expected))


def test_a_state_saved_under_the_old_permutation_is_refused():
    from depthscale.errors import DataError

    loader = PackedBatches(np.zeros(1000, np.uint16), 16, 4)
    old = {k: v for k, v in loader.state_dict().items() if k != "order"}
    with pytest.raises(DataError, match="order: saved 'permutation', now 'feistel-6'"):
        loader.load_state_dict(old)


def test_the_token_cache_is_written_a_piece_at_a_time(tmp_path):
    pieces = [np.arange(i * 1000, (i + 1) * 1000, dtype=np.uint32) for i in range(5)]
    path = tmp_path / "t.npy"
    with path.open("wb") as f:
        write_npy_stream(f, np.dtype(np.uint32), iter(pieces))
    loaded = np.load(path, mmap_mode="r")
    assert loaded.dtype == np.uint32 and np.array_equal(loaded, np.concatenate(pieces))
    with path.open("wb") as f:
        write_npy_stream(f, np.dtype(np.uint16), iter([]))
    assert np.load(path).shape == (0,)
