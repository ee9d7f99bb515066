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
shards is refused, untouched.

Training on the directory (`data.path = DIR`) reads the shards in manifest order as one stream
(`data/concat.py`), the stream `data.path = <the inputs>` would tokenize to: the same batches.
Start-up checks sizes and counts against the manifest, not hashes (a rerun of `tokenize`
verifies those).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from depthscale.config import DataConfig
from depthscale.data.cache import atomic_path
from depthscale.data.concat import ConcatTokens
from depthscale.data.encode import encode_documents, token_dtype, write_npy_stream
from depthscale.data.sources import (
    SHARD_MANIFEST,
    TEXT_SUFFIXES,
    corpus_files,
    iter_documents,
    parquet_file,
    text_suffix,
)
from depthscale.data.tokenizer import Tokenizer, tokenizer_label
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
    each checked to have `field` before any work (parquet schemas, a .jsonl's first line)."""
    files: list[Path] = []
    for text in inputs:
        cfg = DataConfig(path=text, jsonl_field=field)
        found = corpus_files(cfg)
        for f in found:
            if not text_suffix(f.name):
                raise DataError(
                    f"{f}: depthscale tokenize reads text; allowed: "
                    + ", ".join(TEXT_SUFFIXES)
                    + " files or folders of them (token files train as they are)"
                )
        files += found
    for f in files:
        _check_field(f, field)
    return files


def _check_field(path: Path, field: str) -> None:
    if path.name.endswith(".parquet"):
        parquet_file(path, field, "--field")
    elif ".jsonl" in path.name:  # reads the first record
        next(iter(iter_documents(DataConfig(path=str(path), jsonl_field=field, max_bytes=1))), None)


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


def _started_ignoring_sigint(ctx, processes: int):
    """A pool whose workers ignore SIGINT from their first instruction: started while this
    process ignores it (an ignored signal stays ignored across exec, and Python then installs no
    handler), so a Ctrl-C during their start-up is not a traceback in each."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return ctx.Pool(processes)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return ctx.Pool(processes)
    finally:
        signal.signal(signal.SIGINT, previous)


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
    manifest. `progress(record, done, total)` is called as each shard finishes."""
    out.mkdir(parents=True, exist_ok=True)
    refuse_other_tokenizer(out, tokenizer)
    records: dict[int, dict] = {}
    jobs = []
    for i, f in enumerate(files):
        kept = _finished(out, i, f, tokenizer)
        if kept is not None:
            records[i] = kept | {"kept": True}
        else:
            jobs.append((i, str(f), str(out), tokenizer, field))
    if progress is not None:
        for done, record in enumerate(records.values(), 1):
            progress(record, done, len(files))
    _remove_partial(out)  # what a killed run was writing
    try:
        if workers > 1 and len(jobs) > 1:
            # spawn: tokenizers' thread pools do not survive fork; the workers leave Ctrl-C to
            # this process, which stops them
            ctx = multiprocessing.get_context("spawn")
            with _started_ignoring_sigint(ctx, min(workers, len(jobs))) as pool:
                for record in pool.imap_unordered(_encode_file, jobs):
                    records[record["index"]] = record
                    if progress is not None:
                        progress(record, len(records), len(files))
        else:
            for job in jobs:
                record = _encode_file(job)
                records[record["index"]] = record
                if progress is not None:
                    progress(record, len(records), len(files))
    except BaseException:  # Ctrl-C, a bad file: finished shards stay, half-written ones go
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
    return manifest


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
