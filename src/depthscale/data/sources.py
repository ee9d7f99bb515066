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
from depthscale.data.text_check import TextMeter
from depthscale.errors import DataError

__all__ = [
    "corpus_files",
    "corpus_identity",
    "is_pretokenized",
    "iter_documents",
    "bin_dtype",
    "read_bin",
    "write_bin",
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
    """The corpus's documents in order, at most `data.max_bytes` bytes of UTF-8 text in all; a
    corpus that is not text is refused or warned about once read (`data/text_check.py`)."""
    if is_pretokenized(cfg):
        raise DataError(
            f"data.path={cfg.path!r} is pre-tokenized (.bin) and has no text; "
            "a tokenizer cannot be trained on it"
        )
    files = corpus_files(cfg)  # resolved now, so a bad path fails here rather than on first next()
    meter = TextMeter(cfg.path)
    docs = (doc for f in files for doc in _read(f, cfg.jsonl_field, meter))
    return meter.checked(_limit_bytes(docs, cfg.max_bytes) if cfg.max_bytes else docs)


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


def bin_dtype(cfg: DataConfig, path: Path) -> np.dtype:
    """The element type of the .bin at `path`: its sidecar's, which `data.bin_dtype` (if set) must
    agree with; without a sidecar, `data.bin_dtype` must say it."""
    sidecar = bin_sidecar(path)
    if not sidecar.is_file():
        if cfg.bin_dtype == "auto":
            raise DataError(
                f"{path} has no sidecar {sidecar.name} recording its token type; set "
                "data.bin_dtype (allowed: 'uint16', 'uint32') or write the file with "
                "depthscale.data.sources.write_bin"
            )
        return np.dtype(cfg.bin_dtype)
    try:
        recorded = json.loads(sidecar.read_text())["dtype"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DataError(f"{sidecar}: not a valid token sidecar ({err!r})") from None
    if recorded not in ("uint16", "uint32"):
        raise DataError(f"{sidecar}: dtype {recorded!r}; allowed: 'uint16', 'uint32'")
    if cfg.bin_dtype not in ("auto", recorded):
        raise DataError(
            f"data.bin_dtype={cfg.bin_dtype!r}, but {sidecar.name} says {path.name} holds "
            f"{recorded} tokens; allowed: 'auto' or {recorded!r}"
        )
    return np.dtype(recorded)


def read_bin(cfg: DataConfig) -> np.ndarray:
    """A .bin file of raw little-endian tokens, memory-mapped (nothing is read yet)."""
    path = corpus_files(cfg)[0]
    dtype = bin_dtype(cfg, path).newbyteorder("<")
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise DataError(
            f"{path}: {size} bytes is not a whole number of {dtype.name} tokens; "
            "check data.bin_dtype"
        )
    if size == 0:
        return np.empty(0, dtype)
    tokens = np.memmap(path, dtype=dtype, mode="r")
    _check_not_wider(tokens, path)
    return tokens


def _check_not_wider(tokens: np.ndarray, path: Path, sample: int = 4096) -> None:
    """uint32 ids below 65536 read as uint16 give every second token 0: a stream no tokenizer
    produces. Refuse it rather than train on it."""
    if tokens.itemsize != 2 or len(tokens) < 64:
        return
    head = np.asarray(tokens[: 2 * sample])
    if not head[1::2].any() and head[0::2].any():
        raise DataError(
            f"{path} read as uint16 has every second token 0: it looks like uint32 tokens; "
            "set data.bin_dtype uint32 (or write a sidecar with depthscale.data.sources.write_bin)"
        )


def _read(path: Path, field: str, meter: TextMeter) -> Iterator[str]:
    """A .jsonl file holds one document per line; any other file (.txt, stdlib .py) is one document
    (binary bytes in a .jsonl fail as JSON, so only the others are measured as text)."""
    if path.suffix == ".jsonl":
        yield from _read_jsonl(path, field)
    else:
        yield meter.decode(path, path.read_bytes())


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
