"""Documents to token ids: the stream every corpus becomes (each document followed by EOS), in
pieces of about `_CHUNK_CHARS` of text (`token_files.write_npy_stream` stores one without holding
it: the tokenization cache, `depthscale tokenize`'s shards)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import chain

import numpy as np

from depthscale.data.token_files import token_dtype
from depthscale.data.tokenizer import ByteTokenizer, Tokenizer

_CHUNK_CHARS = 1 << 22  # documents are encoded in batches of about this much text


def encode_documents(
    docs: Iterable[str], tokenizer: Tokenizer, progress: Callable[[int], None] | None = None
) -> Iterator[np.ndarray]:
    """Encode documents into consecutive pieces of one stream, EOS after each document (bytes
    take a vectorised fast path); a piece holds about `_CHUNK_CHARS` of text. `progress(n)` is
    told each piece's token count (a supervised worker's heartbeat: tokenizing is progress)."""
    dtype = token_dtype(tokenizer.vocab_size)
    for chunk in _chunks(docs):
        piece = _encode_chunk(chunk, tokenizer, dtype)
        if progress is not None:
            progress(len(piece))
        yield piece


def _chunks(docs: Iterable[str]) -> Iterator[list[str]]:
    chunk: list[str] = []
    size = 0
    for doc in docs:
        chunk.append(doc)
        size += len(doc)
        if size >= _CHUNK_CHARS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _encode_chunk(docs: Sequence[str], tokenizer: Tokenizer, dtype: np.dtype) -> np.ndarray:
    if isinstance(tokenizer, ByteTokenizer):
        encoded = [d.encode("utf-8", errors="replace") for d in docs]
        lengths = np.fromiter(map(len, encoded), np.int64, len(encoded))
        flat = np.frombuffer(b"".join(encoded), np.uint8)
    else:
        ids = tokenizer.encode_batch(docs)
        lengths = np.fromiter(map(len, ids), np.int64, len(ids))
        flat = np.fromiter(chain.from_iterable(ids), dtype, int(lengths.sum()))
    ends = np.cumsum(lengths + 1) - 1  # where each document's EOS goes
    out = np.empty(int(ends[-1]) + 1, dtype)
    is_text = np.ones(len(out), bool)
    is_text[ends] = False
    out[is_text] = flat
    out[ends] = tokenizer.eos_id
    return out


__all__ = ["encode_documents"]
