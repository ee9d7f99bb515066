"""Each token format's reader: one token file (a part) as a stream of documents each followed by
the chosen EOS, back to back (`data/formats.py` says which reader reads which file;
`data/token_files.py` parses the formats):

- depthscale's `.bin`, OLMo / Dolma arrays: the stream itself, memory-mapped;
- datatrove `.ds`: memory-mapped where its documents end in EOS (the pipeline's `eos_token`);
  where they do not, each is given one, written into the cache once, as for
- Megatron pairs: joined document for document, each ended by EOS, into the cache once.

A reader is `read(cfg, path, tokenizer) -> np.ndarray`, `cfg.path` being that file.

A file whose documents all end in another special token than the chosen EOS (say Megatron's
`--append-eod` with a chat tokenizer's `<|im_end|>`, read with EOS `<|endoftext|>`) was written
with another EOS: it is named before training, with the `data.eos_token` that reads it, rather
than given a second EOS per document.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from depthscale.config import DataConfig
from depthscale.data.cache import atomic_path, cache_key, cache_root, cache_writes, files_identity
from depthscale.data.token_files import (
    megatron_documents,
    megatron_files,
    megatron_last_tokens,
    read_bin,
    read_datatrove,
    read_token_array,
    token_dtype,
    with_eos,
    write_npy_stream,
)
from depthscale.errors import DataError

if TYPE_CHECKING:  # the tokenizer module reads corpora, which read through these readers
    from depthscale.data.tokenizer import Tokenizer

_HEAD = 1 << 20
"""Tokens of an array without a document index searched for EOS."""
_SAMPLE = 4096


def depthscale_part(cfg: DataConfig, path: Path, tokenizer: Tokenizer) -> np.ndarray:
    """depthscale's `.bin`: the stream itself, memory-mapped."""
    return read_bin(path, cfg.bin_dtype)


def megatron_part(cfg: DataConfig, path: Path, tokenizer: Tokenizer) -> np.ndarray:
    """A Megatron pair: joined document for document, each ended by EOS, into the cache once."""
    bin_path, idx_path = megatron_files(path)
    check_document_ends(bin_path, megatron_last_tokens(bin_path, idx_path), cfg, tokenizer)
    docs = megatron_documents(bin_path, idx_path)
    return _cached_with_eos(cfg, "megatron", [bin_path, idx_path], docs, tokenizer)


def array_part(cfg: DataConfig, path: Path, tokenizer: Tokenizer) -> np.ndarray:
    """An OLMo / Dolma array: the stream itself (its documents already end with EOS)."""
    tokens, ends = read_token_array(path, cfg.bin_dtype, tokenizer.vocab_size)
    check_document_ends(path, _last_tokens(tokens, ends, tokenizer.eos_id), cfg, tokenizer)
    return tokens


def datatrove_part(cfg: DataConfig, path: Path, tokenizer: Tokenizer) -> np.ndarray:
    """A datatrove `.ds`: memory-mapped where its documents end in EOS, else each given one,
    into the cache once."""
    tokens, ends = read_datatrove(path, cfg.bin_dtype, tokenizer.vocab_size)
    last = _last_tokens(tokens, ends, tokenizer.eos_id)
    check_document_ends(path, last, cfg, tokenizer)
    if ends is None or (last == tokenizer.eos_id).all():
        return tokens
    starts = np.concatenate([[0], ends[:-1]])  # written without an eos_token: EOS is added
    docs = (tokens[a:b] for a, b in zip(starts.tolist(), ends.tolist()))
    return _cached_with_eos(cfg, "datatrove", [path], docs, tokenizer)


def _last_tokens(tokens: np.ndarray, ends: np.ndarray | None, eos: int) -> np.ndarray:
    """The last token of (up to `_SAMPLE`, evenly spaced) non-empty documents. Without an index
    the stream's EOS marks them: its last token stands for them when no EOS is seen at all."""
    if ends is None:
        if not len(tokens) or (np.asarray(tokens[:_HEAD]) == eos).any():
            return np.empty(0, np.int64)
        return np.asarray(tokens[-1:], dtype=np.int64)
    starts = np.concatenate([[0], ends[:-1]])
    ends = ends[ends > starts]
    if len(ends) > _SAMPLE:
        ends = ends[np.linspace(0, len(ends) - 1, num=_SAMPLE, dtype=np.int64)]
    return np.asarray(tokens[ends - 1], dtype=np.int64)


def check_document_ends(
    path: Path, last: np.ndarray, cfg: DataConfig, tokenizer: Tokenizer
) -> None:
    """Documents that all end in one special token other than the chosen EOS were written with
    that token as EOS: one line naming the file, the token and `data.eos_token`. An EOS the user
    set (`data.eos_token`) is their choice, and is not second-guessed."""
    if cfg.eos_token or not len(last) or (last == tokenizer.eos_id).any():
        return
    values = np.unique(last)
    specials = tokenizer.special_ids()
    if len(values) != 1 or int(values[0]) not in specials:
        return
    token = specials[int(values[0])]
    raise DataError(
        f"{path}: its documents end in {token!r} (id {int(values[0])}), a special token other "
        f"than the {tokenizer.eos_summary}: it was written with {token!r} as EOS; set "
        f"data.eos_token = {token!r} (or data.eos_token = {tokenizer.eos_token!r} to end each "
        "document with both)"
    )


def _cached_with_eos(
    cfg: DataConfig, name: str, files: list[Path], docs: Iterable[np.ndarray], tokenizer: Tokenizer
) -> np.ndarray:
    """Documents each ended by EOS (added where missing), written into the cache once."""
    path = files[0]
    key = cache_key(name, files_identity(cfg, files, tokens=True), tokenizer.eos_id)
    cached = cache_root(cfg) / "tokens" / f"{key}.npy"
    if cached.is_file():
        return np.load(cached, mmap_mode="r")
    docs = _in_vocabulary(docs, tokenizer.vocab_size, path)
    with (
        cache_writes(cached, f"the {name} file's stream"),
        atomic_path(cached) as tmp,
        tmp.open("wb") as f,
    ):
        write_npy_stream(f, token_dtype(tokenizer.vocab_size), with_eos(docs, tokenizer.eos_id))
    return np.load(cached, mmap_mode="r")


def _in_vocabulary(docs: Iterable[np.ndarray], vocab: int, path) -> Iterator[np.ndarray]:
    """Each document checked before it is narrowed to the stream's type (a wider id would wrap)."""
    for n, doc in enumerate(docs):
        if len(doc) and (int(doc.min()) < 0 or int(doc.max()) >= vocab):
            raise DataError(
                f"{path}: document {n} holds token id {int(doc.max())}, outside the tokenizer's "
                f"vocabulary ({vocab}); check data.tokenizer"
            )
        yield doc


__all__ = [
    "array_part",
    "check_document_ends",
    "datatrove_part",
    "depthscale_part",
    "megatron_part",
]
