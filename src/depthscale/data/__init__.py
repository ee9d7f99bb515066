"""Data: corpus readers (`sources`), tokenizers (`tokenizer`), and the cached, packed, resumable
batch streams the trainer consumes (`loader.build_data`)."""

from depthscale.data.loader import (
    DataBundle,
    PackedBatches,
    build_data,
    split_stream,
    tokenize_corpus,
)
from depthscale.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    build_tokenizer,
    load_tokenizer,
    train_bpe,
)

__all__ = [
    "ByteTokenizer",
    "DataBundle",
    "HFTokenizer",
    "PackedBatches",
    "Tokenizer",
    "build_data",
    "build_tokenizer",
    "load_tokenizer",
    "split_stream",
    "tokenize_corpus",
    "train_bpe",
]
