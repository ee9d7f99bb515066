"""Reading a checkpoint back: model and optimizer through DCP, the trainer's state and RNG, with
every byte read from storage counted (`ReadLog`, `RestoreStats`).

Load once per replica group, then broadcast (MegaScale). Ranks that hold the same values read them
once: DTensors (FSDP and TP shards) are the same on ranks differing only in `dp_replicate`; plain
tensors (DDP replicas, parameters FSDP keeps whole, optimizer step counts) on every data-parallel
and cp rank. Each group's first rank reads its part through DCP, on a group of such readers (DCP
reshards as usual when the saved layout differs), and broadcasts it. All ranks together then read
what one process loading the whole checkpoint reads, whatever the dp degree. RNG state is per
rank (tiny) and read by every rank, as are `.metadata` and `trainer_state.json`.
"""

from __future__ import annotations

import io
import json
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from depthscale.errors import CheckpointError
from depthscale.parallel.mesh import flat
from depthscale.parallel.startup import own_group
from depthscale.train.manifest import TRAINER_STATE, global_rank, rng_file_name

SHARD_SUFFIX = ".distcp"
Resolve = Callable[[str], Path]
"""Where a file of a checkpoint is, by name, when not all of it is in one directory: a version
in the memory of several nodes (train/snapshot.py) fetches another node's files on first use."""
_BUCKET_BYTES = 64 << 20
"""Tensors are broadcast concatenated, at most this many bytes per message."""


def dcp_quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        # DCP warns that it runs without a process group on a single process; that is intended.
        warnings.filterwarnings("ignore", message=".*single process.*")
        warnings.filterwarnings("ignore", category=FutureWarning)
        return fn(*args, **kwargs)


def failed_rank(err: BaseException) -> tuple[int | None, BaseException]:
    """The first failing rank and its exception inside DCP's CheckpointException (which holds
    every failing rank's traceback), else (None, err)."""
    if isinstance(err, CheckpointException) and err.failures:
        rank, (exc, _) = min(err.failures.items(), key=lambda item: item[0])
        return rank, exc
    return None, err


def cause(err: BaseException) -> str:
    """One line naming what failed (and on which rank, for DCP's collective errors)."""
    rank, exc = failed_rank(err)
    where = f"rank {rank}: " if rank is not None else ""
    return f"{where}{type(exc).__name__}: {exc}"


# ---------------------------------------------------------------------------- counted reads


class ReadLog:
    """Bytes read per file name, and which byte ranges (to tell reading twice from reading all)."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}
        self.ranges: dict[str, list[tuple[int, int]]] = {}

    def add(self, name: str, start: int, n: int) -> None:
        self.bytes[name] = self.bytes.get(name, 0) + n
        self.ranges.setdefault(name, []).append((start, start + n))


class _CountingRaw(io.RawIOBase):
    def __init__(self, file: io.FileIO, log: ReadLog, name: str) -> None:
        self._file, self._log, self._name = file, log, name

    def readinto(self, buffer: Any) -> int:
        start = self._file.tell()
        n = self._file.readinto(buffer)
        self._log.add(self._name, start, n or 0)
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._file.seek(offset, whence)

    def tell(self) -> int:
        return self._file.tell()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def close(self) -> None:
        self._file.close()
        super().close()


class _CountingFileSystem(FileSystem):
    """DCP's local file system, logging the bytes each read gets. Unbuffered: DCP reads each
    item's byte range, and a buffer's read-ahead past it would be read again with the next item."""

    def __init__(self, log: ReadLog, resolve: Resolve | None = None) -> None:
        self.log = log
        self.resolve = resolve

    @contextmanager
    def create_stream(self, path: str | Path, mode: str) -> Iterator[io.IOBase]:
        if "r" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        path = _located(Path(path), self.resolve)
        with _CountingRaw(io.FileIO(path, "rb"), self.log, Path(path).name) as stream:
            yield stream


class CountingReader(FileSystemReader):
    """`FileSystemReader` that logs what it reads into `log`."""

    def __init__(self, path: Path, log: ReadLog, resolve: Resolve | None = None) -> None:
        super().__init__(str(path))
        self.fs = _CountingFileSystem(log, resolve)


def _located(file: Path, resolve: Resolve | None) -> Path:
    return resolve(file.name) if resolve is not None else file


@dataclass
class RestoreStats:
    """What one rank read from storage while restoring. `shard_bytes`: from the `.distcp` tensor
    files (DCP's torch.load re-reads each item's zip headers: a little over the item's size);
    `shard_ranges`: which bytes of each; `other_bytes`: `.metadata`, trainer state and RNG file;
    `from_storage`: False when the tensors came from the replica group's first rank instead."""

    shard_bytes: int = 0
    other_bytes: int = 0
    shard_ranges: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    from_storage: bool = True
    seconds: float = 0.0

    @classmethod
    def of(cls, log: ReadLog, from_storage: bool, seconds: float) -> RestoreStats:
        shards = [name for name in log.bytes if name.endswith(SHARD_SUFFIX)]
        shard_bytes = sum(log.bytes[name] for name in shards)
        other = sum(log.bytes.values()) - shard_bytes
        ranges = {name: log.ranges[name] for name in shards}
        return cls(shard_bytes, other, ranges, from_storage, seconds)


def distinct_bytes(stats: list[RestoreStats]) -> int:
    """Bytes of the shard files that any of `stats` (one per rank) read at least once."""
    total = 0
    for name in {n for s in stats for n in s.shard_ranges}:
        end = 0
        for a, b in sorted(r for s in stats for r in s.shard_ranges.get(name, [])):
            total += max(0, b - max(a, end))
            end = max(end, b)
    return total


def _read_counted(file: Path, log: ReadLog, resolve: Resolve | None = None) -> bytes:
    data = _located(file, resolve).read_bytes()
    log.add(file.name, 0, len(data))
    return data


# ---------------------------------------------------------------------------- replicas


@dataclass
class Replicas:
    """This rank's replica group (ranks holding identical values) and who reads for it."""

    group: dist.ProcessGroup
    src: int
    """Global rank of the group's reader (its first member)."""
    readers: dist.ProcessGroup | None
    """The group of all readers, for DCP (None on ranks that receive)."""

    @property
    def reads(self) -> bool:
        return global_rank() == self.src


REPLICA_DIMS = {"dp_replicate": ("dp_replicate",), "dp_cp": ("dp_replicate", "dp_shard", "cp")}
"""Mesh dimensions over which ranks hold the same values: DTensors (FSDP shards, TP shards) differ
in everything but `dp_replicate`; plain tensors (parameters FSDP keeps whole, step counters, DDP's
replicas) are the same on every data-parallel and cp rank (the plan averages them over `dp_cp`)."""


def replicas_of(mesh: DeviceMesh | None, name: str) -> Replicas | None:
    """This rank's replicas along mesh dimension `name` (a key of REPLICA_DIMS), or None when
    there are none. Creates the readers' group: every rank calls it at the same point."""
    if mesh is None:
        return None
    dims, names = REPLICA_DIMS[name], mesh.mesh_dim_names or ()
    if any(d not in names for d in dims) or all(mesh.size(names.index(d)) == 1 for d in dims):
        return None
    group = flat(mesh, name).get_group()
    src = dist.get_global_rank(group, 0)
    # every rank makes exactly one group (`own_group`: a non-reader makes one of itself). torch
    # names a group by its ranks and how many groups this rank holds; with `dist.new_group` only
    # the readers would hold one more, and every group made after a restore (a mesh of another
    # layout, say) would get a different name on readers and the rest: a hang
    first = tuple(0 if n in dims else slice(None) for n in names)
    readers = own_group([mesh.mesh[first].flatten().tolist()], "restore_readers")
    if global_rank() != src:
        readers = None
    return Replicas(group, src, readers)


def _leaves(obj: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _leaves(v, (*path, i))
    else:
        yield path, obj


def _set_leaf(obj: Any, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value


def broadcast_state(state: dict, replicas: Replicas) -> None:
    """Give every replica the reader's values, in place: tensors (DTensors' local shards)
    concatenated per dtype into few messages, other leaves (optimizer settings) as one object."""
    leaves = list(_leaves(state))
    scalars = [{p: v for p, v in leaves if not isinstance(v, Tensor)}]
    dist.broadcast_object_list(scalars, src=replicas.src, group=replicas.group)
    if not replicas.reads:
        for path, value in scalars[0].items():
            _set_leaf(state, path, value)
    tensors = [v.to_local() if isinstance(v, DTensor) else v for _, v in leaves]
    tensors = [t for t in tensors if isinstance(t, Tensor)]
    nccl = dist.get_backend(replicas.group) == "nccl"
    wire = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    for bucket in _buckets(tensors):
        flat = torch.cat([t.detach().reshape(-1).to(wire) for t in bucket])
        dist.broadcast(flat, src=replicas.src, group=replicas.group)
        if replicas.reads:
            continue
        offset = 0
        for t in bucket:
            t.detach().copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def _buckets(tensors: list[Tensor]) -> Iterator[list[Tensor]]:
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        bucket: list[Tensor] = []
        size = 0
        for t in same:
            if bucket and size + t.numel() * t.element_size() > _BUCKET_BYTES:
                yield bucket
                bucket, size = [], 0
            bucket.append(t)
            size += t.numel() * t.element_size()
        if bucket:
            yield bucket


# ---------------------------------------------------------------------------- loading


def _dcp_load(state: dict, path: Path, reader: FileSystemReader, group=None) -> None:
    try:
        dcp_quiet(dcp.load, state, storage_reader=reader, process_group=group)
    except (Exception, CheckpointException) as err:  # the latter is a BaseException
        raise CheckpointError(f"cannot load checkpoint {path}: {cause(err)}") from err


def _optimizer_flat(path: Path, log: ReadLog, resolve: Resolve | None) -> bool:
    """Whether the checkpoint's optimizer state is flattened (older checkpoints are nested)."""
    try:
        keys = CountingReader(path, log, resolve).read_metadata().state_dict_metadata
    except Exception as err:
        raise CheckpointError(f"cannot read checkpoint metadata {path}: {cause(err)}") from err
    return not any(k.startswith("optim.param_groups.0.") for k in keys)


def restore(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    mesh: DeviceMesh | None = None,
    load_once: bool = True,
    resolve: Resolve | None = None,
) -> tuple[dict, RestoreStats]:
    """Load model (and optimizer) state in place; returns the trainer state and what this rank
    read. With replicas in `mesh` and `load_once`, one rank per replica group reads and
    broadcasts (bitwise the same as every rank reading; `load_once=False` does that).

    The optimizer's state (moments, step counts) comes from the checkpoint, its group settings
    (weight decay, betas, eps, LAMB's options) from `optimizer` as the config built it. Torch's
    flattened load would give each group the saved settings of its *first* parameter: after a
    config change that moves a parameter between groups (`optim.decay_embeddings`), the
    embedding's saved weight_decay 0 would end up on every matrix."""
    start = time.perf_counter()
    log = ReadLog()
    trainer_state = read_trainer_state(path, log, resolve)
    if optimizer is None or is_model_only(trainer_state):
        load_model(path, model, log, resolve)
        return trainer_state, RestoreStats.of(log, True, time.perf_counter() - start)
    configured = [
        {k: v for k, v in g.items() if k not in ("params", "lr")} for g in optimizer.param_groups
    ]
    settings = [set(g) for g in optimizer.param_groups]
    options = StateDictOptions(flatten_optimizer_state_dict=_optimizer_flat(path, log, resolve))
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    state = {"model": model_sd, "optim": optim_sd}
    from_storage = True
    if load_once and options.flatten_optimizer_state_dict:
        from_storage = False
        for part, name in zip(_split(state), REPLICA_DIMS):
            from_storage |= _load_part(part, path, log, replicas_of(mesh, name), resolve)
            for top, values in part.items():
                state[top].update(values)
    else:
        _dcp_load(state, path, CountingReader(path, log, resolve))
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=options,
    )
    if [set(g) for g in optimizer.param_groups] != settings:
        raise CheckpointError(
            f"the optimizer state in {path} was written by an older depthscale that mixed up "
            "the parameter groups of pipeline stages; its weights load "
            "(`depthscale generate --run`), its optimizer state cannot: resume from a newer "
            "checkpoint or start a new run (--checkpoint.resume none)"
        )
    for group, own in zip(optimizer.param_groups, configured):
        group.update(own)  # lr: the schedule sets it before every step
    _restore_rng(path / rng_file_name(global_rank()), log, resolve)
    return trainer_state, RestoreStats.of(log, from_storage, time.perf_counter() - start)


def _split(state: dict) -> tuple[dict, dict]:
    """(DTensors, everything else) of a flat {"model": ..., "optim": ...} state dict."""
    sharded = {
        top: {k: v for k, v in sd.items() if isinstance(v, DTensor)} for top, sd in state.items()
    }
    plain = {
        top: {k: v for k, v in sd.items() if k not in sharded[top]} for top, sd in state.items()
    }
    return sharded, plain


def _load_part(
    part: dict, path: Path, log: ReadLog, replicas: Replicas | None, resolve: Resolve | None
) -> bool:
    """Read `part` here (every rank without replicas, else the replica group's reader) and
    broadcast it to the replicas; returns whether this rank read from storage."""
    reads = replicas is None or replicas.reads
    if reads:
        _dcp_load(part, path, CountingReader(path, log, resolve), replicas and replicas.readers)
    if replicas is not None:
        broadcast_state(part, replicas)
    return reads


def _restore_rng(file: Path, log: ReadLog, resolve: Resolve | None = None) -> None:
    try:
        data = _read_counted(file, log, resolve)
    except (FileNotFoundError, KeyError):  # absent for ranks beyond the saving run's world size
        return
    try:
        rng = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as err:
        raise CheckpointError(f"cannot load {file}: {cause(err)}") from err
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])


def is_model_only(trainer_state: dict) -> bool:
    """A model-only checkpoint (`save_model`: an imported model) has weights but no optimizer or
    data position: training starts from its weights with a fresh optimizer."""
    return bool(trainer_state.get("model_only", False))


def read_trainer_state(
    path: Path, log: ReadLog | None = None, resolve: Resolve | None = None
) -> dict:
    file = Path(path) / TRAINER_STATE
    if resolve is None and not file.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint: {TRAINER_STATE} is missing")
    try:
        return json.loads(_read_counted(file, log if log is not None else ReadLog(), resolve))
    except ValueError as err:
        raise CheckpointError(f"{file} is not valid JSON: {err}") from err


def load_model(
    path: Path, model: nn.Module, log: ReadLog | None = None, resolve: Resolve | None = None
) -> None:
    """Load only the model weights of a checkpoint (generation, conversion, evaluation); every
    rank reads what it holds."""
    state = {"model": model.state_dict()}
    _dcp_load(state, path, CountingReader(path, log if log is not None else ReadLog(), resolve))
    model.load_state_dict(state["model"])
