"""The text formats' readers: each yields a file's documents, in order (`data/formats.py` says
which reader reads which file).

A reader is `read(path, field) -> Iterator[str | bytes]`: a `str` is a document already decoded
(JSON and parquet carry text, never raw bytes), `bytes` a file's raw content, decoded and measured
as text by the caller (`data/text_check.py`: a binary file named as text is refused). `field` is
the column or field holding the text (`data.jsonl_field`, or `tokenize --field`); a file without
it is one line, `field.missing(...)`, naming what it has and the option that picks one.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from depthscale.errors import DataError

Opener = Callable[[Path], BinaryIO]


@dataclass(frozen=True)
class Field:
    """The field (or column) holding each document's text, and the option that names it."""

    name: str
    setting: str = "data.jsonl_field"

    def missing(self, where: str | Path, found: str | Iterable[str], noun: str = "field"):
        """The one-line error for a record or table without this field; `found`: the names it
        has (or what it is instead, a str said as it is)."""
        found = found if isinstance(found, str) else ", ".join(map(repr, found))
        return DataError(
            f"{where}: no {noun} {self.name!r} (found: {found}); "
            f"set {self.setting} to the {noun} holding the text"
        )


def read_whole(path: Path, field: Field) -> Iterator[bytes]:
    """The file is one document (a .txt, a standard-library .py)."""
    yield path.read_bytes()


def read_jsonl(opener: Opener, path: Path, field: Field) -> Iterator[str]:
    """One document a line: a JSON object's `field`; `opener` decompresses."""
    with _stream_errors(path), opener(path) as f:
        for lineno, raw in enumerate(f, 1):
            line = raw.decode("utf-8", errors="replace").strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None
            if not isinstance(record, dict):
                raise field.missing(f"{path}:{lineno}", type(record).__name__)
            if field.name not in record:
                raise field.missing(f"{path}:{lineno}", record)
            text = record[field.name]
            if not isinstance(text, str):
                raise DataError(
                    f"{path}:{lineno}: field {field.name!r} is {type(text).__name__}, not a string"
                )
            yield _valid_utf8(text)


def read_parquet(path: Path, field: Field) -> Iterator[str]:
    """One document a row of column `field`."""
    table = parquet_file(path, field)
    for row, batch in enumerate(table.iter_batches(columns=[field.name], batch_size=1024)):
        for i, text in enumerate(batch.column(0).to_pylist()):
            if not isinstance(text, str):
                raise DataError(
                    f"{path}: row {row * 1024 + i} of column {field.name!r} is "
                    f"{type(text).__name__}, not a string"
                )
            yield _valid_utf8(text)


def parquet_file(path: Path, field: Field):
    """The parquet file at `path`, refused unless readable and holding column `field`."""
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except Exception as err:  # pyarrow's errors: ArrowInvalid, OSError
        raise DataError(f"{path}: not a readable parquet file ({err})") from None
    if field.name not in table.schema_arrow.names:
        raise field.missing(path, table.schema_arrow.names, "column")
    return table


def open_plain(path: Path) -> BinaryIO:
    return path.open("rb")


def open_gzip(path: Path) -> BinaryIO:
    return gzip.open(path, "rb")  # a truncated stream raises EOFError


def open_zstd(path: Path) -> BinaryIO:
    return io.BufferedReader(_ZstdFrames(path))


def check_compressed(opener: Opener, path: Path) -> None:
    """Read a compressed file's stream to its end, unparsed: a damaged or truncated file is named
    before any work (decompressing is cheap beside tokenizing)."""
    with _stream_errors(path), opener(path) as f:
        while f.read(1 << 22):
            pass


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


def _valid_utf8(text: str) -> str:
    """JSON may escape lone surrogates ('\\ud800'), which cannot be encoded; replace them."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", errors="replace").decode("utf-8")


__all__ = [
    "Field",
    "check_compressed",
    "open_gzip",
    "open_plain",
    "open_zstd",
    "parquet_file",
    "read_jsonl",
    "read_parquet",
    "read_whole",
]
