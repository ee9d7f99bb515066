"""How much of a text corpus a capped read used (`data.max_bytes`), and the line start-up prints
when the cap left anything out: a cap nobody is told about trains on part of a corpus while the
user believes it trains on all of it.

`data.max_bytes` caps raw text only. Token files (a .bin, a Megatron pair, a .npy, `depthscale
tokenize` shards) are always used whole, so a config that caps its text corpus (configs/tiny.toml)
trains on every window of the shards it is pointed at.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any


@dataclass
class TextUsage:
    """What one read of a text corpus took: filled in as its documents are read."""

    max_bytes: int = 0
    files: int = 0
    """Files in the corpus."""
    files_read: int = 0
    """Files opened, the one the cap stopped in included."""
    disk_bytes: int = 0
    """The corpus's files' sizes on disk."""
    disk_bytes_whole: int = 0
    """The sizes on disk of the files opened before the last one (read whole if it was cut)."""
    documents: int = 0
    """Documents read, the one the cap cut included."""
    text_bytes: int = 0
    """UTF-8 bytes of text read."""
    capped: bool = False
    """The read stopped at data.max_bytes (the rest of the corpus, if any, was left out)."""

    def reading(self, files: list[Path]) -> Iterator[Path]:
        """`files`, counted as each is opened."""
        sizes = [f.stat().st_size for f in files]
        self.files, self.disk_bytes = len(files), sum(sizes)
        opened = 0
        for f, size in zip(files, sizes):
            self.files_read += 1
            self.disk_bytes_whole, opened = opened, opened + size
            yield f

    def limited(self, docs: Iterable[str], max_bytes: int) -> Iterator[str]:
        """`docs`, stopped after `max_bytes` bytes of UTF-8 (0: all of them); the last document is
        cut at a character boundary."""
        self.max_bytes = max_bytes
        left = max_bytes
        for doc in docs:
            raw = doc.encode("utf-8")
            self.documents += 1
            if max_bytes and len(raw) >= left:
                cut = raw[:left].decode("utf-8", errors="ignore")
                self.text_bytes += len(cut.encode("utf-8"))
                self.capped = True
                yield cut
                return
            left -= len(raw)
            self.text_bytes += len(raw)
            yield doc

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, record: Any) -> TextUsage | None:
        """The usage `to_json` wrote, or None for a record of other fields (another version)."""
        if not isinstance(record, dict) or set(record) != {f.name for f in fields(cls)}:
            return None
        return cls(**record)

    def report(self, corpus: str, tokens: int) -> str | None:
        """The line saying what the cap left out of `corpus` (its stream: `tokens`), or None
        when nothing was."""
        if not self.capped:
            return None
        whole = self.files_read - 1
        share = self.disk_bytes_whole / self.disk_bytes if self.disk_bytes else 0.0
        read = (
            f"its first {whole:,} of {self.files:,} files whole ({share:.0%} of its "
            f"{self.disk_bytes:,} bytes on disk) and part of file {whole + 1:,}"
            if whole
            else f"part of its first file ({self.files:,} in all, {self.disk_bytes:,} bytes on disk)"
        )
        return (
            f"data.max_bytes={self.max_bytes:,} (raw text) leaves part of {corpus!r} out: it "
            f"uses {self.documents:,} documents, {tokens:,} tokens, {self.text_bytes:,} bytes of "
            f"text: {read} (data.max_bytes = 0 reads all of it)"
        )


__all__ = ["TextUsage"]
