"""Writing one checkpoint, everywhere it is written: on the training thread (a synchronous save), on
a background thread, or in this rank's writer process (save_process.py). Kept apart from the
`Checkpointer` so that the writer process imports the write path alone, not the training side.

Everything goes into `step_XXXXXXXX.tmp/`. Each rank saves its DCP shards and RNG state, fsyncs
them and hashes what it wrote (SHA-256; one read per rank, in parallel, usually from the page
cache); rank 0 gathers the hashes, writes `trainer_state.json`, then the manifest last. Only then is
the directory renamed to `step_XXXXXXXX/` and its parent fsynced. A re-save of an existing step moves
the old directory aside and deletes it only once the new one is in place.

A failing write (a full disk, a file-size limit: any OSError) does not stop training. After each
stage of a save every rank learns whether any rank failed (`_agree`), so no rank waits in a
collective for a peer that gave up, and only a save that succeeded everywhere is published. A
failed one is named once, on rank 0, its `.tmp` directory removed; the previous checkpoint is
untouched and the next save is attempted as usual.

Retention (`checkpoint.keep`) counts verified checkpoints only, runs after the new one is complete,
re-hashes the checkpoints it keeps before it deletes an older one (a verdict from save time is not
trusted: bytes change after they were written), and never deletes a damaged one (it is named in a
warning instead, for inspection).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlanner

from depthscale.config import CheckpointConfig, ModelConfig
from depthscale.errors import CheckpointError
from depthscale.resilience.replica import replicated_step
from depthscale.train.manifest import (
    DCP_METADATA,
    MANIFEST,
    SHARED_FILES,
    TRAINER_STATE,
    _step_of,
    global_rank,
    list_checkpoints,
    manifest_entries,
    publish_checkpoint,
    rng_file_name,
    step_dir,
    tmp_dir_of,
    torch_save_synced,
    verify,
    warn_from_rank0,
    write_manifest,
    write_synced,
)
from depthscale.train.restore import cause, dcp_quiet, failed_rank
from depthscale.train.storage import describe as describe_storage_failure
from depthscale.train.storage import is_storage_failure

if TYPE_CHECKING:
    from depthscale.model.transformer import Transformer


@dataclass
class SaveRecord:
    """One save, as logged: `blocking_s` is what training waited for (for an async save, the
    previous save's tail plus staging into host memory; for a sync one, the whole write)."""

    step: int
    is_async: bool
    blocking_s: float = 0.0
    write_s: float | None = None
    error: str | None = None


class _Writer(FileSystemWriter):
    """DCP's file writer with the drill hook: `fail` makes this rank write its files, then fail
    as a full disk would (what `Checkpointer.inject_write_error_at` asks for)."""

    def __init__(self, path: Path, fail: bool) -> None:
        super().__init__(str(path))
        self._fail = fail

    def write_data(self, plan, planner):
        written = super().write_data(plan, planner)
        if not self._fail:
            return written
        written.wait()
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected)", str(self.path))


def _dcp_save(
    state: dict,
    path: Path,
    group: dist.ProcessGroup | None,
    fail: bool,
    planner: SavePlanner | None = None,
) -> None:
    try:
        writer = _Writer(path, fail)
        dcp_quiet(dcp.save, state, storage_writer=writer, planner=planner, process_group=group)
    except (Exception, CheckpointException) as err:  # the latter is a BaseException
        raise CheckpointError(f"cannot save checkpoint {path}: {cause(err)}") from err


def _own_files(tmp: Path, rank: int) -> list[Path]:
    """What this rank wrote: its DCP shards (DCP names them by rank in the checkpoint's group, which
    spans all ranks) and RNG state; rank 0 is also DCP's coordinator, which writes `.metadata`."""
    files = [*tmp.glob(f"__{rank}_*.distcp"), tmp / rng_file_name(rank)]
    if rank == 0:
        files.append(tmp / DCP_METADATA)
    return files


def _gathered(mine: dict, group: dist.ProcessGroup | None) -> dict:
    """On rank 0, every rank's manifest entries merged (other ranks get theirs back)."""
    if not dist.is_initialized():
        return mine
    parts: list[Any] | None = [None] * dist.get_world_size(group) if global_rank() == 0 else None
    dist.gather_object(mine, parts, dst=0, group=group)
    return {k: v for part in parts for k, v in part.items()} if parts is not None else mine


def _storage_error(err: BaseException) -> bool:
    """Whether a save failed on storage (a full disk, a quota, a file-size limit: an OSError, or
    torch's zip writer falling short), as opposed to a bug, which should still stop the run."""
    while isinstance(err, CheckpointError) and err.__cause__ is not None:
        err = err.__cause__
    if isinstance(err, CheckpointException):
        return bool(err.failures) and all(
            is_storage_failure(exc) for exc, _ in err.failures.values()
        )
    return is_storage_failure(err)


def _root_cause(err: BaseException, where: Path) -> str:
    """'rank R: OSError: ...' from DCP's collective error or this rank's own; a storage failure
    also says how full the file system holding `where` is."""
    inner = err.__cause__ if isinstance(err, CheckpointError) and err.__cause__ else err
    rank, exc = failed_rank(inner)
    who = f"rank {global_rank() if rank is None else rank}"
    if is_storage_failure(exc):
        return f"{who}: {describe_storage_failure(exc, where)}"
    return f"{who}: {type(exc).__name__}: {exc}"


class _SaveFailed(Exception):
    """A save that failed on some rank, the same on every rank (see `CheckpointWriter._agree`)."""

    def __init__(self, message: str, storage: bool) -> None:
        super().__init__(message)
        self.storage = storage


class CheckpointWriter:
    """Writes saves into `root` and prunes old ones: the part of a checkpointer that the training
    side (`Checkpointer`) and the writer process (save_process.py) share. `group` is the process
    group its collectives run on (None: the default group)."""

    def __init__(self, root: Path, cfg: CheckpointConfig, model: ModelConfig | None) -> None:
        self.root = Path(root)
        self.cfg = cfg
        self.model = model
        self.group: dist.ProcessGroup | None = None
        self._verdicts: dict[Path, str | None] = {}
        self._roots: list[str] | None = None

    def write(
        self,
        record: SaveRecord,
        state: dict,
        rng: dict,
        trainer_state: dict,
        planner: SavePlanner | None = None,
        fail: bool = False,
        delay_s: float = 0.0,
    ) -> None:
        """Write the save of `record.step`, timed into `record`. A failure on storage is reported (`record.error`
        and a warning), anything else raised. `fail` and `delay_s` are drills (the Checkpointer's
        `inject_write_error_at`, `inject_write_delay`)."""
        start = time.perf_counter()
        try:
            self._write(record.step, state, rng, trainer_state, planner, fail, delay_s)
        except _SaveFailed as err:
            if not err.storage:
                raise CheckpointError(f"cannot save checkpoint: {err}")  # noqa: B904 (context kept)
            record.error = str(err)
            found = list_checkpoints(self.root)
            warn_from_rank0(
                f"checkpoint of step {record.step} was not saved ({err}); its partial files are "
                "removed, "
                + (f"the newest checkpoint is still {found[-1]}" if found else "no checkpoint yet")
                + "; training continues and the next save is attempted as usual"
            )
        finally:
            record.write_s = time.perf_counter() - start

    def _agree(self, err: BaseException | None, where: Path) -> None:
        """Every rank learns whether any rank failed the stage just done, and all raise the same
        _SaveFailed if one did: no rank then waits in a collective for a peer that gave up."""
        mine = None if err is None else (_root_cause(err, where), _storage_error(err))
        everyone = [mine]
        if dist.is_initialized():
            everyone = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(everyone, mine, group=self.group)
        failed = [f for f in everyone if f is not None]
        if failed:
            raise _SaveFailed(failed[0][0], storage=all(storage for _, storage in failed)) from err

    def _write(
        self,
        step: int,
        state: dict,
        rng: dict,
        trainer_state: dict,
        planner: SavePlanner | None,
        fail: bool,
        delay_s: float,
    ) -> None:
        final = step_dir(self.root, step)
        tmp = tmp_dir_of(final)
        rank = global_rank()
        node, leads = self._place()
        try:
            self._agree(_attempt(_fresh_dir, tmp)[1] if leads else None, self.root)
            mine, err = _attempt(self._write_own, state, rng, tmp, planner, fail, delay_s, node)
            self._agree(err, self.root)
            files = _gathered(mine, self.group)
            published = None
            if rank == 0:
                published = _attempt(self._publish, step, trainer_state, files, tmp, final)[1]
            self._agree(published, self.root)
            if self.nodes > 1:
                self._commit_on_every_node(step, tmp, final, leads)
        except _SaveFailed:
            if leads:
                shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _place(self) -> tuple[int, bool]:
        """(This rank's node, whether it writes the files its node shares), from the roots of
        all ranks, gathered once: a root that differs between ranks is node-local memory (a
        snapshot: train/snapshot.py), one per node, in node order; the disk's root is shared."""
        if self._roots is None:
            self._roots = [str(self.root)]
            if dist.is_initialized():
                self._roots = [None] * dist.get_world_size(self.group)
                dist.all_gather_object(self._roots, str(self.root), group=self.group)
        rank = dist.get_rank(self.group) if dist.is_initialized() else 0
        node = list(dict.fromkeys(self._roots)).index(self._roots[rank])
        return node, rank in self._leaders

    @property
    def _leaders(self) -> list[int]:
        """The first rank of each root (of each node, for node-local memory), in node order."""
        return [r for r, root in enumerate(self._roots) if self._roots.index(root) == r]

    @property
    def nodes(self) -> int:
        """How many node-local roots this writer's group writes (1: a shared root)."""
        return len(set(self._roots)) if self._roots is not None else 1

    def _commit_on_every_node(self, step: int, tmp: Path, final: Path, leads: bool) -> None:
        """Node-local roots: rank 0 published the version on its node; each other node's first
        rank now writes the files every node holds (DCP's `.metadata`, the trainer state, the
        manifest) beside its node's parts and publishes them the same way. Then each node keeps
        the versions a restart may still need (`_prune_node`)."""
        shared: list[Any] = [None]
        if global_rank() == 0:
            shared[0] = {name: (final / name).read_bytes() for name in SHARED_FILES}
        first = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.broadcast_object_list(shared, src=first, group=self.group)
        err = None
        if leads and global_rank() != 0:
            err = _attempt(_publish_copy, shared[0], tmp, final)[1]
        self._agree(err, self.root)
        safe = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(safe, replicated_step(self.root) if leads else None, self.group)
        if leads:
            _prune_node(self.root, step, [safe[r] for r in self._leaders])

    def _write_own(
        self,
        state: dict,
        rng: dict,
        tmp: Path,
        planner: SavePlanner | None,
        fail: bool,
        delay_s: float,
        node: int,
    ) -> dict:
        """This rank's shards and RNG state; returns their manifest entries (with the node that
        holds them, where roots are node-local)."""
        _dcp_save(state, tmp, self.group, fail, planner)
        if delay_s:
            time.sleep(delay_s)
        torch_save_synced(rng, tmp / rng_file_name(global_rank()))
        entries = manifest_entries(_own_files(tmp, global_rank()))
        if self.nodes > 1:
            for name, entry in entries.items():
                if name not in SHARED_FILES:
                    entry["node"] = node
        return entries

    def _publish(self, step: int, trainer_state: dict, files: dict, tmp: Path, final: Path) -> None:
        write_synced(tmp / TRAINER_STATE, json.dumps(trainer_state, indent=1).encode())
        files |= manifest_entries([tmp / TRAINER_STATE])
        ranks = dist.get_world_size(self.group) if dist.is_initialized() else 1
        write_manifest(tmp, step, ranks, self.model, files, self.nodes)
        self._replace(tmp, final)
        if self.nodes == 1:
            self._prune(final)

    def _verdict(self, path: Path) -> str | None:
        """verify(), once per path per run: the bytes of a checkpoint do not change under us."""
        if path not in self._verdicts:
            self._verdicts[path] = verify(path, self.model)
        return self._verdicts[path]

    def _replace(self, tmp: Path, final: Path) -> None:
        """Publish the new checkpoint; an old one of the same step is deleted after that, unless it
        was damaged: then it is kept aside for inspection."""
        problem = self._verdict(final) if final.exists() else None
        aside = publish_checkpoint(tmp, final)
        self._verdicts[final] = None  # its hashes were just taken from the files as written
        if aside is None:
            return
        if problem is None:
            shutil.rmtree(aside)
        else:
            warn_from_rank0(
                f"kept the damaged checkpoint that {final.name} replaces, as {aside}: {problem}"
            )

    def _prune(self, fresh: Path) -> None:
        """Keep the newest `keep` checkpoints that verify *now*; delete older verified ones.

        A verdict cached at save time is not trusted for this: bytes can change after they were
        written (a flipped bit, another process, a failing disk), and a checkpoint that no longer
        verifies must not stand in for the one about to be deleted. So before anything is deleted,
        the ones relied on instead are re-hashed; one that fails is named, kept for inspection and
        not counted. At least one checkpoint that verifies now always remains. The one this save
        just published (`fresh`) is not read again: its hashes were taken from its files as
        written, a moment ago (a second read doubled a snapshot's cost). The cost, reading
        `keep` checkpoints once per save that deletes one, is paid on rank 0 inside the save
        (the background writer for async saves). Damaged ones (another model's included) are
        neither counted nor deleted; each is named in a warning once."""
        if self.cfg.keep <= 0:
            return
        newest_first = list(reversed(list_checkpoints(self.root)))
        candidates = [path for path in newest_first if self._first_verdict(path) is None]
        if len(candidates) <= self.cfg.keep:
            return  # nothing would be deleted: nothing to re-check
        relied: list[Path] = []
        for i, path in enumerate(candidates):
            if len(relied) == self.cfg.keep:
                for old in candidates[i:]:
                    shutil.rmtree(old, ignore_errors=True)
                    del self._verdicts[old]
                return
            problem = None if path == fresh else verify(path, self.model)
            if problem is None:
                relied.append(path)
            else:
                self._verdicts[path] = problem
                warn_from_rank0(
                    f"checkpoint {path} verified when it was saved but no longer does ({problem}); "
                    "it is left in place, not counted toward checkpoint.keep, and no older "
                    "checkpoint is deleted in its stead"
                )

    def _first_verdict(self, path: Path) -> str | None:
        """The cached verdict, naming a damaged checkpoint in a warning the first time it is seen."""
        first_look = path not in self._verdicts
        problem = self._verdict(path)
        if problem is not None and first_look:
            warn_from_rank0(
                f"leaving damaged checkpoint {path} in place, not counted toward "
                f"checkpoint.keep: {problem}"
            )
        return problem


def _publish_copy(shared: dict[str, bytes], tmp: Path, final: Path) -> None:
    """Another node's version: the shared files beside its parts, the manifest last."""
    for name in sorted(shared, key=lambda n: n == MANIFEST):
        write_synced(tmp / name, shared[name])
    aside = publish_checkpoint(tmp, final)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _prune_node(root: Path, step: int, replicated: list[int | None]) -> None:
    """A node's memory keeps its newest version and, until every node's keeper has copied a
    newer one to its buddy (`replicated`: each node's newest copied step or None,
    resilience/replica.py), the one copied everywhere: a node lost whole mid-copy then still
    leaves a version that every node's part survives of. At most two versions: a copy that
    lags further (a dead keeper) costs that guarantee, not unbounded memory."""
    versions = [_step_of(p.name) for p in list_checkpoints(root)]
    keep_from = min([step, *(-1 if s is None else s for s in replicated)])
    if len(versions) > 2:
        keep_from = max(keep_from, sorted(versions)[-2])
    for path in list_checkpoints(root):
        if _step_of(path.name) < keep_from:
            shutil.rmtree(path, ignore_errors=True)


def _fresh_dir(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted save of this step
    tmp.mkdir(parents=True)


def _attempt(fn, *args: Any) -> tuple[Any, BaseException | None]:
    """(fn(*args), None) or (None, its error): returned for `_agree`, not raised past a peer's
    collective."""
    try:
        return fn(*args), None
    except Exception as err:
        return None, err


def save_model(path: Path, model: Transformer, trainer_state: dict[str, Any]) -> None:
    """Write a model-only checkpoint (e.g. a converted Hugging Face model) in the same layout,
    manifest included, so that it verifies like a trained one."""
    final = Path(path)
    tmp = tmp_dir_of(final)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    trainer_state = {**trainer_state, "model_only": True}
    _dcp_save({"model": model.state_dict()}, tmp, None, fail=False)
    write_synced(tmp / TRAINER_STATE, json.dumps(trainer_state, indent=1).encode())
    files = manifest_entries([*tmp.glob("*.distcp"), tmp / DCP_METADATA, tmp / TRAINER_STATE])
    write_manifest(tmp, trainer_state.get("step", 0), 0, model.cfg, files)
    aside = publish_checkpoint(tmp, final)
    if aside is not None:
        shutil.rmtree(aside)
