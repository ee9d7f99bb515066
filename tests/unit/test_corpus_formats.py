"""The corpus formats teams already have: text in .jsonl.gz, .jsonl.zst and .parquet reads as the
same documents as .jsonl; Megatron IndexedDataset pairs and OLMo / Dolma token arrays, written
to their documented layouts (tests/peer_writers.py; the peers' own writers: test_peer_formats.py), read
document for document into the stream depthscale's tokenization would write; damaged or
mismatched files are one DataError naming the file."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from depthscale.config import DataConfig
from depthscale.data.loader import tokenize_corpus
from depthscale.data.sources import corpus_files, iter_documents, token_format
from depthscale.data.tokenizer import ByteTokenizer
from depthscale.errors import DataError
from peer_writers import write_megatron

BYTE = ByteTokenizer()
DOCS = ["first document\n", "zweites Dokument: äöü", "", "the third, with a\nnew line"]


def _cfg(path: Path, tmp_path: Path, **kw) -> DataConfig:
    return DataConfig(path=str(path), cache_dir=str(tmp_path / "cache"), **kw)


def _stream(docs: list[list[int]]) -> list[int]:
    """Documents each followed by EOS: what depthscale's tokenization writes."""
    return [t for d in docs for t in (*d, BYTE.eos_id)]


# --------------------------------------------------------------------- text


def _jsonl_bytes(field: str = "text") -> bytes:
    return "".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(DOCS)).encode()


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst", ".parquet"])
def test_compressed_and_columnar_text_reads_as_jsonl_does(tmp_path, suffix):
    plain = tmp_path / "a.jsonl"
    plain.write_bytes(_jsonl_bytes())
    other = tmp_path / f"b{suffix}"
    if suffix == ".jsonl.gz":
        other.write_bytes(gzip.compress(_jsonl_bytes()))
    elif suffix == ".jsonl.zst":
        import zstandard

        other.write_bytes(zstandard.ZstdCompressor().compress(_jsonl_bytes()))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"id": range(len(DOCS)), "text": DOCS}), other, row_group_size=2)
    assert list(iter_documents(_cfg(other, tmp_path))) == DOCS
    assert np.array_equal(
        tokenize_corpus(_cfg(other, tmp_path), BYTE), tokenize_corpus(_cfg(plain, tmp_path), BYTE)
    )
    folder = tmp_path / "folder"  # a directory of mixed formats, in name order
    folder.mkdir()
    (folder / "1.jsonl").write_bytes(_jsonl_bytes())
    (folder / f"2{suffix}").write_bytes(other.read_bytes())
    assert list(iter_documents(_cfg(folder, tmp_path))) == DOCS + DOCS


def test_a_parquet_file_without_the_column_names_the_columns_it_has(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"body": DOCS}), path)
    with pytest.raises(
        DataError, match=r"no column 'text' \(found: 'body'\); set data.jsonl_field"
    ):
        list(iter_documents(_cfg(path, tmp_path)))
    assert list(iter_documents(_cfg(path, tmp_path, jsonl_field="body"))) == DOCS
    path.write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match="not a readable parquet file"):
        list(iter_documents(_cfg(path, tmp_path)))


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst"])
def test_a_truncated_compressed_file_is_named(tmp_path, suffix):
    import zstandard

    data = _jsonl_bytes() * 50
    if suffix == ".jsonl.gz":
        packed = gzip.compress(data)
    else:
        packed = zstandard.ZstdCompressor().compress(data)
    path = tmp_path / f"t{suffix}"
    path.write_bytes(packed[: len(packed) // 2])
    with pytest.raises(DataError, match=f"t{suffix}: the compressed stream is damaged"):
        list(iter_documents(_cfg(path, tmp_path)))


@pytest.mark.parametrize(("suffix", "extra"), [(".parquet", "parquet"), (".jsonl.zst", "zstd")])
def test_a_format_whose_reader_is_missing_names_the_extra(tmp_path, monkeypatch, suffix, extra):
    import importlib.util

    path = tmp_path / f"d{suffix}"
    path.write_bytes(b"x")
    module = "pyarrow" if extra == "parquet" else "zstandard"
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a)
    )
    with pytest.raises(DataError, match=rf"need {module}: pip install 'depthscale\[{extra}\]'"):
        corpus_files(_cfg(path, tmp_path))


# --------------------------------------------------------------------- Megatron


def _megatron_docs() -> list[list[list[int]]]:
    """Three documents: two sequences with an EOD at the end (`--append-eod`), one without an
    EOD, one sequence ending in EOD."""
    eos = BYTE.eos_id
    return [[[10, 11, 12], [13, eos]], [[20, 21]], [[30, eos]]]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
@pytest.mark.parametrize("name", ["data.bin", "data.idx"])
def test_a_megatron_dataset_is_read_document_for_document(tmp_path, dtype, name):
    write_megatron(tmp_path / "data", _megatron_docs(), dtype)
    cfg = _cfg(tmp_path / name, tmp_path)
    assert token_format(cfg) == "megatron"
    eos = BYTE.eos_id
    expected = [10, 11, 12, 13, eos, 20, 21, eos, 30, eos]  # one EOS after each document
    assert tokenize_corpus(cfg, BYTE).tolist() == expected
    assert tokenize_corpus(cfg, BYTE).tolist() == expected  # the cached stream
    with pytest.raises(DataError, match="pre-tokenized"):
        list(iter_documents(cfg))


def test_damaged_or_mismatched_megatron_files_are_named(tmp_path):
    prefix = tmp_path / "data"
    write_megatron(prefix, _megatron_docs(), np.uint16)
    idx, bin_ = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    good_idx, good_bin = idx.read_bytes(), bin_.read_bytes()
    cases = [
        (lambda: idx.write_bytes(good_idx[:40]), "the index is truncated"),
        (lambda: idx.write_bytes(b"NOTANIDX!" + good_idx[9:]), "not a Megatron IndexedDataset"),
        (lambda: bin_.write_bytes(good_bin[:6]), "lies outside the 6-byte .bin"),
        (lambda: idx.write_bytes(good_idx[:17] + b"\x07" + good_idx[18:]), "token type code 7"),
    ]
    for n, (damage, message) in enumerate(cases):
        idx.write_bytes(good_idx)
        bin_.write_bytes(good_bin)
        damage()
        with pytest.raises(DataError, match=message):
            tokenize_corpus(_cfg(bin_, tmp_path / str(n)), BYTE)
    idx.write_bytes(good_idx)
    bin_.write_bytes(good_bin)
    write_megatron(prefix, [[[10, 999]]], np.int32)
    with pytest.raises(DataError, match="document 0 holds token id 999, outside the tokenizer"):
        tokenize_corpus(_cfg(bin_, tmp_path / "wide"), BYTE)
    idx.unlink()
    bin_.unlink()
    with pytest.raises(DataError, match="a Megatron index without"):
        idx.write_bytes(good_idx)
        corpus_files(_cfg(idx, tmp_path))


# --------------------------------------------------------------------- OLMo / Dolma


def test_olmo_and_dolma_token_arrays_are_the_stream(tmp_path):
    eos = BYTE.eos_id
    ids = np.array([10, 11, eos, 20, eos, 30, 31, 32, eos], dtype=np.uint16)
    np.save(tmp_path / "olmo.npy", ids)
    assert token_format(_cfg(tmp_path / "olmo.npy", tmp_path)) == "array"
    assert tokenize_corpus(_cfg(tmp_path / "olmo.npy", tmp_path), BYTE).tolist() == ids.tolist()
    ids.astype("<u2").tofile(tmp_path / "dolma.npy")  # raw ids, as the Dolma tokenizer writes
    raw = _cfg(tmp_path / "dolma.npy", tmp_path, bin_dtype="uint16")
    assert tokenize_corpus(raw, BYTE).tolist() == ids.tolist()
    with pytest.raises(DataError, match="no .npy header .* set data.bin_dtype"):
        tokenize_corpus(_cfg(tmp_path / "dolma.npy", tmp_path), BYTE)
    np.save(tmp_path / "wide.npy", np.array([1, 4000], dtype=np.int32))
    with pytest.raises(DataError, match="holds token id 4000, outside the tokenizer"):
        tokenize_corpus(_cfg(tmp_path / "wide.npy", tmp_path), BYTE)
