"""Token files laid out byte for byte as the peers' own writers lay them out, for the peers whose
packages are too heavy for the default suite (megatron-core: ~10 s to import; its real writer runs
in tests/unit/test_peer_formats.py's slow case) or do not install beside this project's (ai2-olmo-core
pins huggingface-hub below what transformers needs). datatrove installs light: its real writer is
used directly. And a chat tokenizer configured as Qwen's and Llama 3 Instruct's are: its
tokenizer_config.json says `eos_token`, which is not `<|endoftext|>`."""

from __future__ import annotations

import csv
import gzip
import json
import struct
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import models, pre_tokenizers

CHAT_VOCAB = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "a": 3, "b": 4}
ENDOFTEXT, IM_START, IM_END, A, B = range(5)


def chat_tokenizer(directory: Path, config: dict | None = None) -> Path:
    """A tokenizer.json (word-level: 'a b' is [3, 4]) whose specials are Qwen's, and beside it
    tokenizer_config.json = `config` (default: eos_token '<|im_end|>', as transformers writes it,
    with its added_tokens_decoder). Returns the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    tok = tokenizers.Tokenizer(models.WordLevel(CHAT_VOCAB, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.save(str(directory / "tokenizer.json"))
    if config is None:
        decoder = {str(i): {"content": t, "special": True} for t, i in CHAT_VOCAB.items() if i < 3}
        config = {"added_tokens_decoder": decoder, "eos_token": "<|im_end|>"}
    if config:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


MEGATRON_CODES = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4}


def write_megatron(prefix: Path, documents: list[list[list[int]]], dtype) -> None:
    """megatron/core/datasets/indexed_dataset.py's layout (`IndexedDatasetBuilder`,
    `_IndexWriter`): the .bin holds every sequence back to back; the .idx: magic, version 1, dtype
    code, sequence count, document count (documents + 1), int32 lengths, int64 byte pointers,
    int64 document indices ending with the sequence count."""
    dtype = np.dtype(dtype)
    lengths, pointers, doc_index, offset = [], [], [0], 0
    with open(f"{prefix}.bin", "wb") as f:
        for doc in documents:
            for seq in doc:
                f.write(np.asarray(seq, dtype=dtype.newbyteorder("<")).tobytes())
                lengths.append(len(seq))
                pointers.append(offset)
                offset += len(seq) * dtype.itemsize
            doc_index.append(len(lengths))
    with open(f"{prefix}.idx", "wb") as f:
        f.write(
            b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", MEGATRON_CODES[dtype])
        )
        f.write(struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_index)))
        f.write(np.asarray(lengths, "<i4").tobytes() + np.asarray(pointers, "<i8").tobytes())
        f.write(np.asarray(doc_index, "<i8").tobytes())


def write_dolma(path: Path, documents: list[list[int]], dtype) -> None:
    """dolma/tokenizer/memmap_writer.py's `MemmapWriter`: `NAME.npy` is a raw np.memmap of the
    documents' ids (no header; each already ends in the EOS the tokenizer appends), and
    `NAME.csv.gz` has one csv.writer row per document: start, end (in tokens), id, src, loc."""
    ids = np.concatenate([np.asarray(d) for d in documents])
    array = np.memmap(path, dtype=dtype, mode="w+", shape=(len(ids),))
    array[:] = ids
    array.flush()
    del array
    with gzip.open(path.with_suffix(".csv.gz"), "wt") as f:
        rows, start = csv.writer(f), 0
        for n, doc in enumerate(documents):
            rows.writerow([start, start + len(doc), f"doc-{n}", "s3://bucket/src.json.gz", n])
            start += len(doc)


def write_olmo(path: Path, documents: list[list[int]], dtype, eos: int) -> None:
    """olmo_core/data/utils.py: `memmap_to_write` writes the raw array (np.memmap, no header),
    `write_document_indices` writes `NAME.csv.gz` with a 'start,end' line per EOS."""
    ids = np.concatenate([np.asarray(d) for d in documents])
    array = np.memmap(path, dtype=dtype, mode="w+", shape=(len(ids),))
    array[:] = ids
    array.flush()
    del array
    tokens = np.memmap(path, mode="r", dtype=dtype)
    with gzip.open(path.with_suffix(".csv.gz"), mode="wt") as f:
        start = 0
        for location in (tokens == eos).nonzero()[0]:
            f.write(f"{start},{location + 1}\n")
            start = location + 1


def olmo_documents(path: Path, dtype) -> list[list[int]]:
    """OLMo-core's reading (`iter_document_indices` from the metadata file, then the slices of
    the np.memmap): what each document holds."""
    tokens = np.memmap(path, mode="r", dtype=dtype)
    with gzip.open(path.with_suffix(".csv.gz"), "rt") as f:
        spans = [tuple(int(x) for x in line.split(",")[:2]) for line in f]
    return [tokens[a:b].tolist() for a, b in spans]
