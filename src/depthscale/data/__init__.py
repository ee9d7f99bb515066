"""Data: corpus readers (`sources`), tokenizers (`tokenizer`), and the cached, packed, resumable
batch streams the trainer consumes (`loader.build_data`).

The names below are imported when first used: the tokenizers need no torch, and `depthscale plan`
reads a tokenizer's vocabulary without paying for torch's import (the loader's batches are
tensors)."""

from importlib import import_module

_HOMES = {
    "DataBundle": "loader",
    "PackedBatches": "loader",
    "build_data": "loader",
    "split_stream": "loader",
    "tokenize_corpus": "loader",
    "ByteTokenizer": "tokenizer",
    "HFTokenizer": "tokenizer",
    "Tokenizer": "tokenizer",
    "build_tokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
    "train_bpe": "tokenizer",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_HOMES[name]}"), name)
