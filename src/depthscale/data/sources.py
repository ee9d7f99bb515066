"""Corpora: documents (strings) in a fixed order, so a corpus always yields the same stream.

`data.path` is 'stdlib' (the running Python's standard library, so the default run needs no
download), one file of a format in `data/formats.py`'s table (text documents, or tokens another
trainer wrote), a directory of them (read in sorted order; a directory of token files is one
source, its parts in name order, `data/token_stream.py`), or a `depthscale tokenize` directory.
Which reader reads a file, and what `data.path` may name, is the table's to say.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from depthscale.config import DataConfig
from depthscale.data.cache import files_identity
from depthscale.data.formats import allowed, check_needs, files_of, format_of, is_part
from depthscale.data.text_check import TextMeter
from depthscale.data.text_files import Field, read_whole
from depthscale.data.usage import TextUsage
from depthscale.errors import DataError

__all__ = [
    "corpus_files",
    "corpus_identity",
    "is_pretokenized",
    "iter_documents",
    "source_config",
    "stdlib_files",
    "token_format",
]

_SHARD_NAME = re.compile(r"shard-\d+\.npy")
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
SHARD_MANIFEST = "manifest.json"
"""What marks a directory of `depthscale tokenize` shards (`data/shards.py`)."""


def stdlib_files() -> list[Path]:
    """The standard library's .py files (third-party packages excluded), sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]  # pruned: installed packages are large
        files += [os.path.join(folder, n) for n in names if n.endswith(".py")]
    return sorted((Path(f) for f in files), key=lambda f: f.relative_to(root).as_posix())


def corpus_files(cfg: DataConfig, named: str = "") -> list[Path]:
    """Resolve `data.path` to the files it names; a clear DataError if it names nothing usable,
    naming it as `named` (default "data.path='...'"; `depthscale tokenize` names its input)."""
    if cfg.path == "stdlib":
        return stdlib_files()
    named = named or f"data.path={cfg.path!r}"
    path = Path(cfg.path).expanduser()
    if path.is_dir() and (path / SHARD_MANIFEST).is_file():
        return [path / SHARD_MANIFEST]  # tokenized shards: their manifest says what they hold
    if path.is_dir():
        files = _directory_files(path, cfg.path, named)
        check_needs(files, named)
        return files
    if not path.exists():
        raise DataError(f"{named} does not exist; allowed: {allowed()}")
    if format_of(path) is None:
        raise DataError(
            f"{named} has unsupported type {path.suffix or '(none)'!r}; allowed: {allowed()}"
        )
    check_needs([path], named)
    return files_of(path)


def _directory_files(path: Path, shown: str, named: str = "") -> list[Path]:
    """A directory's text files, or its token files (the parts of one token stream), in name
    order; a directory of both, or of neither, is one line naming what it holds (as `named`)."""
    named = named or f"data.path={shown!r}"
    files = sorted(
        (f for f in path.rglob("*") if f.is_file() and not f.name.startswith(".")),
        key=lambda f: f.relative_to(path).as_posix(),
    )
    shards = [f.name for f in files if _SHARD_NAME.fullmatch(f.name)]
    if shards:  # a `depthscale tokenize` output whose manifest.json is not (yet) written
        raise DataError(
            f"{named} holds depthscale tokenize shards ({shards[0]}, ...) but no "
            f"{SHARD_MANIFEST}: manifest missing: rerun `depthscale tokenize` with --out {shown} "
            "(the finished shards are kept)"
        )
    text = [f for f in files if is_part(f, "text")]
    tokens = [f for f in files if is_part(f, "tokens")]
    if text and tokens:
        raise DataError(
            f"{named} mixes text files ({text[0].name}) and token files "
            f"({tokens[0].name}); allowed: a directory of one kind (give each its own "
            "[[data.sources]] entry)"
        )
    if not text and not tokens:
        raise DataError(f"{named} is a directory with no text or token files; allowed: {allowed()}")
    return text or tokens


def token_format(cfg: DataConfig) -> str | None:
    """'shards' (a `depthscale tokenize` directory), 'parts' (a directory of token files), a
    token file's format's name in `data/formats.py`, or None: `data.path` is text."""
    if cfg.path == "stdlib":
        return None
    path = Path(cfg.path).expanduser()
    if path.is_dir() and (path / SHARD_MANIFEST).is_file():
        return "shards"
    if path.is_dir():
        files = _directory_files(path, cfg.path)
        return "parts" if is_part(files[0], "tokens") else None
    row = format_of(path)
    return row.name if row is not None and row.kind == "tokens" else None


def is_pretokenized(cfg: DataConfig) -> bool:
    return token_format(cfg) is not None


def source_config(cfg: DataConfig, source) -> DataConfig:
    """The DataConfig that reads one source of a mixture (or an `[[eval.sets]]` entry: anything
    with a `path` and a `jsonl_field`) as `data.path` would read its corpus."""
    return dataclasses.replace(
        cfg,
        path=source.path,
        jsonl_field=source.jsonl_field or cfg.jsonl_field,
        sources=[],
        stages=[],
    )


def checked_source(cfg: DataConfig, source, key: str) -> DataConfig:
    """`source_config`, its files resolved now so a bad path is named as the config names it
    (`key`: 'data.sources[1]', 'eval.sets[0]'), not as a data.path the user never wrote."""
    sub = source_config(cfg, source)
    corpus_files(sub, f"{key}.path={source.path!r}")
    return sub


def corpus_identity(cfg: DataConfig) -> dict[str, Any]:
    """What decides the corpus's content (files, sizes, mtimes, limits): the cache key's input."""
    if cfg.sources:
        return {"sources": [corpus_identity(source_config(cfg, s)) for s in cfg.sources]}
    return files_identity(cfg, corpus_files(cfg), is_pretokenized(cfg))


def iter_documents(cfg: DataConfig, usage: TextUsage | None = None) -> Iterator[str]:
    """The corpus's documents in order, at most `data.max_bytes` bytes of UTF-8 text in all; a
    corpus that is not text is refused or warned about once read (`data/text_check.py`). A
    mixture's are its sources', in source order. `usage` (one corpus) counts what was read."""
    if cfg.sources:
        return (doc for s in cfg.sources for doc in iter_documents(source_config(cfg, s)))
    if is_pretokenized(cfg):
        raise DataError(
            f"data.path={cfg.path!r} is pre-tokenized (.bin) and has no text; "
            "a tokenizer cannot be trained on it"
        )
    files = corpus_files(cfg)  # resolved now, so a bad path fails here rather than on first next()
    meter, usage = TextMeter(cfg.path), usage if usage is not None else TextUsage()
    field = Field(cfg.jsonl_field)
    docs = (doc for f in usage.reading(files) for doc in _read_documents(f, field, meter))
    return meter.checked(usage.limited(docs, cfg.max_bytes))


def _read_documents(path: Path, field: Field, meter: TextMeter) -> Iterator[str]:
    """One text file's documents, by its format's reader (a file of no format, a standard-library
    .py, is one document); raw bytes are decoded and measured as text by `meter`."""
    row = format_of(path)
    for doc in (row.read if row is not None else read_whole)(path, field):
        yield meter.decode(path, doc) if isinstance(doc, bytes) else doc
