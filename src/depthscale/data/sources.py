"""Corpus readers: documents (strings) in a fixed order, so a corpus always yields the same stream.

`data.path` is 'stdlib' (the running Python's standard library, so the default run needs no
download); text: a .txt file (one document), a .jsonl, .jsonl.gz or .jsonl.zst file (one document
a line, `data.jsonl_field`), a .parquet file (one document a row of column `data.jsonl_field`), or
a directory of them (read in sorted order); or tokens (no text): a .bin of depthscale's, a
Megatron .bin/.idx pair, an OLMo / Dolma .npy array, a datatrove .ds file (`data/token_files.py`),
or a directory of such token files (one source: its parts in name order, `data/token_stream.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import importlib.util
import io
import json
import os
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from depthscale.config import DataConfig
from depthscale.data.text_check import TextMeter
from depthscale.data.token_files import check_width, megatron_pair
from depthscale.data.usage import TextUsage
from depthscale.errors import DataError

__all__ = [
    "check_stream",
    "corpus_files",
    "corpus_identity",
    "is_pretokenized",
    "iter_documents",
    "bin_dtype",
    "read_bin",
    "write_bin",
    "parquet_file",
    "part_format",
    "source_config",
    "stdlib_files",
    "text_suffix",
    "token_format",
]

TEXT_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")
TOKEN_SUFFIXES = (".bin", ".idx", ".npy", ".ds")
PART_SUFFIXES = (".bin", ".npy", ".ds")
"""A token file's own file; what lies beside it (a Megatron .idx, a Dolma .csv.gz, a datatrove
.ds.index, a .bin.json sidecar) describes it, and is read with it."""
_SHARD_NAME = re.compile(r"shard-\d+\.npy")
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
ALLOWED = (
    "'stdlib'; text: a .txt, .jsonl, .jsonl.gz, .jsonl.zst or .parquet file or a directory of "
    "them; tokens: a .bin (depthscale's, or a Megatron .bin/.idx pair), an OLMo/Dolma .npy, a "
    "datatrove .ds, or a directory of them"
)
SHARD_MANIFEST = "manifest.json"
"""What marks a directory of `depthscale tokenize` shards (`data/shards.py`)."""
_EXTRAS = {".jsonl.zst": ("zstandard", "zstd"), ".parquet": ("pyarrow", "parquet")}
"""Text formats that need an optional package: (module, the extra that installs it)."""


def text_suffix(name: str) -> str | None:
    """The text format `name` ends with (.txt, .jsonl.zst, ...), or None."""
    return next((s for s in TEXT_SUFFIXES if name.endswith(s)), None)


def _check_extras(files: list[Path], path: str) -> None:
    """A format whose reader is not installed is one line naming the extra, before any work."""
    for suffix, (module, extra) in _EXTRAS.items():
        if any(f.name.endswith(suffix) for f in files) and importlib.util.find_spec(module) is None:
            raise DataError(
                f"data.path={path!r} holds {suffix} files, which need {module}: "
                f"pip install 'depthscale[{extra}]'"
            )


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
    if path.is_dir() and (path / SHARD_MANIFEST).is_file():
        return [path / SHARD_MANIFEST]  # tokenized shards: their manifest says what they hold
    if path.is_dir():
        files = _directory_files(path, cfg.path)
        _check_extras(files, cfg.path)
        return files
    pair = megatron_pair(path) if path.suffix in (".bin", ".idx") else None
    if pair is not None:
        return list(pair)
    if not path.exists():
        raise DataError(f"data.path={cfg.path!r} does not exist; allowed: {ALLOWED}")
    if path.suffix == ".idx":
        raise DataError(
            f"data.path={cfg.path!r}: a Megatron index without its {path.with_suffix('.bin').name}"
        )
    if not text_suffix(path.name) and path.suffix not in TOKEN_SUFFIXES:
        raise DataError(
            f"data.path={cfg.path!r} has unsupported type {path.suffix or '(none)'!r}; "
            f"allowed: {ALLOWED}"
        )
    _check_extras([path], cfg.path)
    return [path]


def _directory_files(path: Path, shown: str) -> list[Path]:
    """A directory's text files, or its token files (the parts of one token stream), in name
    order; a directory of both, or of neither, is one line naming what it holds."""
    files = sorted(
        (f for f in path.rglob("*") if f.is_file() and not f.name.startswith(".")),
        key=lambda f: f.relative_to(path).as_posix(),
    )
    shards = [f.name for f in files if _SHARD_NAME.fullmatch(f.name)]
    if shards:  # a `depthscale tokenize` output whose manifest.json is not (yet) written
        raise DataError(
            f"data.path={shown!r} holds depthscale tokenize shards ({shards[0]}, ...) but no "
            f"{SHARD_MANIFEST}: manifest missing: rerun `depthscale tokenize` with --out {shown} "
            "(the finished shards are kept)"
        )
    text = [f for f in files if text_suffix(f.name)]
    tokens = [f for f in files if f.suffix in PART_SUFFIXES]
    if text and tokens:
        raise DataError(
            f"data.path={shown!r} mixes text files ({text[0].name}) and token files "
            f"({tokens[0].name}); allowed: a directory of one kind (give each its own "
            "[[data.sources]] entry)"
        )
    if not text and not tokens:
        raise DataError(
            f"data.path={shown!r} is a directory with no text or token files; allowed: {ALLOWED}"
        )
    return text or tokens


def part_format(path: Path) -> str:
    """The format of one token file: 'megatron' (a .bin/.idx pair), 'array' (an OLMo / Dolma
    .npy), 'datatrove' (a .ds), or 'depthscale' (a .bin of ours)."""
    if path.suffix == ".npy":
        return "array"
    if path.suffix == ".ds":
        return "datatrove"
    return "megatron" if megatron_pair(path) is not None or path.suffix == ".idx" else "depthscale"


def token_format(cfg: DataConfig) -> str | None:
    """'shards' (a `depthscale tokenize` directory), 'parts' (a directory of token files), a
    token file's `part_format`, or None: `data.path` is text."""
    if cfg.path == "stdlib":
        return None
    path = Path(cfg.path).expanduser()
    if path.is_dir() and (path / SHARD_MANIFEST).is_file():
        return "shards"
    if path.is_dir():
        files = _directory_files(path, cfg.path)
        return "parts" if files[0].suffix in PART_SUFFIXES else None
    if path.suffix not in TOKEN_SUFFIXES:
        return None
    return part_format(path)


def is_pretokenized(cfg: DataConfig) -> bool:
    return token_format(cfg) is not None


def source_config(cfg: DataConfig, source) -> DataConfig:
    """The DataConfig that reads one source of a mixture as `data.path` would read its corpus."""
    return dataclasses.replace(
        cfg,
        path=source.path,
        jsonl_field=source.jsonl_field or cfg.jsonl_field,
        sources=[],
        stages=[],
    )


def corpus_identity(cfg: DataConfig) -> dict[str, Any]:
    """What decides the corpus's content (files, sizes, mtimes, limits): the cache key's input."""
    if cfg.sources:
        return {"sources": [corpus_identity(source_config(cfg, s)) for s in cfg.sources]}
    files = [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in corpus_files(cfg)]
    return {
        "files": files,
        "max_bytes": cfg.max_bytes,
        "jsonl_field": cfg.jsonl_field,
        "bin_dtype": cfg.bin_dtype if is_pretokenized(cfg) else None,
    }


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
    docs = (doc for f in usage.reading(files) for doc in _read(f, cfg.jsonl_field, meter))
    return meter.checked(usage.limited(docs, cfg.max_bytes))


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
    check_width(tokens, path)
    return tokens


def _read(path: Path, field: str, meter: TextMeter) -> Iterator[str]:
    """A .jsonl file (plain, gzip or zstandard) holds one document per line, a .parquet file one
    per row of column `field`; any other file (.txt, stdlib .py) is one document (binary bytes in
    a .jsonl fail as JSON, so only the others are measured as text)."""
    name = path.name
    if name.endswith(".parquet"):
        yield from _read_parquet(path, field)
    elif name.endswith((".jsonl", ".jsonl.gz", ".jsonl.zst")):
        yield from _read_jsonl(path, field)
    else:
        yield meter.decode(path, path.read_bytes())


def _open_lines(path: Path) -> BinaryIO:
    if path.name.endswith(".gz"):
        return gzip.open(path, "rb")  # a truncated stream raises EOFError
    if path.name.endswith(".zst"):
        return io.BufferedReader(_ZstdFrames(path))
    return path.open("rb")


class _ZstdFrames(io.RawIOBase):
    """A .zst file decompressed frame after frame; a file that ends inside a frame raises
    EOFError (zstandard's own stream reader would just stop, losing the frame's documents)."""

    def __init__(self, path: Path) -> None:
        import zstandard

        self._new = zstandard.ZstdDecompressor().decompressobj
        self._file, self._frame = path.open("rb"), self._new()
        self._pending, self._at, self._started = b"", 0, False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self._at == len(self._pending):
            self._pending, self._at = b"", 0
            chunk = self._file.read(1 << 20)
            if not chunk:
                if self._started and not self._frame.eof:
                    raise EOFError("the file ends inside a zstandard frame")
                return 0
            while chunk:
                self._started = True
                self._pending += self._frame.decompress(chunk)
                chunk = b""
                if self._frame.eof:  # the next frame starts with what this one left unused
                    chunk, self._frame, self._started = self._frame.unused_data, self._new(), False
        n = min(len(buffer), len(self._pending) - self._at)
        buffer[:n] = self._pending[self._at : self._at + n]
        self._at += n
        return n

    def close(self) -> None:
        self._file.close()
        super().close()


def parquet_file(path: Path, field: str, setting: str = "data.jsonl_field"):
    """The parquet file at `path`, refused unless readable and holding column `field` (the
    error names the columns it has and `setting`, the option that picks one)."""
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except Exception as err:  # pyarrow's errors: ArrowInvalid, OSError
        raise DataError(f"{path}: not a readable parquet file ({err})") from None
    columns = table.schema_arrow.names
    if field not in columns:
        raise DataError(
            f"{path}: no column {field!r} (found: {', '.join(map(repr, columns))}); "
            f"set {setting} to the column holding the text"
        )
    return table


def _read_parquet(path: Path, field: str) -> Iterator[str]:
    table = parquet_file(path, field)
    for row, batch in enumerate(table.iter_batches(columns=[field], batch_size=1024)):
        for i, text in enumerate(batch.column(0).to_pylist()):
            if not isinstance(text, str):
                raise DataError(
                    f"{path}: row {row * 1024 + i} of column {field!r} is "
                    f"{type(text).__name__}, not a string"
                )
            yield _valid_utf8(text)


def _read_jsonl(path: Path, field: str) -> Iterator[str]:
    with _stream_errors(path):
        yield from _jsonl_lines(path, field)


def check_stream(path: Path) -> None:
    """Read a compressed .jsonl's stream to its end, unparsed: a damaged or truncated file is
    named before any work (decompressing is cheap beside tokenizing)."""
    if path.name.endswith((".gz", ".zst")):
        with _stream_errors(path), _open_lines(path) as f:
            while f.read(1 << 22):
                pass


@contextlib.contextmanager
def _stream_errors(path: Path) -> Iterator[None]:
    """A damaged gzip or zstandard stream as one DataError naming the file."""
    try:
        yield
    except (EOFError, gzip.BadGzipFile) as err:
        raise DataError(f"{path}: the compressed stream is damaged ({err})") from None
    except Exception as err:
        if type(err).__name__ != "ZstdError":
            raise
        raise DataError(f"{path}: the compressed stream is damaged ({err})") from None


def _jsonl_lines(path: Path, field: str) -> Iterator[str]:
    with _open_lines(path) as f:
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
