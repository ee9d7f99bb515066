"""Token files as the training stream: documents each followed by the chosen EOS, back to back.

`data.path` names one token file, a directory of them (one source: its parts in name order, each
read as it would be alone by its format's reader, `data/formats.py` and `data/token_parts.py`,
joined without copying by `data/concat.py`), or `depthscale tokenize` shards.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from depthscale.config import DataConfig
from depthscale.data.concat import ConcatTokens
from depthscale.data.formats import format_of
from depthscale.data.shards import read_shards
from depthscale.data.sources import corpus_files, token_format
from depthscale.data.tokenizer import Tokenizer


def token_stream(cfg: DataConfig, tokenizer: Tokenizer) -> np.ndarray | ConcatTokens:
    """The token stream of `data.path` (a token file, a directory of them, or shards)."""
    kind = token_format(cfg)
    if kind == "shards":
        return read_shards(Path(cfg.path).expanduser(), tokenizer)
    parts = corpus_files(cfg) if kind == "parts" else corpus_files(cfg)[:1]
    streams = [
        format_of(p).read(dataclasses.replace(cfg, path=str(p)), p, tokenizer) for p in parts
    ]
    return streams[0] if len(streams) == 1 else ConcatTokens(streams)


__all__ = ["token_stream"]
