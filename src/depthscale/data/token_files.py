"""Token files: depthscale's own `.bin`, and those other trainers write, read document for document
without their libraries (`data/token_parts.py` makes each a training stream).

depthscale's `.bin` (`write_bin`): raw little-endian ids, and beside it `NAME.bin.json` recording
their type and the vocabulary, so a reader never guesses the width.

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
ended by EOS, as a NumPy array file, or (as Dolma's `MemmapWriter` and OLMo-core's
`memmap_to_write` write them) raw memory-mapped ids with no header. Beside a raw one there may be
`NAME.csv.gz`, one row per document, `start,end[,id,src,loc]` in tokens (dolma/tokenizer/
memmap_writer.py; olmo_core/data/utils.py `write_document_indices`): its last end over the file's
size says the element type, which `data.bin_dtype` must otherwise name.

datatrove token files (`NAME.ds`, datatrove/pipeline/tokens/tokenizer.py `TokenizedFile`): raw
little-endian ids, 2 bytes each, or 4 where the vocabulary exceeds 65,536; `NAME.ds.index` holds
each document's end in tokens as uint64; `NAME.ds.metadata` starts `tokenizer|token size`;
`NAME.ds.loss` (a loss mask, one byte a token) is not read. EOS ends each document only where the
pipeline's `eos_token` (or the tokenizer's post-processor) added it.

A raw file read at the wrong width is refused, naming the right one (`check_width`): the index's
token count, ids beyond the vocabulary, and uint32 ids read as uint16 (every second value a high
half: 0 below 65,536) are each evidence.
"""

from __future__ import annotations

import gzip
import json
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

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
_WIDTHS = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
_SAMPLE = 4096


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


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest stream dtype that holds every id: half the memory of uint32 for most vocabs."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


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


def bin_sidecar(path: Path) -> Path:
    """`NAME.bin.json`: what a .bin of raw tokens cannot say itself (as Megatron's .idx does)."""
    return path.with_name(path.name + ".json")


def write_bin(path: str | Path, tokens: np.ndarray, vocab_size: int) -> Path:
    """Write pre-tokenized `tokens` as a .bin (raw little-endian ids) plus its sidecar, which
    records the element type and vocabulary so a reader never has to guess them."""
    path = Path(path)
    dtype = np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)
    if len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise DataError(f"write_bin: token ids must lie in [0, {vocab_size})")
    np.asarray(tokens).astype(dtype.newbyteorder("<")).tofile(path)
    meta = {"format": "depthscale-tokens", "dtype": dtype.name, "vocab_size": vocab_size}
    bin_sidecar(path).write_text(json.dumps(meta) + "\n")
    return path


def bin_dtype(path: Path, setting: str) -> np.dtype:
    """The element type of the .bin at `path`: its sidecar's, which `data.bin_dtype` (`setting`,
    if not 'auto') must agree with; without a sidecar, `data.bin_dtype` must say it."""
    sidecar = bin_sidecar(path)
    if not sidecar.is_file():
        if setting == "auto":
            raise DataError(
                f"{path} has no sidecar {sidecar.name} recording its token type; set "
                "data.bin_dtype (allowed: 'uint16', 'uint32') or write the file with "
                "depthscale.data.token_files.write_bin"
            )
        return np.dtype(setting)
    try:
        recorded = json.loads(sidecar.read_text())["dtype"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DataError(f"{sidecar}: not a valid token sidecar ({err!r})") from None
    if recorded not in ("uint16", "uint32"):
        raise DataError(f"{sidecar}: dtype {recorded!r}; allowed: 'uint16', 'uint32'")
    if setting not in ("auto", recorded):
        raise DataError(
            f"data.bin_dtype={setting!r}, but {sidecar.name} says {path.name} holds "
            f"{recorded} tokens; allowed: 'auto' or {recorded!r}"
        )
    return np.dtype(recorded)


def read_bin(path: Path, setting: str) -> np.ndarray:
    """A .bin file of raw little-endian tokens, memory-mapped (nothing is read yet)."""
    dtype = bin_dtype(path, setting).newbyteorder("<")
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise DataError(
            f"{path}: {size} bytes is not a whole number of {dtype.name} tokens; "
            "check data.bin_dtype"
        )
    if size == 0:
        return np.empty(0, dtype)
    tokens = np.memmap(path, dtype=dtype, mode="r")
    check_width(tokens, path)
    return tokens


MEGATRON_PAIR = (".bin", ".idx")
"""A Megatron IndexedDataset's two files: PREFIX.bin (the tokens), PREFIX.idx (the index)."""


def megatron_pair(path: Path) -> tuple[Path, Path] | None:
    """(PREFIX.bin, PREFIX.idx) when `path` names either file of a Megatron pair (or the prefix
    itself), else None."""
    prefix = path.with_suffix("") if path.suffix in MEGATRON_PAIR else path
    data, index = (prefix.with_name(prefix.name + s) for s in MEGATRON_PAIR)
    return (data, index) if data.is_file() and index.is_file() else None


def megatron_files(path: Path) -> list[Path]:
    """The pair `path` (either file) names; an index without its tokens is one line."""
    pair = megatron_pair(path)
    if pair is None:
        data = path.with_suffix(MEGATRON_PAIR[0]).name
        raise DataError(f"{path}: a Megatron index without its {data}")
    return list(pair)


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


def megatron_last_tokens(bin_path: Path, idx_path: Path) -> np.ndarray:
    """The last token of (at most `_SAMPLE`, evenly spaced) non-empty documents, read in place."""
    index = read_megatron_index(idx_path, bin_path.stat().st_size)
    docs = _spread(index.n_documents)
    last_seq = index.documents[docs + 1] - 1
    last_seq = last_seq[(last_seq >= index.documents[docs]) & (index.lengths[last_seq] > 0)]
    if not len(last_seq):
        return np.empty(0, index.dtype)
    item = index.dtype.itemsize
    at = index.pointers[last_seq] + (index.lengths[last_seq].astype(np.int64) - 1) * item
    data = np.memmap(bin_path, dtype=np.uint8, mode="r")
    raw = np.stack([data[at + k] for k in range(item)], axis=1)  # each id's bytes
    return np.ascontiguousarray(raw).view(index.dtype).ravel()


def with_eos(documents: Iterator[np.ndarray], eos: int) -> Iterator[np.ndarray]:
    """Every document ending in EOS (appended where it does not already)."""
    end = np.array([eos])
    for doc in documents:
        yield doc if len(doc) and doc[-1] == eos else np.concatenate([doc, end])


def read_token_array(
    path: Path, raw_dtype: str, vocab_size: int | None = None
) -> tuple[np.ndarray, np.ndarray | None]:
    """An OLMo / Dolma token file, memory-mapped, and its documents' ends where an index lies
    beside it (else None): a NumPy array file (its header says the type), or raw ids whose type
    the `.csv.gz` index or `raw_dtype` (data.bin_dtype) says, checked against the evidence."""
    with path.open("rb") as f:
        head = f.read(6)
    meta = path.with_suffix(".csv.gz")
    ends = read_dolma_ends(meta) if meta.is_file() else None
    if head == _NPY_MAGIC:
        try:
            tokens = np.load(path, mmap_mode="r")
        except ValueError as err:
            raise DataError(f"{path}: not a readable .npy array ({err})") from None
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise DataError(
                f"{path}: a {tokens.ndim}-D {tokens.dtype} array; allowed: 1-D integer token ids"
            )
        check_index(path, ends, len(tokens), meta)
        return tokens, ends
    if raw_dtype == "auto" and ends is None:
        raise DataError(
            f"{path} has no .npy header (raw ids, as the Dolma tokenizer writes them) and no "
            f"{meta.name} beside it; set data.bin_dtype (allowed: 'uint16', 'uint32') to its "
            "token type"
        )
    tokens = _raw_tokens(path, raw_dtype, ends, meta, None, vocab_size)
    return tokens, ends


def read_dolma_ends(meta: Path) -> np.ndarray:
    """Each document's end (in tokens) from a Dolma / OLMo `.csv.gz` index, whose rows are
    `start,end[,id,src,loc]` with each start the previous end."""
    starts, ends = [], []
    try:
        with gzip.open(meta, "rt", newline="") as f:
            for line in f:
                if line.strip():
                    start, end = line.split(",", 2)[:2]
                    starts.append(int(start))
                    ends.append(int(end))
    except (OSError, EOFError, ValueError) as err:
        raise DataError(
            f"{meta}: not a readable document index (row {len(ends) + 1}: {err}); allowed: rows "
            "'start,end[,...]' as Dolma and OLMo-core write them"
        ) from None
    ends_array = np.asarray(ends, dtype=np.int64)
    if len(ends) and (starts[0] != 0 or (np.asarray(starts[1:]) != ends_array[:-1]).any()):
        raise DataError(
            f"{meta}: documents do not follow each other (a start is not the end "
            "before it); allowed: the index Dolma and OLMo-core write"
        )
    return ends_array


def read_datatrove(
    path: Path, raw_dtype: str, vocab_size: int | None = None
) -> tuple[np.ndarray, np.ndarray | None]:
    """A datatrove `.ds` file, memory-mapped, and its documents' ends from `.ds.index` (None
    without one). Its width: the index's token count over the file's size, else what
    `.ds.metadata` records, else datatrove's own rule from the vocabulary."""
    index = path.with_name(path.name + ".index")
    ends = None
    if index.is_file():
        size = index.stat().st_size
        if size % 8:
            raise DataError(f"{index}: {size} bytes is not a whole number of uint64 document ends")
        ends = np.fromfile(index, dtype="<u8").astype(np.int64)
    written = _datatrove_token_size(path.with_name(path.name + ".metadata"))
    if written is None and vocab_size is not None:
        written = 4 if vocab_size > 1 << 16 else 2  # datatrove's PipelineStepWithTokenizer
    default = _WIDTHS.get(written) if written else None
    return _raw_tokens(path, raw_dtype, ends, index, default, vocab_size), ends


def _datatrove_token_size(metadata: Path) -> int | None:
    """The token size `.ds.metadata`'s first line ends with ('tokenizer|2'), if it says one."""
    try:
        first = metadata.read_text().splitlines()[0]
        return int(first.rsplit("|", 1)[1])
    except (OSError, IndexError, ValueError):
        return None


def _raw_tokens(
    path: Path,
    raw_dtype: str,
    ends: np.ndarray | None,
    index: Path,
    default: np.dtype | None,
    vocab_size: int | None,
) -> np.ndarray:
    """Raw little-endian ids, memory-mapped at the width the index implies (its last end is the
    token count), else `raw_dtype`, else `default`; refused if the evidence says another."""
    size = path.stat().st_size
    implied = None
    if ends is not None and len(ends) and ends[-1] > 0:
        width, rest = divmod(size, int(ends[-1]))
        implied = _WIDTHS.get(width) if not rest else None
        if implied is None:
            raise DataError(
                f"{path}: {size} bytes for the {int(ends[-1])} tokens {index.name} lists: not "
                "2- or 4-byte tokens; the two files do not belong together or one is truncated"
            )
    dtype = np.dtype(raw_dtype).newbyteorder("<") if raw_dtype != "auto" else implied or default
    if dtype is None:
        raise DataError(
            f"{path}: raw ids of unknown width; set data.bin_dtype (allowed: 'uint16', 'uint32')"
        )
    if implied is not None and dtype.itemsize != implied.itemsize:
        raise DataError(
            f"{path} holds {int(ends[-1])} tokens by {index.name}, so {implied.name} tokens, "
            f"not data.bin_dtype={raw_dtype!r}; set data.bin_dtype {implied.name!r} (or 'auto')"
        )
    if size % dtype.itemsize:
        raise DataError(
            f"{path}: {size} bytes is not a whole number of {dtype.name} tokens; "
            "check data.bin_dtype"
        )
    tokens = np.memmap(path, dtype=dtype, mode="r") if size else np.empty(0, dtype)
    check_index(path, ends, len(tokens), index)
    check_width(tokens, path, vocab_size)
    return tokens


def check_index(path: Path, ends: np.ndarray | None, n_tokens: int, index: Path) -> None:
    """Document ends must rise to the token count: else the index is not this file's."""
    if ends is None:
        return
    last = int(ends[-1]) if len(ends) else 0
    if (len(ends) and (ends[0] < 0 or (np.diff(ends) < 0).any())) or last != n_tokens:
        raise DataError(
            f"{path}: {index.name} does not fit it (document ends must rise to its "
            f"{n_tokens} tokens; the last is {last}); the two files do not belong together"
        )


def check_width(tokens: np.ndarray, path: Path, vocab_size: int | None = None) -> None:
    """Raw ids read at the wrong width give streams no tokenizer produces: uint32 ids read as
    uint16 have every second value a high half (0 below 65,536), uint16 ids read as uint32 are
    pairs glued into ids far beyond the vocabulary. Refuse both, naming the right width."""
    if not len(tokens):
        return
    head = np.asarray(tokens[: 2 * _SAMPLE])
    if tokens.itemsize == 2 and len(head) >= 64:
        high = 0 if vocab_size is None else (vocab_size - 1) >> 16
        if int(head[1::2].max()) <= high < int(head[0::2].max()):
            raise DataError(
                f"{path} read as uint16 has every second token {high or 0}"
                f"{' or less' if high else ''} (the high halves of uint32 ids): it looks "
                "like uint32 tokens; set data.bin_dtype uint32"
            )
    if tokens.itemsize == 4 and vocab_size is not None:
        sample = np.concatenate([head, np.asarray(tokens[_spread(len(tokens))])])
        narrow = np.ascontiguousarray(sample).view("<u2")
        if int(sample.max()) >= vocab_size > int(narrow.max()):
            raise DataError(
                f"{path} read as uint32 holds ids up to {int(sample.max())}, beyond the "
                f"vocabulary ({vocab_size}), which read as uint16 it fits: it looks like "
                "uint16 tokens; set data.bin_dtype uint16"
            )


def _spread(n: int, at_most: int = _SAMPLE) -> np.ndarray:
    """Up to `at_most` evenly spaced positions in range(n)."""
    if not n:
        return np.empty(0, np.int64)
    return np.unique(np.linspace(0, n - 1, num=min(n, at_most), dtype=np.int64))


__all__ = [
    "bin_dtype",
    "bin_sidecar",
    "read_bin",
    "token_dtype",
    "write_bin",
    "write_npy_stream",
    "megatron_files",
    "MEGATRON_DTYPES",
    "MEGATRON_PAIR",
    "MEGATRON_MAGIC",
    "MegatronIndex",
    "check_index",
    "check_width",
    "megatron_documents",
    "megatron_last_tokens",
    "megatron_pair",
    "read_datatrove",
    "read_dolma_ends",
    "read_megatron_index",
    "read_token_array",
    "with_eos",
]
