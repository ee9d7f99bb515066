"""Where trained tokenizers and tokenized corpora are cached, and how cache entries are named.

Entries are keyed by a hash of everything that determines their content, and written to a
temporary name and renamed into place, so concurrent ranks or an interrupted run never leave a
half-written entry that a later run would trust.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from depthscale.config import DataConfig
from depthscale.errors import DataError

FORMAT_VERSION = 1
"""Bump when the cached formats change, so old entries are ignored instead of misread."""

NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}
"""Errors of a write that found no room: a full disk, a quota, a file-size limit, a read-only file
system. Only writes raise them, so they cannot come from the corpus being read in the same block."""


def cache_root(cfg: DataConfig) -> Path:
    """`data.cache_dir`, else $DEPTHSCALE_CACHE, else ~/.cache/depthscale."""
    root = cfg.cache_dir or os.environ.get("DEPTHSCALE_CACHE") or "~/.cache/depthscale"
    return Path(root).expanduser()


def cache_key(*parts: Any) -> str:
    """A short stable hash of JSON-serialisable parts."""
    blob = json.dumps([FORMAT_VERSION, *parts], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def files_identity(cfg: DataConfig, files: list[Path], tokens: bool) -> dict[str, Any]:
    """What decides the content of a corpus of `files` (their paths, sizes and mtimes, the text
    cap and field, a token file's declared width): a cache key's input."""
    return {
        "files": [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files],
        "max_bytes": cfg.max_bytes,
        "jsonl_field": cfg.jsonl_field,
        "bin_dtype": cfg.bin_dtype if tokens else None,
    }


@contextlib.contextmanager
def atomic_path(target: Path) -> Iterator[Path]:
    """Yield a temporary sibling of `target` to write; rename it onto `target` on success."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def cache_writes(target: Path, what: str) -> Iterator[None]:
    """A write of `what` into the cache that finds no room is the user's to fix, not a bug: one
    DataError naming the file and where else the cache can go. The half-written entry is gone by
    then (`atomic_path`), and nothing the cache already held is touched."""
    try:
        yield
    except OSError as err:
        if err.errno not in NO_ROOM:
            raise
        raise DataError(
            f"cannot write {what} to {target}: {err.strerror} [{errno.errorcode[err.errno]}]; "
            "free space there or set data.cache_dir (or $DEPTHSCALE_CACHE) to a disk with room"
        ) from None
