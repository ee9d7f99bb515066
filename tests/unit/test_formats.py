"""The format table (`data/formats.py`): docs/data.md's "Adding a format" example, run as written
(its code block is read from the page, so the docs and this test cannot drift apart), adds a
.csv format with one reader and one row, and a .csv corpus then trains through the loader and
is tokenized by `depthscale tokenize` like any other text format."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from depthscale.config import DataConfig
from depthscale.data.formats import FORMATS, allowed
from depthscale.data.loader import build_data
from depthscale.data.shards import input_files, read_shards, tokenize_to_shards
from depthscale.data.sources import corpus_files, iter_documents
from depthscale.data.tokenizer import ByteTokenizer
from depthscale.errors import DataError

DOCS = ["first, with a comma", "zweites Dokument: äöü", "the third\nspans two lines"]


def _docs_example() -> str:
    """The python block of docs/data.md's "Adding a format" section."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "data.md").read_text()
    section = page.split("## Adding a format", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "the section shows one code block: the reader and its row"
    return blocks[0]


def _csv(path: Path, column: str = "text") -> Path:
    import csv

    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["id", column])
        writer.writerows(enumerate(DOCS))
    return path


def test_the_docs_example_adds_a_format_with_one_reader_and_one_row(tmp_path):
    corpus = _csv(tmp_path / "corpus.csv")
    cfg = DataConfig(path=str(corpus), cache_dir=str(tmp_path / "cache"), seq_len=8,
                     val_fraction=0.0)  # fmt: skip
    with pytest.raises(DataError, match=r"unsupported type '\.csv'"):
        corpus_files(cfg)
    rows = len(FORMATS)
    try:
        exec(_docs_example(), {})
        assert len(FORMATS) == rows + 1 and ".csv" in allowed()
        assert list(iter_documents(cfg)) == DOCS
        byte = ByteTokenizer()
        stream = [t for d in DOCS for t in (*byte.encode(d), byte.eos_id)]
        windows = {tuple(stream[i * 8 : i * 8 + 9]) for i in range((len(stream) - 1) // 8)}
        inputs, labels = build_data(cfg, seed=0, batch_size=2).train.next_batch()
        for x, y in zip(inputs.tolist(), labels.tolist()):
            assert (*x, y[-1]) in windows
        assert input_files([str(corpus)], "text") == [corpus]
        tokenize_to_shards([corpus], byte, tmp_path / "shards")
        assert read_shards(tmp_path / "shards", byte)[:].tolist() == stream
        with pytest.raises(DataError, match=r"no column 'body' \(found: 'id', 'text'\); set --f"):
            input_files([str(corpus)], "body")
    finally:
        del FORMATS[rows:]
    assert ".csv" not in allowed()


def test_tokenize_names_its_input_not_data_path(tmp_path):
    """`depthscale tokenize DIR` has no data.path: a refused input is named as the input it is
    (before: "data.path='...' is a directory with no text or token files"); training still says
    data.path."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "rows.csv").write_text("id,text\n1,hello\n")
    for given in (folder, tmp_path / "missing", folder / "rows.csv"):
        with pytest.raises(DataError) as err:
            input_files([str(given)], "text")
        assert str(err.value).startswith(f"input {str(given)!r} ") and "data.path" not in str(err)
    with pytest.raises(DataError, match=r"^data\.path='.*corpus' is a directory with no text"):
        corpus_files(DataConfig(path=str(folder)))
