"""Named held-out sets (`[[eval.sets]]`): corpora of their own, evaluated whole-window like the
held-out end of the training data, and the bytes each evaluated token stands for, from which a
loss becomes bits per byte (comparable across tokenizers)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from depthscale.config import DataConfig
from depthscale.data.loader import DataBundle, held_out_batches, tokenize_corpus
from depthscale.data.sources import checked_source
from depthscale.data.stream import BatchStream
from depthscale.data.tokenizer import Tokenizer


def attach_eval_sets(
    data: DataBundle,
    cfg: DataConfig,
    sets: list,
    seed: int,
    batch_size: int,
    ranks: int,
    progress: Callable[[int], None] | None = None,
) -> DataBundle:
    """`data` with every [[eval.sets]] entry tokenized (cached, as a corpus is) into batches: an
    entry is read as a mixture's source is, any format of `data/formats.py`, and whole."""
    for i, entry in enumerate(sets):
        set_cfg = checked_source(cfg, entry, f"eval.sets[{i}]")
        set_cfg = dataclasses.replace(set_cfg, max_bytes=0)  # read whole
        tokens = tokenize_corpus(set_cfg, data.tokenizer, progress)
        data.eval_sets[entry.name] = held_out_batches(
            tokens, cfg.seq_len, batch_size, ranks, seed,
            f"eval set {entry.name!r} ({entry.path})", "give it more text or fewer ranks",
        )  # fmt: skip
    return data


def bytes_per_token(batches: BatchStream, n_batches: int, tokenizer: Tokenizer) -> float:
    """UTF-8 bytes of text per label token of the first `n_batches` evaluation batches (the ones
    evaluated): decoded window by window; EOS stands for no bytes."""
    tokens = text = 0
    for _, labels in batches.iter_eval(n_batches):
        for row in labels.tolist():
            tokens += len(row)
            text += len(tokenizer.decode(row).encode("utf-8"))
    return text / tokens if tokens else math.nan


def bits_per_byte(loss: float, per_token: float) -> float:
    """A mean loss in nats per token as bits per byte of text."""
    return loss / math.log(2) / per_token if per_token > 0 else math.nan


__all__ = ["attach_eval_sets", "bits_per_byte", "bytes_per_token"]
