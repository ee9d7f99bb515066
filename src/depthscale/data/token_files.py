"""Token files that other trainers write, read document for document without their libraries.

Megatron-LM's IndexedDataset: `PREFIX.bin` holds every sequence's tokens back to back, and
`PREFIX.idx` says where each one is and which sequences make a document (megatron/core/datasets/
indexed_dataset.py, `_IndexWriter`), all little-endian:

    b"MMIDIDX\\x00\\x00"                      9 bytes, the magic
    version                                 u64, 1
    dtype code                              u8: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                                                6 float64, 7 float32, 8 uint16
    sequence count S                        u64
    document count D                        u64 (documents + 1: the indices below end with S)
    sequence lengths                        int32[S], in tokens
    sequence pointers                       int64[S], byte offsets into the .bin
    document indices                        int64[D], the first sequence of each document, then S

`preprocess_data.py --append-eod` ends every document with the tokenizer's EOD; one without it is
given the EOS here, so the stream is always documents each followed by EOS (as depthscale's own
tokenization writes it) and packing sees the same boundaries.

OLMo-core / Dolma token arrays (`.npy`): the ids of every document back to back, each document
ended by EOS, as a NumPy array file, or (as the Dolma tokenizer writes them) raw memory-mapped
ids with no header, whose element type `data.bin_dtype` must name.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from depthscale.errors import DataError

MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_HEAD = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, documents
_NPY_MAGIC = b"\x93NUMPY"


@dataclass(frozen=True)
class MegatronIndex:
    """A Megatron `.idx`, memory-mapped: where each sequence lies and which make a document."""

    dtype: np.dtype
    lengths: np.ndarray
    pointers: np.ndarray
    documents: np.ndarray

    @property
    def n_documents(self) -> int:
        return len(self.documents) - 1


def megatron_pair(path: Path) -> tuple[Path, Path] | None:
    """(PREFIX.bin, PREFIX.idx) when `path` names either file of a Megatron pair (or the prefix
    itself), else None."""
    prefix = path.with_suffix("") if path.suffix in (".bin", ".idx") else path
    pair = prefix.with_name(prefix.name + ".bin"), prefix.with_name(prefix.name + ".idx")
    return pair if pair[0].is_file() and pair[1].is_file() else None


def read_megatron_index(idx: Path, bin_size: int) -> MegatronIndex:
    """The index, every field checked against the layout and against the .bin's size."""
    raw = idx.read_bytes()
    if len(raw) < _HEAD.size or raw[:9] != MEGATRON_MAGIC:
        raise DataError(
            f"{idx}: not a Megatron IndexedDataset index (no {MEGATRON_MAGIC!r} header); "
            "allowed: the .idx that megatron's preprocess_data.py writes"
        )
    _, version, code, n_seq, n_doc = _HEAD.unpack_from(raw)
    if version != 1:
        raise DataError(f"{idx}: index version {version}; allowed: 1")
    if code not in MEGATRON_DTYPES or not np.issubdtype(MEGATRON_DTYPES[code], np.integer):
        raise DataError(f"{idx}: token type code {code}; allowed: an integer type (1-5, 8)")
    expected = _HEAD.size + 4 * n_seq + 8 * n_seq + 8 * n_doc
    if len(raw) < expected or n_doc < 1:
        raise DataError(
            f"{idx}: {len(raw)} bytes, but {n_seq} sequences and {n_doc} document indices "
            f"need {expected}: the index is truncated"
        )
    at = _HEAD.size
    lengths = np.frombuffer(raw, "<i4", n_seq, at)
    pointers = np.frombuffer(raw, "<i8", n_seq, at + 4 * n_seq)
    documents = np.frombuffer(raw, "<i8", n_doc, at + 12 * n_seq)
    dtype = np.dtype(MEGATRON_DTYPES[code]).newbyteorder("<")
    if n_seq and (
        (lengths < 0).any()
        or (pointers < 0).any()
        or int((pointers + lengths.astype(np.int64) * dtype.itemsize).max()) > bin_size
    ):
        raise DataError(
            f"{idx}: a sequence lies outside the {bin_size}-byte .bin beside it; the pair does "
            "not belong together or the .bin is truncated"
        )
    if documents[0] != 0 or documents[-1] != n_seq or (np.diff(documents) < 0).any():
        raise DataError(f"{idx}: document indices must rise from 0 to the sequence count ({n_seq})")
    return MegatronIndex(dtype, lengths, pointers, documents)


def megatron_documents(bin_path: Path, idx_path: Path) -> Iterator[np.ndarray]:
    """Each document's tokens (its sequences joined), in the index's order."""
    size = bin_path.stat().st_size
    index = read_megatron_index(idx_path, size)
    if size == 0:
        return
    data = np.memmap(bin_path, dtype=np.uint8, mode="r")
    item = index.dtype.itemsize
    for d in range(index.n_documents):
        first, last = int(index.documents[d]), int(index.documents[d + 1])
        parts = [
            data[int(p) : int(p) + int(n) * item].view(index.dtype)
            for p, n in zip(index.pointers[first:last], index.lengths[first:last])
        ]
        yield np.concatenate(parts) if parts else np.empty(0, index.dtype)


def with_eos(documents: Iterator[np.ndarray], eos: int) -> Iterator[np.ndarray]:
    """Every document ending in EOS (appended where it does not already)."""
    end = np.array([eos])
    for doc in documents:
        yield doc if len(doc) and doc[-1] == eos else np.concatenate([doc, end])


def read_token_array(path: Path, raw_dtype: str) -> np.ndarray:
    """An OLMo / Dolma token file, memory-mapped: a NumPy array file (its header says the type),
    or raw ids whose type `raw_dtype` (data.bin_dtype) names."""
    with path.open("rb") as f:
        head = f.read(6)
    if head == _NPY_MAGIC:
        try:
            tokens = np.load(path, mmap_mode="r")
        except ValueError as err:
            raise DataError(f"{path}: not a readable .npy array ({err})") from None
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise DataError(
                f"{path}: a {tokens.ndim}-D {tokens.dtype} array; allowed: 1-D integer token ids"
            )
        return tokens
    if raw_dtype == "auto":
        raise DataError(
            f"{path} has no .npy header (raw ids, as the Dolma tokenizer writes them); set "
            "data.bin_dtype (allowed: 'uint16', 'uint32') to its token type"
        )
    dtype = np.dtype(raw_dtype).newbyteorder("<")
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise DataError(f"{path}: {size} bytes is not a whole number of {dtype.name} tokens")
    return np.memmap(path, dtype=dtype, mode="r") if size else np.empty(0, dtype)


__all__ = [
    "MEGATRON_DTYPES",
    "MEGATRON_MAGIC",
    "MegatronIndex",
    "megatron_documents",
    "megatron_pair",
    "read_megatron_index",
    "read_token_array",
    "with_eos",
]
