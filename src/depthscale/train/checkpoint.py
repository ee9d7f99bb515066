"""Checkpoints: model and optimizer through torch.distributed.checkpoint (sharded, reshardable on
load), plus the trainer's own small state (step, data position, RNG), and a manifest.

Writing: everything goes into `step_XXXXXXXX.tmp/`. Each rank saves its DCP shards and RNG state,
fsyncs them and hashes what it wrote (SHA-256; one read per rank, in parallel, usually from the page
cache); rank 0 gathers the hashes, writes `trainer_state.json`, then `manifest.json` last (tmp +
fsync + rename): file sizes and hashes, the step, and the model's architecture. Only then is the
directory renamed to `step_XXXXXXXX/` and its parent fsynced. A re-save of an existing step moves the
old directory aside and deletes it only once the new one is in place.

Reading: `verify` re-hashes every file against the manifest, so a truncated or flipped shard, a
missing file, a `.tmp` leftover or another model's checkpoint is named with a one-line reason
instead of loading silently or failing deep inside DCP. Choosing ('auto', `newest_verified`) takes
the newest checkpoint that verifies and warns about each newer one skipped; an explicitly named
checkpoint must verify. A multi-rank run verifies on rank 0 alone (it reads every file, serially)
and broadcasts the choice. Checkpoints without a manifest (written before depthscale had them) do
not verify: they are skipped, and refused when named.

Retention (`checkpoint.keep`) counts verified checkpoints only, runs after the new one is complete,
and never deletes a damaged one (it is named in a warning instead, for inspection).

With `async_save`, saving is MegaScale's two stages: the state is first copied into host memory
(training waits only for this), then a background thread writes it to disk.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import shutil
import sys
import threading
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from depthscale.config import CheckpointConfig, ModelConfig
from depthscale.errors import CheckpointError

if TYPE_CHECKING:
    from depthscale.model.transformer import Transformer

TRAINER_STATE = "trainer_state.json"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
DCP_METADATA = ".metadata"
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


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _warn(msg: str, kind: str = "warning") -> None:
    """One line on stderr, from rank 0 only (every rank would repeat it)."""
    if _rank() == 0:
        print(f"depthscale: {kind}: {msg}", file=sys.stderr, flush=True)


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def _tmp_of(final: Path) -> Path:
    return final.with_name(final.name + ".tmp")


def _rng_name(rank: int) -> str:
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
        _warn(f"ignoring {entry}: {why}", kind="note")


# ---------------------------------------------------------------------------- manifest


def _architecture(model: ModelConfig) -> dict[str, Any]:
    return {k: getattr(model, k) for k in ARCHITECTURE}


def _digest(file: Path) -> str:
    with open(file, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _describe(files: Iterable[Path]) -> dict[str, dict[str, Any]]:
    """Manifest entries (size and hash) of files as they are on disk now."""
    return {f.name: {"bytes": f.stat().st_size, "sha256": _digest(f)} for f in files}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(file: Path, data: bytes) -> None:
    with open(file, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _save_synced(obj: Any, file: Path) -> None:
    with open(file, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_manifest(
    tmp: Path, step: int, rng_ranks: int, model: ModelConfig | None, files: dict
) -> None:
    """Written last and atomically: its presence means every file it lists was complete."""
    manifest = {
        "format": MANIFEST_FORMAT,
        "step": step,
        "rng_ranks": rng_ranks,
        "model": _architecture(model) if model is not None else None,
        "files": files,
    }
    part = tmp / (MANIFEST + ".part")
    _write_synced(part, json.dumps(manifest, indent=1, sort_keys=True).encode())
    part.rename(tmp / MANIFEST)
    _fsync_dir(tmp)


def _unused_name(final: Path, suffix: str) -> Path:
    names = (final.with_name(f"{final.name}.{suffix}{n or ''}") for n in itertools.count())
    return next(p for p in names if not p.exists())


def _publish(tmp: Path, final: Path) -> Path | None:
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


def verify(path: Path, model: ModelConfig | None = None) -> str | None:
    """None if `path` is a complete, intact checkpoint (of `model`'s architecture, when given),
    else a one-line reason. Reads and hashes every file."""
    path = Path(path)
    if path.name.endswith(".tmp"):
        return "an unfinished save (a .tmp directory left by an interrupted run)"
    if not path.is_dir():
        return "not a directory"
    try:
        manifest = _read_manifest(path)
        _check_identity(path, manifest, model)
        _check_listed(manifest)
        _check_files(path, manifest["files"])
        _check_contents(path, manifest["files"])
    except _Damage as damage:
        return str(damage)
    return None


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
    required += [_rng_name(r) for r in range(manifest["rng_ranks"])]
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
        _warn(f"skipping checkpoint {path}: {problem}")
        newest_problem = newest_problem or f"{path.name}: {problem}"
    if found:
        raise CheckpointError(
            f"none of the {len(found)} checkpoints under {root} verifies (newest, {newest_problem}); "
            "move them elsewhere to start afresh, or name a good one"
        )
    return None


def _agreed(choose: Callable[[], Path | None]) -> Path | None:
    """choose() on rank 0, its result (or CheckpointError) given to every rank, so that all ranks
    load the same checkpoint and fail alike."""
    if not (dist.is_available() and dist.is_initialized()):
        return choose()
    box: list[Any] = [None]
    if _rank() == 0:
        try:
            box[0] = choose()
        except CheckpointError as err:
            box[0] = err
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], CheckpointError):
        raise box[0]
    return box[0]


# ---------------------------------------------------------------------------- DCP calls


def _dcp_quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        # DCP warns that it runs without a process group on a single process; that is intended.
        warnings.filterwarnings("ignore", message=".*single process.*")
        warnings.filterwarnings("ignore", category=FutureWarning)
        return fn(*args, **kwargs)


def _cause(err: BaseException) -> str:
    """One line: DCP's CheckpointException message is every failing rank's whole traceback."""
    if isinstance(err, CheckpointException) and err.failures:
        rank, (exc, _) = min(err.failures.items(), key=lambda item: item[0])
        return f"rank {rank}: {type(exc).__name__}: {exc}"
    return f"{type(err).__name__}: {err}"


def _dcp_save(state: dict, path: Path, group: dist.ProcessGroup | None) -> None:
    try:
        _dcp_quiet(dcp.save, state, checkpoint_id=str(path), process_group=group)
    except (Exception, CheckpointException) as err:  # the latter is a BaseException
        raise CheckpointError(f"cannot save checkpoint {path}: {_cause(err)}") from err


def _dcp_load(state: dict, path: Path) -> None:
    try:
        _dcp_quiet(dcp.load, state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as err:  # the latter is a BaseException
        raise CheckpointError(f"cannot load checkpoint {path}: {_cause(err)}") from err


def _stage(obj: Any) -> Any:
    """Copy every tensor in a nested state dict into host memory, detached from the live state."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _stage(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_stage(v) for v in obj)
    return obj


def _own_files(tmp: Path, rank: int) -> list[Path]:
    """What this rank wrote: its DCP shards (DCP names them by rank in the checkpoint's group, which
    spans all ranks) and RNG state; rank 0 is also DCP's coordinator, which writes `.metadata`."""
    files = [*tmp.glob(f"__{rank}_*.distcp"), tmp / _rng_name(rank)]
    if rank == 0:
        files.append(tmp / DCP_METADATA)
    return files


def _gathered(mine: dict, group: dist.ProcessGroup | None) -> dict:
    """On rank 0, every rank's manifest entries merged (other ranks get theirs back)."""
    if not dist.is_initialized():
        return mine
    parts: list[Any] | None = [None] * dist.get_world_size(group) if _rank() == 0 else None
    dist.gather_object(mine, parts, dst=0, group=group)
    return {k: v for part in parts for k, v in part.items()} if parts is not None else mine


class Checkpointer:
    def __init__(self, root: Path, cfg: CheckpointConfig, model: ModelConfig | None = None) -> None:
        """`model` is recorded in each manifest and checked on resume; it is read at each use, so a
        vocab_size resolved after construction is the one recorded."""
        self.root = Path(root)
        self.cfg = cfg
        self.model = model
        self._pending: threading.Thread | None = None
        self._error: BaseException | None = None
        self._group: dist.ProcessGroup | None = None
        self._verdicts: dict[Path, str | None] = {}

    def latest(self) -> Path | None:
        """The newest `step_N` directory (not verified: for messages, not for loading)."""
        found = list_checkpoints(self.root)
        return found[-1] if found else None

    def resolve_resume(self) -> Path | None:
        """The checkpoint to resume from per `checkpoint.resume`, or None to start fresh. Rank 0
        verifies (reading every file) and all ranks take its choice."""
        return _agreed(self._choose)

    def _choose(self) -> Path | None:
        if self.cfg.resume == "none":
            if list_checkpoints(self.root):
                raise CheckpointError(
                    f"{self.root} already holds checkpoints and checkpoint.resume='none' would train "
                    "over them; use --checkpoint.resume auto to continue, or a new --train.name"
                )
            return None
        if self.cfg.resume == "auto":
            return newest_verified(self.root, self.model)
        return verified(Path(self.cfg.resume), self.model)

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer_state: dict[str, Any],
    ) -> Path:
        """Save; with async_save, returns once the state is staged in host memory."""
        self.wait()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        if self.cfg.async_save and dist.is_initialized() and self._group is None:
            # A background save must not interleave its collectives with training's on one group.
            self._group = dist.new_group(backend="gloo")
        if self.cfg.async_save:
            staged = _stage(state)
            self._pending = threading.Thread(
                target=self._write_guarded, args=(step, staged, rng, trainer_state), daemon=True
            )
            self._pending.start()
        else:
            self._write(step, state, rng, trainer_state)
        return _step_dir(self.root, step)

    def wait(self) -> None:
        """Block until a background save has finished; re-raise its error here, not silently."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointError(f"background checkpoint save failed: {err}") from err

    def _write_guarded(self, *args: Any) -> None:
        try:
            self._write(*args)
        except BaseException as err:  # surfaced by wait() on the training thread
            self._error = err

    def _write(self, step: int, state: dict, rng: dict, trainer_state: dict) -> None:
        final = _step_dir(self.root, step)
        tmp = _tmp_of(final)
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted save of this step
            tmp.mkdir(parents=True)
        if dist.is_initialized():
            dist.barrier(group=self._group)
        _dcp_save(state, tmp, self._group)
        _save_synced(rng, tmp / _rng_name(_rank()))
        files = _gathered(_describe(_own_files(tmp, _rank())), self._group)
        if _rank() != 0:
            return
        _write_synced(tmp / TRAINER_STATE, json.dumps(trainer_state, indent=1).encode())
        files |= _describe([tmp / TRAINER_STATE])
        ranks = dist.get_world_size(self._group) if dist.is_initialized() else 1
        _write_manifest(tmp, step, ranks, self.model, files)
        self._replace(tmp, final)
        self._prune()

    def _verdict(self, path: Path) -> str | None:
        """verify(), once per path per run: the bytes of a checkpoint do not change under us."""
        if path not in self._verdicts:
            self._verdicts[path] = verify(path, self.model)
        return self._verdicts[path]

    def _replace(self, tmp: Path, final: Path) -> None:
        """Publish the new checkpoint; an old one of the same step is deleted after that, unless it
        was damaged: then it is kept aside for inspection."""
        problem = self._verdict(final) if final.exists() else None
        aside = _publish(tmp, final)
        self._verdicts[final] = None  # its hashes were just taken from the files as written
        if aside is None:
            return
        if problem is None:
            shutil.rmtree(aside)
        else:
            _warn(f"kept the damaged checkpoint that {final.name} replaces, as {aside}: {problem}")

    def _prune(self) -> None:
        """Keep the newest `keep` verified checkpoints. Damaged ones (another model's included) are
        neither counted nor deleted; each is named in a warning once."""
        if self.cfg.keep <= 0:
            return
        kept: list[Path] = []
        for path in reversed(list_checkpoints(self.root)):
            first_look = path not in self._verdicts
            problem = self._verdict(path)
            if problem is None:
                kept.append(path)
            elif first_look:
                _warn(
                    f"leaving damaged checkpoint {path} in place, not counted toward "
                    f"checkpoint.keep: {problem}"
                )
        for old in kept[self.cfg.keep :]:
            shutil.rmtree(old, ignore_errors=True)
            del self._verdicts[old]

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
        """Load model (and optimizer) state in place; returns the trainer state. `path` should
        have been chosen through verification (resolve_resume)."""
        trainer_state = read_trainer_state(path)
        if optimizer is None or is_model_only(trainer_state):
            load_model(path, model)
            return trainer_state
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        _dcp_load(state, path)
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        rng_file = path / _rng_name(_rank())
        if rng_file.is_file():  # absent for ranks beyond the saving run's world size
            try:
                rng = torch.load(rng_file, weights_only=True)
            except Exception as err:
                raise CheckpointError(f"cannot load {rng_file}: {_cause(err)}") from err
            torch.set_rng_state(rng["torch"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
        return trainer_state


def is_model_only(trainer_state: dict) -> bool:
    """A model-only checkpoint (`save_model`: an imported model) has weights but no optimizer or
    data position: training starts from its weights with a fresh optimizer."""
    return bool(trainer_state.get("model_only", False))


def read_trainer_state(path: Path) -> dict:
    file = Path(path) / TRAINER_STATE
    if not file.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint: {TRAINER_STATE} is missing")
    try:
        return json.loads(file.read_text())
    except ValueError as err:
        raise CheckpointError(f"{file} is not valid JSON: {err}") from err


def load_model(path: Path, model: nn.Module) -> None:
    """Load only the model weights of a checkpoint (generation, conversion, evaluation)."""
    state = {"model": model.state_dict()}
    _dcp_load(state, path)
    model.load_state_dict(state["model"])


def save_model(path: Path, model: Transformer, trainer_state: dict[str, Any]) -> None:
    """Write a model-only checkpoint (e.g. a converted Hugging Face model) in the same layout,
    manifest included, so that it verifies like a trained one."""
    final = Path(path)
    tmp = _tmp_of(final)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    trainer_state = {**trainer_state, "model_only": True}
    _dcp_save({"model": model.state_dict()}, tmp, None)
    _write_synced(tmp / TRAINER_STATE, json.dumps(trainer_state, indent=1).encode())
    files = _describe([*tmp.glob("*.distcp"), tmp / DCP_METADATA, tmp / TRAINER_STATE])
    _write_manifest(tmp, trainer_state.get("step", 0), 0, model.cfg, files)
    aside = _publish(tmp, final)
    if aside is not None:
        shutil.rmtree(aside)
