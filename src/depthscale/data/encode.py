"""Documents to token ids: the stream every corpus becomes (each document followed by EOS), in
pieces of about `_CHUNK_CHARS` of text, and the .npy writer that stores one without holding it
(the tokenization cache, `depthscale tokenize`'s shards)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import chain
from typing import BinaryIO

import numpy as np

from depthscale.data.tokenizer import ByteTokenizer, Tokenizer

_CHUNK_CHARS = 1 << 22  # documents are encoded in batches of about this much text


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest stream dtype that holds every id: half the memory of uint32 for most vocabs."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


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


def write_npy_stream(f: BinaryIO, dtype: np.dtype, pieces: Iterable[np.ndarray]) -> None:
    """Write pieces as one 1-D .npy array without holding it: the header is written first with
    length 0 and rewritten at the end (numpy pads headers so that the length can grow in place)."""
    header = {
        "descr": np.lib.format.dtype_to_descr(dtype),
        "fortran_order": False,
        "shape": (0,),
    }
    np.lib.format.write_array_header_1_0(f, header)
    data_start, n = f.tell(), 0
    for piece in pieces:
        f.write(piece.astype(dtype, copy=False).tobytes())
        n += len(piece)
    f.seek(0)
    np.lib.format.write_array_header_1_0(f, header | {"shape": (n,)})
    if f.tell() != data_start:
        raise AssertionError("the .npy header changed length")  # numpy reserves room for it


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


__all__ = ["encode_documents", "token_dtype", "write_npy_stream"]
