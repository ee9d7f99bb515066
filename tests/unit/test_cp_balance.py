"""Context-parallel chunks balanced by attention work over packed documents (`cp_balance.py`):
the work count against a brute-force count of visible (query, key) pairs, the layout's
invariants (equal shards, a partition, positions in order, the inverse), and its balance against
zigzag on rows where zigzag is unbalanced."""

import pytest
import torch

from depthscale.model.documents import DocumentPacking, Documents
from depthscale.model.layers import attention_mask
from depthscale.parallel.cp_balance import (
    LAYOUT_KEY,
    Balancing,
    assign,
    chunk_count,
    layout_for,
    query_work,
)
from depthscale.parallel.sequence_layout import SequenceShard, positions_for, shard_sequence

EOS = 1


def _rows(B: int, T: int, seed: int, p_eos: float = 0.05) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(2, 50, (B, T), generator=g)
    tokens[torch.rand(B, T, generator=g) < p_eos] = EOS
    return tokens


def _brute_work(tokens: torch.Tensor, window: int) -> torch.Tensor:
    """Visible (query, key) pairs per position, summed over rows: causal ∧ window ∧ document."""
    T = tokens.shape[1]
    docs = Documents.of(tokens, EOS)
    pos = torch.arange(T)
    seen = attention_mask(pos, pos, window) & docs.same_document(pos, pos)[:, 0]
    return seen.sum(-1).sum(0).double()


@pytest.mark.parametrize("window", [0, 1, 7])
def test_query_work_counts_the_visible_pairs(window):
    tokens = _rows(3, 64, seed=1, p_eos=0.1)
    starts = Documents.of(tokens, EOS).host_starts
    assert torch.equal(query_work(starts, 64, window), _brute_work(tokens, window))
    one = torch.full((1, 64), 5)  # no boundary: one causal sequence
    assert torch.equal(query_work(None, 64, window), _brute_work(one, window))


def test_chunk_count_is_the_finest_that_keeps_chunks_long_enough():
    assert chunk_count(8192, 8, 64) == 128  # 64-token chunks
    assert chunk_count(8192, 4, 100) == 64  # 128: the largest divisor of 1024 >= 100
    assert chunk_count(24, 2, 64) == 4  # too short for finer: zigzag's chunks
    assert chunk_count(24, 2, 2) == 12
    with pytest.raises(ValueError, match="multiple of 2·cp"):
        chunk_count(30, 2, 1)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_layout_is_an_equal_partition_in_position_order_with_its_inverse(cp):
    T, window = 48 * cp, 5
    tokens = _rows(2, T, seed=cp)
    starts = Documents.of(tokens, EOS).host_starts
    layout = layout_for(starts, T, cp, window, min_chunk=4)
    positions = [layout.positions(r, T) for r in range(cp)]
    assert all(p.numel() == T // cp for p in positions)
    assert all(bool((p[1:] > p[:-1]).all()) for p in positions)
    assert torch.equal(torch.cat(positions).sort().values, torch.arange(T))
    shards = [layout.shard(tokens, r) for r in range(cp)]
    assert all(torch.equal(s, tokens[:, p]) for s, p in zip(shards, positions))
    assert torch.equal(layout.unshard(shards), tokens)
    work = query_work(starts, T, window)
    assert [float(work[p].sum()) for p in positions] == list(layout.work)


def test_balanced_beats_zigzag_where_documents_unbalance_it():
    """Short documents first, one long one last: zigzag's rank 0 holds the first chunk (cheap)
    and the last (the long document's end: costly) — the imbalance issue #55 describes."""
    T, cp = 512, 4
    tokens = torch.full((1, T), 7)
    tokens[0, :256:8] = EOS  # 32 documents of 8 tokens, then one of 256
    starts = Documents.of(tokens, EOS).host_starts
    for window in (0, 64):
        zigzag = layout_for(starts, T, cp, window, balance="zigzag")
        balanced = layout_for(starts, T, cp, window, min_chunk=8)
        assert zigzag.imbalance > 1.09  # 1.68 causal, 1.10 with the window
        assert balanced.imbalance <= 1.05
        assert sum(balanced.work) == sum(zigzag.work)  # the same work, spread differently


def test_rows_without_boundaries_keep_zigzag():
    T, cp = 256, 4
    layout = layout_for(None, T, cp, 0, min_chunk=8)
    assert layout.imbalance == 1.0
    for r in range(cp):
        assert torch.equal(layout.positions(r, T), positions_for(T, r, cp, "zigzag"))


def test_assign_gives_every_rank_its_share_of_chunks():
    work = torch.rand(24, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    chunks = assign(work, 4)
    assert sorted(c for rank in chunks for c in rank) == list(range(24))
    assert all(len(rank) == 6 for rank in chunks)
    loads = [float(work[rank].sum()) for rank in chunks]
    assert max(loads) / (sum(loads) / 4) < 1.05


def test_sequence_shard_lays_out_with_the_documents_and_measures_the_work():
    B, T, cp = 2, 40, 2  # padded to 40 (a multiple of 2·cp)
    tokens, labels = _rows(B, T, seed=5, p_eos=0.1), _rows(B, T, seed=6)
    packing = DocumentPacking(EOS)
    balancing = Balancing("documents", window=0, min_chunk=2)
    pieces = [SequenceShard(r, cp, packing, balancing)(tokens, labels) for r in range(cp)]
    layout = pieces[0].documents.cache[LAYOUT_KEY]
    assert layout.n_chunks == 20
    assert torch.equal(layout.unshard([p.tokens for p in pieces]), tokens)
    assert torch.equal(layout.unshard([p.labels for p in pieces]), labels)
    assert all(torch.equal(p.positions, layout.positions(r, T)) for r, p in enumerate(pieces))
    zigzag = layout_for(Documents.of(tokens, EOS).host_starts, T, cp, balance="zigzag")
    assert layout.imbalance <= zigzag.imbalance
    assert balancing.take_imbalance() == pytest.approx(layout.imbalance)  # both ranks measured
    assert balancing.take_imbalance() is None  # taken: reset
    SequenceShard(0, cp, packing, balancing)(tokens, labels)
    balancing.reset()  # what a step does first: evaluation's or a retry's work is not its own
    assert balancing.take_imbalance() is None

    plain = SequenceShard(1, cp, None, Balancing("documents"))(tokens, labels)
    assert torch.equal(plain.tokens, shard_sequence(tokens, 1, cp))  # no documents: zigzag
    with pytest.raises(ValueError, match="allowed: zigzag, documents"):
        Balancing("even")
