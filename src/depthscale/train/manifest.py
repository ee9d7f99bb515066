"""What makes a checkpoint directory complete and trustworthy: write, publish, verify, choose.

A crash mid-save, a truncated copy or a flipped bit must not be loaded silently or fail deep inside
DCP, so completeness is recorded rather than assumed:

- Write: every file is fsynced and hashed (SHA-256), and `manifest.json` (sizes, hashes, the step,
  the model's architecture) is written last, atomically (tmp + fsync + rename): its presence means
  every file it lists was complete. `publish` then renames `step_N.tmp/` to `step_N/`; a re-saved
  step's old directory is moved aside, not deleted, until the new one is in place.
- Verify before any load: `verify` re-hashes every file against the manifest, so damage, a `.tmp`
  leftover, or another model's checkpoint is named with a one-line reason. Checkpoints without a
  manifest (written before depthscale had them) do not verify.
- Choose: 'auto' (`newest_verified`) takes the newest checkpoint that verifies and warns about each
  newer one skipped; a named one must verify (`verified`). In a multi-rank run rank 0 alone chooses
  (it reads every file, serially) and broadcasts its choice (`choose_on_rank0`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

from depthscale.config import ModelConfig
from depthscale.errors import CheckpointError

TRAINER_STATE = "trainer_state.json"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
DCP_METADATA = ".metadata"
SHARED_FILES = (DCP_METADATA, TRAINER_STATE, MANIFEST)
"""The files of a version that every node holds when it is written to node-local memory."""
STEP_DIR = re.compile(r"step_(\d+)")
ARCHITECTURE = (
    "vocab_size",
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "ffn_dim",
    "multiple_of",
    "tie_embeddings",
    "parallel_block",
    "residual",
    "attnres_block_size",
    "attnres_n_blocks",
    "attnres_key_norm_gain",
)
"""Model config fields that decide which model a checkpoint belongs to: its parameters and how
sublayers combine. Numerics, RoPE extension and kernel choices may change between runs."""


def global_rank() -> int:
    """This process's rank in the default group (0 when not distributed)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def warn_from_rank0(msg: str, kind: str = "warning") -> None:
    """One line on stderr, from rank 0 only (every rank would repeat it)."""
    if global_rank() == 0:
        print(f"depthscale: {kind}: {msg}", file=sys.stderr, flush=True)


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def tmp_dir_of(final: Path) -> Path:
    """Where `final` is written until `publish_checkpoint` renames it into place."""
    return final.with_name(final.name + ".tmp")


def rng_file_name(rank: int) -> str:
    return f"rng_rank{rank}.pt"


def _step_of(name: str) -> int | None:
    match = STEP_DIR.fullmatch(name)
    return int(match.group(1)) if match else None


def list_checkpoints(root: Path) -> list[Path]:
    """The `step_N` directories under root, verified or not, oldest first. Other entries (a user's
    `step_best` copy, `.tmp` leftovers, files) are not ours and never listed."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _step_of(p.name) is not None]
    return sorted(found, key=lambda p: (_step_of(p.name), p.name))


def _note_strays(root: Path) -> None:
    """Say once per choice which entries under root are ignored, so a copy is not mistaken for one
    that was considered."""
    if not root.is_dir():
        return
    for entry in sorted(root.iterdir()):
        if entry.is_dir() and _step_of(entry.name) is not None:
            continue
        if entry.name.endswith(".tmp") and _step_of(entry.name[: -len(".tmp")]) is not None:
            why = "an unfinished save (removed before that step is saved again)"
        else:
            why = "not a checkpoint directory (those are named step_N)"
        warn_from_rank0(f"ignoring {entry}: {why}", kind="note")


# ---------------------------------------------------------------------------- manifest


def _architecture(model: ModelConfig) -> dict[str, Any]:
    return {k: getattr(model, k) for k in ARCHITECTURE}


def _digest(file: Path) -> str:
    with open(file, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def manifest_entries(files: Iterable[Path]) -> dict[str, dict[str, Any]]:
    """Manifest entries (size and hash) of files as they are on disk now."""
    return {f.name: {"bytes": f.stat().st_size, "sha256": _digest(f)} for f in files}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(file: Path, data: bytes) -> None:
    with open(file, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def torch_save_synced(obj: Any, file: Path) -> None:
    with open(file, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def write_manifest(
    tmp: Path,
    step: int,
    rng_ranks: int,
    model: ModelConfig | None,
    files: dict,
    nodes: int = 1,
) -> None:
    """Written last and atomically: its presence means every file it lists was complete.
    `nodes` > 1: a version in node-local memory, each file's entry naming the node that holds
    it ("node"); the `SHARED_FILES` are on every node."""
    manifest = {
        "format": MANIFEST_FORMAT,
        "step": step,
        "rng_ranks": rng_ranks,
        "model": _architecture(model) if model is not None else None,
        "files": files,
    }
    if nodes > 1:
        manifest["nodes"] = nodes
    part = tmp / (MANIFEST + ".part")
    write_synced(part, json.dumps(manifest, indent=1, sort_keys=True).encode())
    part.rename(tmp / MANIFEST)
    _fsync_dir(tmp)


def _unused_name(final: Path, suffix: str) -> Path:
    names = (final.with_name(f"{final.name}.{suffix}{n or ''}") for n in itertools.count())
    return next(p for p in names if not p.exists())


def publish_checkpoint(tmp: Path, final: Path) -> Path | None:
    """Rename the finished `tmp` to `final` and fsync the parent. An existing `final` (a re-save of
    the same step) is first moved aside, not deleted, and its new path returned: the caller removes
    it only now that the new checkpoint is in place."""
    aside = None
    if final.exists():
        aside = _unused_name(final, "old")
        final.rename(aside)
    tmp.rename(final)
    _fsync_dir(final.parent)
    return aside


# ---------------------------------------------------------------------------- verification


class _Damage(Exception):
    """Why a checkpoint does not verify (internal: `verify` turns it into its return value)."""


def verify(path: Path, model: ModelConfig | None = None, node: int | None = None) -> str | None:
    """None if `path` is a complete, intact checkpoint (of `model`'s architecture, when given),
    else a one-line reason. Reads and hashes every file; of a version in node-local memory (its
    manifest names "nodes"), the files `node` holds and the shared ones."""
    path = Path(path)
    if path.name.endswith(".tmp"):
        return "an unfinished save (a .tmp directory left by an interrupted run)"
    if not path.is_dir():
        return "not a directory"
    try:
        manifest = _read_manifest(path)
        _check_identity(path, manifest, model)
        _check_listed(manifest)
        files = part_of(manifest, node)
        _check_files(path, files)
        _check_contents(path, manifest["files"])
    except _Damage as damage:
        return str(damage)
    return None


def part_of(manifest: dict[str, Any], node: int | None) -> dict[str, dict]:
    """The manifest's entries for the files a node holds of a version in node-local memory
    (all of them for a version with one root, or `node` None on one that has none)."""
    files = manifest["files"]
    if manifest.get("nodes", 1) == 1:
        return files
    if node is None:
        raise _Damage(
            f"a version in the memory of {manifest['nodes']} nodes: each holds its own part "
            "(verify it per node)"
        )
    return {k: e for k, e in files.items() if e.get("node", node) == node}


def _read_manifest(path: Path) -> dict[str, Any]:
    file = path / MANIFEST
    if not file.is_file():
        raise _Damage(
            f"no {MANIFEST} (an unfinished save, or written by a depthscale without manifests)"
        )
    try:
        manifest = json.loads(file.read_bytes())
    except (OSError, ValueError) as err:
        raise _Damage(f"{MANIFEST} is not valid JSON ({err})") from None
    if not _well_formed(manifest):
        raise _Damage(f"{MANIFEST} is malformed or of an unknown format")
    return manifest


def _well_formed(m: Any) -> bool:
    if not (isinstance(m, dict) and m.get("format") == MANIFEST_FORMAT):
        return False
    files = m.get("files")
    return (
        isinstance(m.get("step"), int)
        and isinstance(m.get("rng_ranks"), int)
        and isinstance(m.get("nodes", 1), int)
        and isinstance(m.get("model"), dict | None)
        and isinstance(files, dict)
        and all(
            Path(name).name == name
            and name not in ("", ".", "..")
            and isinstance(entry, dict)
            and isinstance(entry.get("bytes"), int)
            and isinstance(entry.get("sha256"), str)
            for name, entry in files.items()
        )
    )


def _check_identity(path: Path, manifest: dict, model: ModelConfig | None) -> None:
    """The directory name and the model must match what the manifest says it holds."""
    named = _step_of(path.name)
    if named is not None and named != manifest["step"]:
        raise _Damage(f"its manifest is for step {manifest['step']}, not step {named}")
    saved = manifest["model"]
    if model is None or saved is None:
        return
    diffs = [
        f"model.{k}: checkpoint has {saved.get(k)!r}, config has {v!r}"
        for k, v in _architecture(model).items()
        if saved.get(k) != v and not (k == "vocab_size" and v == 0)  # 0: not resolved yet
    ]
    if diffs:
        raise _Damage("another model's checkpoint (" + "; ".join(diffs) + ")")


def _check_listed(manifest: dict) -> None:
    required = [DCP_METADATA, TRAINER_STATE]
    required += [rng_file_name(r) for r in range(manifest["rng_ranks"])]
    for name in required:
        if name not in manifest["files"]:
            raise _Damage(f"its manifest does not list {name}")


def _check_files(path: Path, files: dict[str, dict]) -> None:
    """Sizes first (cheap: a missing or truncated file is named without hashing the rest)."""
    for name, entry in sorted(files.items()):
        file = path / name
        if not file.is_file():
            raise _Damage(f"{name} is missing")
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise _Damage(
                f"{name} has {size} bytes, its manifest says {entry['bytes']} (truncated?)"
            )
    for name, entry in sorted(files.items()):
        try:
            digest = _digest(path / name)
        except OSError as err:
            raise _Damage(f"{name} cannot be read ({err})") from None
        if digest != entry["sha256"]:
            raise _Damage(f"{name} is corrupt (its SHA-256 differs from the manifest's)")


def _check_contents(path: Path, files: dict[str, dict]) -> None:
    """What the hashes cannot show: the trainer state parses, and every shard DCP's metadata names
    is one the manifest vouches for."""
    try:
        state = json.loads((path / TRAINER_STATE).read_bytes())
    except ValueError as err:
        raise _Damage(f"{TRAINER_STATE} is not valid JSON ({err})") from None
    if not isinstance(state, dict):
        raise _Damage(f"{TRAINER_STATE} does not hold a JSON object")
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as err:
        raise _Damage(f"{DCP_METADATA} cannot be read ({type(err).__name__}: {err})") from None
    for shard in sorted({s.relative_path for s in metadata.storage_data.values()}):
        if shard not in files:
            raise _Damage(f"its manifest does not list {shard}, a shard {DCP_METADATA} names")


# ---------------------------------------------------------------------------- choosing


def verified(path: Path, model: ModelConfig | None = None) -> Path:
    """`path` if it verifies, else CheckpointError with the reason: a checkpoint that was asked
    for by name is never silently swapped for another."""
    problem = verify(path, model)
    if problem is not None:
        raise CheckpointError(f"checkpoint {path} cannot be used: {problem}")
    return Path(path)


def newest_verified(root: Path, model: ModelConfig | None = None) -> Path | None:
    """The newest checkpoint under root that verifies, or None if root holds no checkpoint at all.
    Each newer one that fails is named in a warning with its reason (and left in place); if all
    fail, CheckpointError names the newest's reason rather than starting afresh beside them."""
    _note_strays(root)
    found = list_checkpoints(root)
    newest_problem = None
    for path in reversed(found):
        problem = verify(path, model)
        if problem is None:
            return path
        warn_from_rank0(f"skipping checkpoint {path}: {problem}")
        newest_problem = newest_problem or f"{path.name}: {problem}"
    if found:
        raise CheckpointError(
            f"none of the {len(found)} checkpoints under {root} verifies (newest, {newest_problem}); "
            "move them elsewhere to start afresh, or name a good one"
        )
    return None


def choose_on_rank0(choose: Callable[[], Path | None]) -> Path | None:
    """choose() on rank 0, its result (or CheckpointError) given to every rank, so that all ranks
    load the same checkpoint and fail alike."""
    if not (dist.is_available() and dist.is_initialized()):
        return choose()
    box: list[Any] = [None]
    if global_rank() == 0:
        try:
            box[0] = choose()
        except CheckpointError as err:
            box[0] = err
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], CheckpointError):
        raise box[0]
    return box[0]
