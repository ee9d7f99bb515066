"""Ranks that do not hold the same data stop before the first step, naming themselves
(`data/agreement.py`): each node builds its own data, so a corpus or tokenizer that differs
between nodes would otherwise train silently on different streams."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from depthscale.config import DataConfig
from depthscale.data.agreement import check_ranks_agree, data_identity
from depthscale.data.loader import build_data
from depthscale.errors import DataError


def _corpus(path, variant: int) -> str:
    path.write_text("".join(f"line {i}: the quick brown fox {i * (7 + variant)}\n" for i in range(400)))
    return str(path)


def _agree(root: str, differ: str | None) -> str:
    """Each rank builds its data (rank 1 with `differ` changed), then all compare."""
    from pathlib import Path

    rank = dist.get_rank()
    variant = int(rank == 1 and differ == "corpus")
    corpus = _corpus(Path(root) / f"corpus{rank}.txt", variant)
    tokenizer = "bpe" if rank == 1 and differ == "tokenizer" else "byte"
    cfg = DataConfig(
        path=corpus, seq_len=16, tokenizer=tokenizer, bpe_vocab_size=300, cache_dir=f"{root}/cache{rank}"
    )
    data = build_data(cfg, seed=0, batch_size=4, ranks=2)
    try:
        check_ranks_agree(data_identity(data, seed=0))
    except DataError as err:
        return str(err)
    return "agreed"


def test_ranks_with_the_same_data_agree(dist_pool, tmp_path):
    assert dist_pool(2).run(_agree, str(tmp_path), None) == ["agreed", "agreed"]


@pytest.mark.parametrize("differ", ["corpus", "tokenizer"])
def test_a_rank_with_other_data_stops_every_rank_naming_it(dist_pool, tmp_path, differ):
    messages = dist_pool(2).run(_agree, str(tmp_path), differ)
    assert messages[0] == messages[1]  # every rank stops, with the same message
    message = messages[0]
    assert "the ranks do not have the same data; 1 of 2 differ from rank 0" in message
    assert "rank 1:" in message
    if differ == "tokenizer":
        assert "tokenizer 'bpe" in message and "(rank 0: 'byte" in message
    else:
        assert "train tokens" in message
    assert "same corpus and tokenizer" in message
