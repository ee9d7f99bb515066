"""Every rank must train on the same data: one tokenizer, one token stream, one order of windows.

Each node builds its own data (`train/setup.py`: local rank 0 tokenises into the node's cache), so
two nodes can disagree without anyone noticing: a corpus that differs between their file systems,
a cache built from an older copy, a tokenizer trained twice. Data-parallel ranks would then sample
different streams and average gradients of different data. After the data is built, every rank
states what it has (`data_identity`) and all compare (`check_ranks_agree`): a difference stops the
run before the first step, naming the ranks.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch.distributed as dist

from depthscale.data.loader import DataBundle
from depthscale.errors import DataError

_SAMPLES = 4096
_ENDS = 4096


def stream_digest(tokens: np.ndarray) -> str:
    """A digest of a token stream in O(1): its length, dtype, first and last tokens and tokens at
    evenly spaced positions. A full hash would read the whole corpus on every start (minutes at a
    trillion tokens); two different corpora differ in this one with near certainty."""
    n = len(tokens)
    h = hashlib.sha256(f"{n}:{tokens.dtype.str}".encode())
    if n:
        positions = np.linspace(0, n - 1, num=min(n, _SAMPLES), dtype=np.int64)
        for part in (tokens[:_ENDS], tokens[max(n - _ENDS, 0) :], tokens[positions]):
            h.update(np.ascontiguousarray(part, dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


def data_identity(data: DataBundle, seed: int) -> dict[str, Any]:
    """What must be equal on every rank, field by field (named in the error)."""
    return {
        "tokenizer": data.tokenizer.label,
        "train windows": data.train.n_windows,
        "train tokens": _train_digest(data.train),
        "validation windows": data.val.n_windows if data.val is not None else 0,
        "validation tokens": stream_digest(data.val.tokens) if data.val is not None else "-",
        "eval sets": {k: stream_digest(v.tokens) for k, v in data.eval_sets.items()},
        "data seed": seed,
    }


def _train_digest(train) -> str:
    """One stream's digest, or a mixture's sources' in order (name: digest)."""
    streams = getattr(train, "streams", None)
    if streams is None:
        return stream_digest(train.tokens)
    return " ".join(f"{name}:{stream_digest(t)}" for name, t in streams.items())


def check_ranks_agree(mine: dict[str, Any]) -> None:
    """Raise DataError on every rank if any rank's data identity differs from rank 0's."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    reference = everyone[0]
    differing = {
        rank: [key for key in reference if theirs.get(key) != reference[key]]
        for rank, theirs in enumerate(everyone)
    }
    differing = {rank: keys for rank, keys in differing.items() if keys}
    if not differing:
        return
    lines = []
    for rank, keys in list(differing.items())[:8]:
        diffs = ", ".join(f"{k} {everyone[rank][k]!r} (rank 0: {reference[k]!r})" for k in keys)
        lines.append(f"rank {rank}: {diffs}")
    more = f"; and {len(differing) - 8} more ranks" if len(differing) > 8 else ""
    raise DataError(
        f"the ranks do not have the same data; {len(differing)} of {len(everyone)} differ from "
        f"rank 0 — " + "; ".join(lines) + more + ". Every node builds its data from data.path "
        "with data.tokenizer into its cache (data.cache_dir): give every node the same corpus "
        "and tokenizer, or a cache on a shared file system"
    )
