"""Corpus readers: documents (strings) in a fixed order, so a corpus always yields the same stream.

`data.path` is 'stdlib' (the running Python's standard library, so the default run needs no
download), a .txt file (one document), a .jsonl file (one document per line), a directory of
.txt/.jsonl files (read in sorted order), or a .bin file of pre-tokenized tokens (no text).
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from depthscale.config import DataConfig
from depthscale.errors import DataError

__all__ = [
    "corpus_files",
    "corpus_identity",
    "is_pretokenized",
    "iter_documents",
    "read_bin",
    "stdlib_files",
]

TEXT_SUFFIXES = (".txt", ".jsonl")
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
ALLOWED = "'stdlib', a .txt, .jsonl or .bin file, or a directory of .txt/.jsonl files"


def stdlib_files() -> list[Path]:
    """The standard library's .py files (third-party packages excluded), sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]  # pruned: installed packages are large
        files += [os.path.join(folder, n) for n in names if n.endswith(".py")]
    return sorted((Path(f) for f in files), key=lambda f: f.relative_to(root).as_posix())


def corpus_files(cfg: DataConfig) -> list[Path]:
    """Resolve `data.path` to the files it names; a clear DataError if it names nothing usable."""
    if cfg.path == "stdlib":
        return stdlib_files()
    path = Path(cfg.path).expanduser()
    if path.is_dir():
        files = [
            f
            for f in path.rglob("*")
            if f.is_file() and f.suffix in TEXT_SUFFIXES and not f.name.startswith(".")
        ]
        if not files:
            raise DataError(
                f"data.path={cfg.path!r} is a directory with no .txt or .jsonl files; "
                f"allowed: {ALLOWED}"
            )
        return sorted(files, key=lambda f: f.relative_to(path).as_posix())
    if not path.exists():
        raise DataError(f"data.path={cfg.path!r} does not exist; allowed: {ALLOWED}")
    if path.suffix not in (*TEXT_SUFFIXES, ".bin"):
        raise DataError(
            f"data.path={cfg.path!r} has unsupported type {path.suffix or '(none)'!r}; "
            f"allowed: {ALLOWED}"
        )
    return [path]


def is_pretokenized(cfg: DataConfig) -> bool:
    return cfg.path != "stdlib" and Path(cfg.path).suffix == ".bin" and not Path(cfg.path).is_dir()


def corpus_identity(cfg: DataConfig) -> dict[str, Any]:
    """What decides the corpus's content (files, sizes, mtimes, limits): the cache key's input."""
    files = [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in corpus_files(cfg)]
    return {
        "files": files,
        "max_bytes": cfg.max_bytes,
        "jsonl_field": cfg.jsonl_field,
        "bin_dtype": cfg.bin_dtype if is_pretokenized(cfg) else None,
    }


def iter_documents(cfg: DataConfig) -> Iterator[str]:
    """The corpus's documents in order, at most `data.max_bytes` bytes of UTF-8 text in all."""
    if is_pretokenized(cfg):
        raise DataError(
            f"data.path={cfg.path!r} is pre-tokenized (.bin) and has no text; "
            "a tokenizer cannot be trained on it"
        )
    files = corpus_files(cfg)  # resolved now, so a bad path fails here rather than on first next()
    docs = (doc for f in files for doc in _read(f, cfg.jsonl_field))
    return _limit_bytes(docs, cfg.max_bytes) if cfg.max_bytes else docs


def read_bin(cfg: DataConfig) -> np.ndarray:
    """A .bin file of raw little-endian `data.bin_dtype` tokens, memory-mapped (nothing is read yet)."""
    path = corpus_files(cfg)[0]
    dtype = np.dtype(cfg.bin_dtype).newbyteorder("<")
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise DataError(
            f"{path}: {size} bytes is not a whole number of {cfg.bin_dtype} tokens; "
            "check data.bin_dtype"
        )
    if size == 0:
        return np.empty(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def _read(path: Path, field: str) -> Iterator[str]:
    """A .jsonl file holds one document per line; any other file (.txt, stdlib .py) is one document."""
    if path.suffix == ".jsonl":
        yield from _read_jsonl(path, field)
    else:
        yield path.read_bytes().decode("utf-8", errors="replace")


def _read_jsonl(path: Path, field: str) -> Iterator[str]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            line = raw.decode("utf-8", errors="replace").strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None
            if not isinstance(record, dict) or field not in record:
                keys = (
                    ", ".join(map(repr, record))
                    if isinstance(record, dict)
                    else type(record).__name__
                )
                raise DataError(
                    f"{path}:{lineno}: no field {field!r} (found: {keys}); "
                    "set data.jsonl_field to the field holding the text"
                )
            text = record[field]
            if not isinstance(text, str):
                raise DataError(
                    f"{path}:{lineno}: field {field!r} is {type(text).__name__}, not a string"
                )
            yield _valid_utf8(text)


def _valid_utf8(text: str) -> str:
    """JSON may escape lone surrogates ('\\ud800'), which cannot be encoded; replace them."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", errors="replace").decode("utf-8")


def _limit_bytes(docs: Iterable[str], max_bytes: int) -> Iterator[str]:
    """Stop after `max_bytes` bytes of UTF-8; the last document is cut at a character boundary."""
    left = max_bytes
    for doc in docs:
        raw = doc.encode("utf-8")
        if len(raw) >= left:
            yield raw[:left].decode("utf-8", errors="ignore")
            return
        left -= len(raw)
        yield doc
