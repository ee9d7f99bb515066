"""How much of a text corpus is not text, measured as its files are decoded.

A binary file (an archive, an image, model weights) or text in another encoding, named as a .txt
corpus, decodes with replacement characters into a stream that trains without complaint, to a
loss that means nothing. So each file read as text is measured: characters that are invalid UTF-8
(decoded as U+FFFD) or control characters other than whitespace count as not text.

- A file of at least `MIN_CHARS` characters that is `REFUSE` or more not text is refused, naming
  it (random bytes are ~55 % not text, an executable 65-90 %, a Cyrillic cp1251 text 75 %,
  Latin-1 French 6 %, any UTF-8 text or source file ~0 %).
- A whole corpus that is `REFUSE` or more not text is refused (a small binary file alone).
- A corpus that is `WARN` or more not text trains, with one warning naming the fraction and the
  file holding most of it.

Smaller files are only counted: the standard library's test data holds a 113-character koi8-r
module, which must not stop the default corpus. The check runs when the corpus is read, that is
when it is tokenized; a cached corpus is not read again.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from depthscale.errors import DataError

WARN = 0.01
REFUSE = 0.30
MIN_CHARS = 4096

_CONTROL = bytes(b for b in range(32) if b not in b"\t\n\v\f\r") + b"\x7f"
_REPLACEMENT = "\ufffd"
_HOW = (
    "allowed: UTF-8 text (remove binary files from data.path; convert text in another encoding, "
    "e.g. iconv -f latin1 -t utf-8)"
)
_warned: set[str] = set()  # a corpus read twice (BPE training, then tokenizing) warns once


def not_text_count(raw: bytes, text: str) -> int:
    """Characters of `text`, decoded from `raw` with errors='replace', that are not text. Control
    bytes are counted in `raw`: in UTF-8 a byte below 0x80 is always a character of its own."""
    invalid = text.count(_REPLACEMENT) - raw.count(_REPLACEMENT.encode())
    control = len(raw) - len(raw.translate(None, _CONTROL))
    return invalid + control


class TextMeter:
    """Decodes the files of one corpus and keeps count of what is not text."""

    def __init__(self, corpus: str) -> None:
        self.corpus = corpus
        self.chars = 0
        self.bad = 0
        self.worst: tuple[int, int, Path] | None = None  # (not text, characters, file)

    def decode(self, path: Path, raw: bytes) -> str:
        """`raw` as text; a DataError if the file is large enough to judge and is not text."""
        text = raw.decode("utf-8", errors="replace")
        bad = not_text_count(raw, text)
        self.chars += len(text)
        self.bad += bad
        if bad and (self.worst is None or bad > self.worst[0]):
            self.worst = (bad, len(text), path)
        if len(text) >= MIN_CHARS and bad >= REFUSE * len(text):
            raise DataError(f"{path} is not text: {_share(bad, len(text))}; {_HOW}")
        return text

    def checked(self, docs: Iterable[str]) -> Iterator[str]:
        """`docs`, then the verdict on everything decoded: refused or warned about."""
        yield from docs
        self.finish()

    def finish(self) -> None:
        if not self.bad:
            return
        bad, chars, path = self.worst
        worst = f"most in {path} ({bad / chars:.0%} of it)"
        if self.bad >= REFUSE * self.chars:
            raise DataError(
                f"data.path={self.corpus!r} is not text: {_share(self.bad, self.chars)}, "
                f"{worst}; {_HOW}"
            )
        if self.bad >= WARN * self.chars:
            _warn_once(
                f"{self.bad / self.chars:.1%} of the corpus data.path={self.corpus!r} is not "
                f"text (invalid UTF-8 or control characters), {worst}; it trains as U+FFFD and "
                "control bytes: remove or convert what is not UTF-8 text"
            )


def _share(bad: int, chars: int) -> str:
    return f"{bad / chars:.0%} of its {chars:,} characters are invalid UTF-8 or control characters"


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        print(f"depthscale: warning: {message}", file=sys.stderr, flush=True)
