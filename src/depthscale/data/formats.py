"""Every corpus format, one row each: the file suffixes it owns, whether it holds text documents or
tokens, its reader, the optional package it needs, and what it is. `train`, `tokenize` and the
named held-out sets (`[[eval.sets]]`) all read corpora through `data/sources.py`, which asks this
table (and nothing else) what a file is: a new format is one reader and one row
(docs/data.md, "Adding a format").

A text reader is `read(path, field) -> Iterator[str | bytes]` (`data/text_files.py`); a token
reader is `read(cfg, path, tokenizer) -> np.ndarray`, the part's stream of documents each ended by
EOS (`data/token_parts.py`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal

from depthscale.data import text_files as text
from depthscale.data import token_parts as tokens
from depthscale.data.token_files import MEGATRON_PAIR, megatron_files, megatron_pair
from depthscale.errors import DataError


@dataclass(frozen=True)
class Format:
    """One corpus format."""

    name: str
    suffixes: tuple[str, ...]
    """The names a file of this format ends with."""
    kind: Literal["text", "tokens"]
    read: Callable
    about: str
    """What it is, as the list of allowed formats says it ('an OLMo/Dolma .npy'); a text
    format's suffixes say it themselves."""
    needs: tuple[str, str] | None = None
    """(module, extra): the optional package its reader imports, and the extra installing it."""
    check: Callable[[Path], None] | None = None
    """Reads a file whole, cheaply, before any work (a compressed stream: to its end)."""
    claims: Callable[[Path], bool] | None = None
    """For a suffix two formats share: whether a file is this one's (the first row claiming it
    wins; a row without `claims` takes every file with its suffix)."""
    index: str | None = None
    """A companion file's suffix that names the same corpus (a Megatron `.idx`), never a part."""
    files: Callable[[Path], list[Path]] | None = None
    """The files a path of this format names (a Megatron pair), else just the path."""


FORMATS: list[Format] = [
    Format("txt", (".txt",), "text", text.read_whole, "one document a file"),
    Format("jsonl", (".jsonl",), "text", partial(text.read_jsonl, text.open_plain),
           "one document a line"),
    Format("jsonl.gz", (".jsonl.gz",), "text", partial(text.read_jsonl, text.open_gzip),
           "one document a line, gzip-compressed",
           check=partial(text.check_compressed, text.open_gzip)),
    Format("jsonl.zst", (".jsonl.zst",), "text", partial(text.read_jsonl, text.open_zstd),
           "one document a line, zstandard-compressed", needs=("zstandard", "zstd"),
           check=partial(text.check_compressed, text.open_zstd)),
    Format("parquet", (".parquet",), "text", text.read_parquet, "one document a row",
           needs=("pyarrow", "parquet")),
    Format("megatron", MEGATRON_PAIR[:1], "tokens", tokens.megatron_part,
           "a Megatron .bin/.idx pair", index=MEGATRON_PAIR[1],
           claims=lambda path: megatron_pair(path) is not None or path.suffix == MEGATRON_PAIR[1],
           files=megatron_files),
    Format("depthscale", (".bin",), "tokens", tokens.depthscale_part,
           "a depthscale .bin (with NAME.bin.json)"),
    Format("array", (".npy",), "tokens", tokens.array_part, "an OLMo/Dolma .npy"),
    Format("datatrove", (".ds",), "tokens", tokens.datatrove_part, "a datatrove .ds"),
]  # fmt: skip
"""The table. Rows are looked up when a file is read, so a row appended later counts."""


def format_of(path: Path) -> Format | None:
    """The format of the file at `path` (by its name, and a shared suffix's `claims`), or None."""
    for row in FORMATS:
        owned = row.suffixes + ((row.index,) if row.index else ())
        if path.name.endswith(owned) and (row.claims is None or row.claims(path)):
            return row
    return None


def is_part(path: Path, kind: str) -> bool:
    """Whether the file is a corpus file of `kind` on its own (a companion index is not)."""
    row = format_of(path)
    return row is not None and row.kind == kind and path.name.endswith(row.suffixes)


def files_of(path: Path) -> list[Path]:
    """The files a path of a known format names: itself, or its pair."""
    row = format_of(path)
    return row.files(path) if row is not None and row.files is not None else [path]


def text_suffixes() -> list[str]:
    return [s for row in FORMATS if row.kind == "text" for s in row.suffixes]


def allowed() -> str:
    """What `data.path` may name, from the table: the end of every 'allowed:' message."""
    shown = text_suffixes()
    listed = ", ".join(shown[:-1]) + f" or {shown[-1]}" if len(shown) > 1 else shown[0]
    token_rows = ", ".join(row.about for row in FORMATS if row.kind == "tokens")
    return (
        f"'stdlib'; text: a {listed} file or a directory of them; tokens: {token_rows}, "
        "or a directory of them"
    )


def check_needs(files: list[Path], named: str) -> None:
    """A format whose reader is not installed is one line naming the extra, before any work
    (`named`: what the files came from, e.g. "data.path='corpus/'")."""
    for row in FORMATS:
        if row.needs is None or importlib.util.find_spec(row.needs[0]) is not None:
            continue
        if any(format_of(f) is row for f in files):
            module, extra = row.needs
            raise DataError(
                f"{named} holds {row.suffixes[0]} files, which need {module}: "
                f"pip install 'depthscale[{extra}]'"
            )


def check_stream(path: Path) -> None:
    """The format's whole-file check (a compressed stream read to its end), where it has one."""
    row = format_of(path)
    if row is not None and row.check is not None:
        row.check(path)


def has_check(path: Path) -> bool:
    row = format_of(path)
    return row is not None and row.check is not None


__all__ = [
    "FORMATS",
    "Format",
    "allowed",
    "check_needs",
    "check_stream",
    "files_of",
    "format_of",
    "has_check",
    "is_part",
    "text_suffixes",
]
