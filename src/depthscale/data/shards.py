"""Offline tokenization into shards (`depthscale tokenize`), and reading them back for training.

One shard per input file, so what a shard holds depends on its file and the tokenizer alone:
any number of workers writes the same bytes, and a rerun keeps every finished shard. A shard is

    shard-00007.npy        the file's documents' ids, each document followed by EOS (the stream
                           `data/loader.py` writes for a corpus), a NumPy array
    shard-00007.docs.npy   int64: where each document ends in it (its EOS's index + 1)
    shard-00007.json       written last: its source (path, bytes, SHA-256), tokens, documents,
                           largest id, the tokenizer's fingerprint, the two files' SHA-256

and `manifest.json` (written once every shard is done) lists them in input order with the
tokenizer. A rerun (after a kill, or with more inputs) keeps a shard whose sidecar matches its
files, its source and the tokenizer, and redoes any other; a directory of another tokenizer's
shards is refused, untouched. A rerun with fewer inputs removes the shards past them once its
manifest is written, each only if its sidecar's SHA-256s show tokenize wrote it.

Nothing is written before every input is checked: its format, its field, that it holds text,
and a compressed one's whole stream. The workers are `data/worker_pool.py`'s, so one killed
(the out-of-memory killer) is named with its file at once, the finished shards kept.

Training on the directory (`data.path = DIR`) reads the shards in manifest order as one stream
(`data/concat.py`), the stream `data.path = <the inputs>` would tokenize to: the same batches.
Start-up checks sizes and counts against the manifest, not hashes (a rerun of `tokenize`
verifies those).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np

from depthscale.config import DataConfig
from depthscale.data.cache import atomic_path
from depthscale.data.concat import ConcatTokens
from depthscale.data.encode import encode_documents
from depthscale.data.formats import check_stream, format_of, has_check, is_part, text_suffixes
from depthscale.data.sources import SHARD_MANIFEST, corpus_files, iter_documents
from depthscale.data.text_files import Field
from depthscale.data.token_files import token_dtype, write_npy_stream
from depthscale.data.tokenizer import Tokenizer, tokenizer_label
from depthscale.data.worker_pool import WorkerDied, WorkerPool
from depthscale.errors import DataError

MANIFEST = SHARD_MANIFEST
FORMAT = "depthscale-shards-1"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _names(out: Path, index: int) -> tuple[Path, Path, Path]:
    stem = f"shard-{index:05d}"
    return out / f"{stem}.npy", out / f"{stem}.docs.npy", out / f"{stem}.json"


def input_files(inputs: list[str], field: str) -> list[Path]:
    """Every text file the inputs name (files or folders, in order; folders in name order),
    each checked before any work: a text format, `field` present (parquet schemas, a .jsonl's
    first line), and text in it. An input with none is refused, naming it; an empty file
    inside a folder with text is only noted (its shard is empty)."""
    files: list[Path] = []
    empty: list[Path] = []
    for text in inputs:
        found = corpus_files(DataConfig(path=text, jsonl_field=field), f"input {text!r}")
        for f in found:
            if not is_part(f, "text"):
                raise DataError(
                    f"{f}: depthscale tokenize reads text; allowed: "
                    + ", ".join(text_suffixes())
                    + " files or folders of them (token files train as they are)"
                )
        blank = [f for f in found if _is_empty(f, field)]
        if len(blank) == len(found):
            what = "is empty" if Path(text).is_file() else f"holds only empty files ({len(found)})"
            raise DataError(
                f"input {text!r} {what}: no text to tokenize; allowed: files or folders holding "
                "documents (remove it from the inputs)"
            )
        files, empty = files + found, empty + blank
    if empty:
        print(
            f"depthscale: note: {len(empty)} input file(s) hold no text (first: {empty[0]}); "
            "their shards are empty",
            file=sys.stderr,
            flush=True,
        )
    return files


def _is_empty(path: Path, field: str) -> bool:
    """Whether the file holds no text, read no further than its first document (checking on
    the way that `field` is there)."""
    if path.stat().st_size == 0:
        return True
    return next(iter(format_of(path).read(path, Field(field, "--field"))), None) is None


def _encode_file(job: tuple[int, str, str, Tokenizer, str]) -> dict[str, Any]:
    """One shard from one file (in a worker): the files written atomically, the sidecar last."""
    index, source, out, tokenizer, field = job
    source_path, out_path = Path(source), Path(out)
    tokens_path, docs_path, sidecar = _names(out_path, index)
    dtype = token_dtype(tokenizer.vocab_size)
    ends: list[np.ndarray] = []
    stats = {"tokens": 0, "max_id": -1}

    def pieces():
        for piece in encode_documents(
            iter_documents(DataConfig(path=source, jsonl_field=field)), tokenizer
        ):
            eos = np.flatnonzero(piece == tokenizer.eos_id) + 1 + stats["tokens"]
            ends.append(eos.astype(np.int64))
            stats["tokens"] += len(piece)
            stats["max_id"] = max(stats["max_id"], int(piece.max()) if len(piece) else -1)
            yield piece

    with atomic_path(tokens_path) as tmp, tmp.open("wb") as f:
        write_npy_stream(f, dtype, pieces())
    doc_ends = np.concatenate(ends) if ends else np.empty(0, np.int64)
    with atomic_path(docs_path) as tmp, tmp.open("wb") as f:
        np.save(f, doc_ends)
    record = {
        "source": str(source_path.resolve()),
        "source_bytes": source_path.stat().st_size,
        "source_sha256": _sha256(source_path),
        "tokens": stats["tokens"],
        "documents": len(doc_ends),
        "max_id": stats["max_id"],
        "dtype": dtype.name,
        "tokenizer": tokenizer.fingerprint,
        "sha256": _sha256(tokens_path),
        "docs_sha256": _sha256(docs_path),
    }
    with atomic_path(sidecar) as tmp:
        tmp.write_text(json.dumps(record, indent=1) + "\n")
    return {"index": index, **record}


def _finished(out: Path, index: int, source: Path, tokenizer: Tokenizer) -> dict | None:
    """The shard's sidecar when its files, source and tokenizer all match it, else None."""
    tokens_path, docs_path, sidecar = _names(out, index)
    try:
        record = json.loads(sidecar.read_text())
    except (OSError, ValueError):
        return None
    try:
        ok = (
            record["tokenizer"] == tokenizer.fingerprint
            and record["source"] == str(source.resolve())
            and record["source_bytes"] == source.stat().st_size
            and record["source_sha256"] == _sha256(source)
            and record["sha256"] == _sha256(tokens_path)
            and record["docs_sha256"] == _sha256(docs_path)
        )
    except (OSError, KeyError, TypeError):
        return None
    return {"index": index, **record} if ok else None


def _remove_partial(out: Path) -> None:
    for tmp in out.glob(".shard-*.tmp"):
        tmp.unlink(missing_ok=True)


def refuse_other_tokenizer(out: Path, tokenizer: Tokenizer) -> None:
    for sidecar in sorted(out.glob("shard-*.json")):
        try:
            theirs = json.loads(sidecar.read_text()).get("tokenizer")
        except (OSError, ValueError, AttributeError):
            continue
        if theirs and theirs != tokenizer.fingerprint:
            raise DataError(
                f"{out} holds shards of another tokenizer ({sidecar.name}: {theirs[:16]}, this "
                f"one: {tokenizer.fingerprint[:16]}); allowed: a new or empty directory, or the "
                "tokenizer that wrote them (nothing was changed)"
            )


def tokenize_to_shards(
    files: list[Path],
    tokenizer: Tokenizer,
    out: Path,
    workers: int = 1,
    field: str = "text",
    progress: Callable[[dict[str, Any], int, int], None] | None = None,
) -> dict[str, Any]:
    """Tokenize `files` into `out` (one shard each), keeping the finished shards; returns the
    manifest. `progress(record, done, total)` is called for each kept shard once the inputs
    are checked, then as each shard finishes.

    Before anything is written, every compressed input to tokenize is read to its end (a damaged
    one is named then, not after the files before it). An old manifest is removed before the
    first shard changes; shards of an earlier run's further inputs are removed once the new
    manifest is written (`_remove_stale`). A worker that dies is named with its file
    (`data/worker_pool.py`), at once."""
    if out.is_dir():
        refuse_other_tokenizer(out, tokenizer)
    records: dict[int, dict] = {}
    jobs = []
    for i, f in enumerate(files):
        kept = _finished(out, i, f, tokenizer)
        if kept is not None:
            records[i] = kept | {"kept": True}
        else:
            jobs.append((i, str(f), str(out), tokenizer, field))
    parallel = workers > 1 and len(jobs) > 1
    try:
        # spawn: tokenizers' thread pools do not survive fork; the workers leave Ctrl-C to
        # this process, which stops them
        spawn = multiprocessing.get_context("spawn")
        with WorkerPool(spawn, min(workers, len(jobs))) if parallel else nullcontext() as pool:
            run = pool.map_unordered if pool is not None else _one_by_one
            compressed = [Path(job[1]) for job in jobs if has_check(Path(job[1]))]
            for _ in run(check_stream, compressed, lambda path: f"checking {path}"):
                pass
            out.mkdir(parents=True, exist_ok=True)
            if jobs:
                (out / MANIFEST).unlink(missing_ok=True)  # it no longer describes the shards
            _remove_partial(out)  # what a killed run was writing
            if progress is not None:
                for done, record in enumerate(records.values(), 1):
                    progress(record, done, len(files))
            for record in run(_encode_file, jobs, lambda job: f"tokenizing {job[1]}"):
                records[record["index"]] = record
                if progress is not None:
                    progress(record, len(records), len(files))
    except WorkerDied as err:
        _remove_partial(out)
        raise WorkerDied(
            f"{err}; the finished shards ({len(records)}) in {out} are kept: the same command "
            "finishes the rest (with fewer --workers if memory ran out)"
        ) from None
    except BaseException:  # Ctrl-C, a bad file: finished shards stay, half-written ones go
        if out.is_dir():
            _remove_partial(out)
        raise
    manifest = {
        "format": FORMAT,
        "tokenizer": tokenizer.fingerprint,
        "tokenizer_name": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "tokens": sum(r["tokens"] for r in records.values()),
        "documents": sum(r["documents"] for r in records.values()),
        "shards": [
            {k: v for k, v in records[i].items() if k not in ("index", "kept")}
            | {"file": _names(out, i)[0].name}
            for i in range(len(files))
        ],
    }
    with atomic_path(out / MANIFEST) as tmp:
        tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    _remove_stale(out, len(files))
    return manifest


def _one_by_one(fn: Callable[[Any], Any], jobs: list, describe) -> Iterator[Any]:
    """`WorkerPool.map_unordered` in this process."""
    return (fn(job) for job in jobs)


_SHARD_FILE = re.compile(r"shard-(\d{5,})\.(npy|docs\.npy|json)")


def _remove_stale(out: Path, count: int) -> None:
    """Shards numbered past this manifest's `count` (an earlier run had more inputs): removed
    when their sidecar shows that tokenize wrote them (its SHA-256s are their files'); any
    other file named like one was not proven ours, so it is left where it is, and named."""
    stale: dict[int, list[Path]] = {}
    for path in out.iterdir():
        match = _SHARD_FILE.fullmatch(path.name)
        if match and int(match[1]) >= count:
            stale.setdefault(int(match[1]), []).append(path)
    removed, left = [], []
    for index, paths in sorted(stale.items()):
        tokens_path, docs_path, sidecar = _names(out, index)
        if _written_by_tokenize(tokens_path, docs_path, sidecar):
            for path in (tokens_path, docs_path, sidecar):  # the sidecar last
                path.unlink()
            removed.append(sidecar.stem)
        else:
            left += sorted(p.name for p in paths)
    if removed:
        print(
            f"depthscale: note: removed {len(removed)} shard(s) of an earlier run's inputs "
            f"beyond these {count} ({', '.join(removed[:3])}{', ...' if len(removed) > 3 else ''}"
            f"), which {out / MANIFEST} no longer lists",
            file=sys.stderr,
            flush=True,
        )
    if left:
        print(
            f"depthscale: warning: {out} holds {len(left)} file(s) named like shards that its "
            f"manifest does not list and no sidecar shows tokenize wrote, left as they are: "
            f"{', '.join(left[:3])}{', ...' if len(left) > 3 else ''}",
            file=sys.stderr,
            flush=True,
        )


def _written_by_tokenize(tokens_path: Path, docs_path: Path, sidecar: Path) -> bool:
    try:
        record = json.loads(sidecar.read_text())
        hashes = record["sha256"], record["docs_sha256"]
        return hashes == (_sha256(tokens_path), _sha256(docs_path))
    except (OSError, ValueError, KeyError, TypeError):
        return False


def is_shard_dir(path: Path) -> bool:
    return path.is_dir() and (path / MANIFEST).is_file()


def read_shards(directory: Path, tokenizer: Tokenizer) -> ConcatTokens:
    """The shards of `directory` as one stream, checked against its manifest and `tokenizer`."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        shards = manifest["shards"]
        recorded = manifest["tokenizer"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DataError(f"{directory / MANIFEST}: not a shard manifest ({err!r})") from None
    if manifest.get("format") != FORMAT:
        raise DataError(
            f"{directory / MANIFEST}: format {manifest.get('format')!r}; allowed: {FORMAT!r}"
        )
    if recorded != tokenizer.fingerprint:
        theirs = tokenizer_label(manifest.get("tokenizer_name"), recorded)
        eos = manifest.get("eos_id", tokenizer.eos_id)
        other_eos = (
            f", EOS id {eos} there, {tokenizer.eos_id} here" if eos != tokenizer.eos_id else ""
        )
        raise DataError(
            f"{directory} was tokenized with another tokenizer ({theirs}), not data.tokenizer "
            f"({tokenizer.label}{other_eos}); allowed: the tokenizer that wrote the shards"
            + (" (data.eos_token picks its EOS)" if other_eos else "")
        )
    parts = []
    for shard in shards:
        path = directory / shard["file"]
        try:
            tokens = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as err:
            raise DataError(
                f"{path}: unreadable or truncated shard ({err}); rerun depthscale tokenize"
            ) from None
        if len(tokens) != shard["tokens"]:
            raise DataError(
                f"{path}: {len(tokens)} tokens, the manifest says {shard['tokens']}; rerun "
                "depthscale tokenize"
            )
        if shard["max_id"] >= tokenizer.vocab_size:
            raise DataError(f"{path}: token id {shard['max_id']} outside the vocabulary")
        parts.append(tokens)
    return ConcatTokens(parts)


__all__ = [
    "FORMAT",
    "MANIFEST",
    "input_files",
    "is_shard_dir",
    "read_shards",
    "refuse_other_tokenizer",
    "tokenize_to_shards",
]
