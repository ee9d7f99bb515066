"""How much of a text corpus a capped read used (`data.max_bytes`), and the line start-up prints
when the cap left anything out: a cap nobody is told about trains on part of a corpus while the
user believes it trains on all of it.

`data.max_bytes` caps raw text only. Token files (a .bin, a Megatron pair, a .npy, `depthscale
tokenize` shards) are always used whole, so a config that caps its text corpus (configs/tiny.toml)
trains on every window of the shards it is pointed at.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
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
    disk_bytes_read: int = 0
    """The sizes on disk of the files opened: an upper bound of the share used."""
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
        for f, size in zip(files, sizes):
            self.files_read += 1
            self.disk_bytes_read += size
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
    def from_json(cls, record: dict[str, Any]) -> TextUsage:
        return cls(**record)

    def report(self, corpus: str, tokens: int) -> str | None:
        """The line saying what the cap left out of `corpus` (its stream: `tokens`), or None
        when nothing was."""
        if not self.capped:
            return None
        share = self.disk_bytes_read / self.disk_bytes if self.disk_bytes else 1.0
        return (
            f"data.max_bytes={self.max_bytes:,} (raw text) stopped reading {corpus!r} in its file "
            f"{self.files_read:,} of {self.files:,}: it uses {self.documents:,} documents, "
            f"{tokens:,} tokens ({self.text_bytes:,} bytes of text, from files holding "
            f"{share:.0%} of its {self.disk_bytes:,} bytes on disk); the rest is left out "
            "(data.max_bytes = 0 reads all of it)"
        )


__all__ = ["TextUsage"]
