"""Checkpoints: model and optimizer through torch.distributed.checkpoint (sharded, reshardable on
load), plus the trainer's own small state (step, data position, RNG). What makes a checkpoint
directory complete and trustworthy (its manifest, verification, choosing one) is in manifest.py;
reading one back (once per replica group, bytes counted) in restore.py.

Writing: everything goes into `step_XXXXXXXX.tmp/`. Each rank saves its DCP shards and RNG state,
fsyncs them and hashes what it wrote (SHA-256; one read per rank, in parallel, usually from the page
cache); rank 0 gathers the hashes, writes `trainer_state.json`, then the manifest last. Only then is
the directory renamed to `step_XXXXXXXX/` and its parent fsynced. A re-save of an existing step moves
the old directory aside and deletes it only once the new one is in place.

Two stages (MegaScale), the default when several processes train (`async_save='auto'`): the state
is copied into host memory — training waits only for this, `last_blocking_s` — and a background
thread writes it, with its collectives on a gloo group of its own.

A failing write (a full disk, a file-size limit: any OSError) does not stop training. After each
stage of a save every rank learns whether any rank failed (`_agree`), so no rank waits in a
collective for a peer that gave up, and only a save that succeeded everywhere is published. A
failed one is named once, on rank 0, its `.tmp` directory removed; the previous checkpoint is
untouched and the next save is attempted as usual. Only the last save of a run (`wait(final=True)`)
turns such a failure into an error: the run would otherwise end believing its end state was kept.

Reading: resuming takes the newest checkpoint that verifies ('auto'), or a named one that must
verify; a multi-rank run verifies on rank 0 alone and broadcasts the choice.

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
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import DeviceMesh

from depthscale.config import CheckpointConfig, ModelConfig
from depthscale.errors import CheckpointError
from depthscale.train.manifest import (
    DCP_METADATA,
    TRAINER_STATE,
    choose_on_rank0,
    global_rank,
    list_checkpoints,
    manifest_entries,
    newest_verified,
    publish_checkpoint,
    rng_file_name,
    step_dir,
    tmp_dir_of,
    torch_save_synced,
    verified,
    verify,
    warn_from_rank0,
    write_manifest,
    write_synced,
)
from depthscale.train.restore import (
    RestoreStats,
    cause,
    dcp_quiet,
    failed_rank,
    is_model_only,
    load_model,
    read_trainer_state,
    restore,
)
from depthscale.train.save_process import SaveProcess, can_start
from depthscale.train.storage import describe as describe_storage_failure
from depthscale.train.storage import is_storage_failure

if TYPE_CHECKING:
    from depthscale.model.transformer import Transformer

__all__ = ["Checkpointer", "SaveRecord", "is_model_only", "load_model", "read_trainer_state"]


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


_FLAT_OPTIMIZER = StateDictOptions(flatten_optimizer_state_dict=True)
"""Optimizer state saved with per-parameter keys, param-group settings included
("optim.param_groups.<fqn>.lr"): ranks holding different parameters (pipeline stages) then write
different keys. Nested, the param groups are keyed by group index, every rank writes the same keys
with its own parameter list, and one rank's list wins — resuming a pipeline mixed up the groups."""


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
    """A save that failed on some rank, the same on every rank (see `Checkpointer._agree`)."""

    def __init__(self, message: str, storage: bool) -> None:
        super().__init__(message)
        self.storage = storage


@dataclass
class SaveRecord:
    """One save, as logged: `blocking_s` is what training waited for (for an async save, the
    previous save's tail plus staging into host memory; for a sync one, the whole write)."""

    step: int
    is_async: bool
    blocking_s: float = 0.0
    write_s: float | None = None
    error: str | None = None


class Checkpointer:
    inject_write_delay: tuple[int, float] | None = None
    """Drills: (step, seconds): when saving this step, the writer waits this long after writing its
    shards, before the save is published (`--faults slowsave@STEP:SECONDS`, a slow file system)."""
    inject_write_error_at: int | None = None
    """Drills: when saving this step, this rank's writer fails with ENOSPC after writing its
    shards (`--faults enospc@STEP`)."""

    def __init__(self, root: Path, cfg: CheckpointConfig, model: ModelConfig | None = None) -> None:
        """`model` is recorded in each manifest and checked on resume; it is read at each use, so a
        vocab_size resolved after construction is the one recorded."""
        self.root = Path(root)
        self.cfg = cfg
        self.model = model
        self.last_blocking_s: float | None = None
        """Seconds training waited in the latest `save`."""
        self.last_restore: RestoreStats | None = None
        """What this rank read from storage in the latest `load`."""
        self._pending: threading.Thread | None = None
        self._writer: SaveProcess | None = None
        self._error: BaseException | None = None
        self._last: SaveRecord | None = None
        self._done: list[SaveRecord] = []
        self._group: dist.ProcessGroup | None = None
        self._verdicts: dict[Path, str | None] = {}

    def latest(self) -> Path | None:
        """The newest `step_N` directory (not verified: for messages, not for loading)."""
        found = list_checkpoints(self.root)
        return found[-1] if found else None

    def resolve_resume(self) -> Path | None:
        """The checkpoint to resume from per `checkpoint.resume`, or None to start fresh. Rank 0
        verifies (reading every file) and all ranks take its choice."""
        return choose_on_rank0(self._choose)

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

    @property
    def is_async(self) -> bool:
        """`async_save`: 'auto' writes in the background when several processes train."""
        if self.cfg.async_save == "auto":
            return dist.is_initialized() and dist.get_world_size() > 1
        return bool(self.cfg.async_save)

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer_state: dict[str, Any],
        last: bool = False,
    ) -> Path:
        """Save; with async_save, returns once the state is staged in host memory. A failure on
        storage is reported, not raised (see the module docstring). `last`: the run waits for
        this save next, so a writer process not yet started is not started for it."""
        start = time.perf_counter()
        self.wait()
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_FLAT_OPTIMIZER)
        state = {"model": model_sd, "optim": optim_sd}
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        record = self._last = SaveRecord(step, self.is_async and not (last and self._idle()))
        args = (record, step, state, rng, trainer_state)
        if record.is_async and self._writer_process() is not None:
            fail = self.inject_write_error_at == step
            delay = self._delay_at(step)
            self._writer.submit(step, state, rng, trainer_state, fail, global_rank(), delay)
            record.blocking_s = time.perf_counter() - start
        elif record.is_async:
            if dist.is_initialized() and self._group is None:
                # A background save must not interleave its collectives with training's on one group.
                self._group = dist.new_group(backend="gloo")
            args = (record, step, _stage(state), rng, trainer_state)
            self._pending = threading.Thread(target=self._write_recorded, args=args, daemon=True)
            record.blocking_s = time.perf_counter() - start
            self._pending.start()
        else:
            self._write_recorded(*args)
            record.blocking_s = time.perf_counter() - start
        self.last_blocking_s = record.blocking_s
        return step_dir(self.root, step)

    def _delay_at(self, step: int) -> float:
        drill = self.inject_write_delay
        return drill[1] if drill is not None and drill[0] == step else 0.0

    def _idle(self) -> bool:
        """No background writer running yet (a writer process is started by the first async save
        that is not the run's last)."""
        return self._writer is None and self._pending is None

    @property
    def saving_step(self) -> int | None:
        """The step of a background save still being written, else None. Read by the heartbeat
        thread: the supervisor treats a save in flight as a long phase and lets it finish before it
        stops a group (a save killed half-way is progress lost and, repeated, a restart loop)."""
        if self._writer is not None:
            return self._writer.writing_step
        pending, last = self._pending, self._last
        return last.step if pending is not None and pending.is_alive() and last else None

    @property
    def writer_pid(self) -> int | None:
        """The pid of this rank's checkpoint writer process, once started (for drills)."""
        return self._writer.pid if self._writer is not None else None

    def _writer_process(self) -> SaveProcess | None:
        """This rank's writer process, started at the first async save; None where saves are
        written by a thread (`async_writer='thread'`, or no writer process can start here)."""
        if self.cfg.async_writer != "process":
            return None
        if self._writer is None and can_start():
            self._writer = SaveProcess(self.root, self.cfg, self.model)
        return self._writer

    def _collect(self, outcome: tuple[SaveRecord, BaseException | None]) -> None:
        """A save the writer process finished: its record replaces the one staged."""
        record, err = outcome
        if self._last is not None and self._last.step == record.step:
            record.blocking_s = self._last.blocking_s
        self._last = record
        self._done.append(record)
        if err is not None:
            self._error = err

    def wait(self, final: bool = False) -> None:
        """Block until a background save has finished. A bug in it is raised here; a storage
        failure was reported and training goes on, unless `final` (the run's last save)."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        if self._writer is not None and self._writer.in_flight:
            self._collect(self._writer.result())
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointError(f"background checkpoint save failed: {err}") from err
        if final and self._last is not None and self._last.error is not None:
            latest = self.latest()
            raise CheckpointError(
                f"the last checkpoint of this run (step {self._last.step}) could not be saved "
                f"({self._last.error}); "
                + (f"the newest checkpoint is {latest}" if latest else "no checkpoint was kept")
                + ": free space and resume from it"
            )

    def events(self) -> list[tuple[str, dict[str, Any]]]:
        """Finished saves since the last call, as (kind, fields) for metrics.jsonl: 'checkpoint'
        (step, blocking_s, write_s, async) or 'checkpoint_failed' (with the error)."""
        if self._writer is not None and (outcome := self._writer.poll()) is not None:
            self._collect(outcome)
        done, self._done = self._done, []
        return [("checkpoint_failed" if r.error else "checkpoint", asdict(r)) for r in done]

    def _write_recorded(self, record: SaveRecord, *args: Any) -> None:
        """_write, timed and recorded; a storage failure is reported, anything else raised (in
        the background: kept for `wait` to raise)."""
        start = time.perf_counter()
        try:
            self._write(*args)
        except _SaveFailed as err:
            if not err.storage:
                self._fail(record, CheckpointError(f"cannot save checkpoint: {err}"))
                return
            record.error = str(err)
            latest = self.latest()
            warn_from_rank0(
                f"checkpoint of step {record.step} was not saved ({err}); its partial files are "
                "removed, "
                + (f"the newest checkpoint is still {latest}" if latest else "no checkpoint yet")
                + "; training continues and the next save is attempted as usual"
            )
        except BaseException as err:
            self._fail(record, err)
        finally:
            record.write_s = time.perf_counter() - start
            self._done.append(record)

    def _fail(self, record: SaveRecord, err: BaseException) -> None:
        if not record.is_async:
            raise err
        self._error = err  # raised by wait() on the training thread

    def _agree(self, err: BaseException | None, where: Path) -> None:
        """Every rank learns whether any rank failed the stage just done, and all raise the same
        _SaveFailed if one did: no rank then waits in a collective for a peer that gave up."""
        mine = None if err is None else (_root_cause(err, where), _storage_error(err))
        everyone = [mine]
        if dist.is_initialized():
            everyone = [None] * dist.get_world_size(self._group)
            dist.all_gather_object(everyone, mine, group=self._group)
        failed = [f for f in everyone if f is not None]
        if failed:
            raise _SaveFailed(failed[0][0], storage=all(storage for _, storage in failed)) from err

    def _write(
        self,
        step: int,
        state: dict,
        rng: dict,
        trainer_state: dict,
        planner: SavePlanner | None = None,
    ) -> None:
        final = step_dir(self.root, step)
        tmp = tmp_dir_of(final)
        rank = global_rank()
        try:
            self._agree(_attempt(_fresh_dir, tmp)[1] if rank == 0 else None, self.root)
            mine, err = _attempt(self._write_own, step, state, rng, tmp, planner)
            self._agree(err, self.root)
            files = _gathered(mine, self._group)
            published = None
            if rank == 0:
                published = _attempt(self._publish, step, trainer_state, files, tmp, final)[1]
            self._agree(published, self.root)
        except _SaveFailed:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _write_own(
        self, step: int, state: dict, rng: dict, tmp: Path, planner: SavePlanner | None
    ) -> dict:
        """This rank's shards and RNG state; returns their manifest entries."""
        _dcp_save(state, tmp, self._group, self.inject_write_error_at == step, planner)
        if delay_s := self._delay_at(step):
            time.sleep(delay_s)
        torch_save_synced(rng, tmp / rng_file_name(global_rank()))
        return manifest_entries(_own_files(tmp, global_rank()))

    def _publish(self, step: int, trainer_state: dict, files: dict, tmp: Path, final: Path) -> None:
        write_synced(tmp / TRAINER_STATE, json.dumps(trainer_state, indent=1).encode())
        files |= manifest_entries([tmp / TRAINER_STATE])
        ranks = dist.get_world_size(self._group) if dist.is_initialized() else 1
        write_manifest(tmp, step, ranks, self.model, files)
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

    def _prune(self) -> None:
        """Keep the newest `keep` checkpoints that verify *now*; delete older verified ones.

        A verdict cached at save time is not trusted for this: bytes can change after they were
        written (a flipped bit, another process, a failing disk), and a checkpoint that no longer
        verifies must not stand in for the one about to be deleted. So before anything is deleted,
        the ones relied on instead are re-hashed; one that fails is named, kept for inspection and
        not counted. At least one checkpoint that verifies now always remains. The cost, reading
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
            problem = verify(path, self.model)
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

    def load(
        self,
        path: Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        mesh: DeviceMesh | None = None,
    ) -> dict:
        """Load model (and optimizer) state in place; returns the trainer state. `path` should
        have been chosen through verification (resolve_resume). With replicas in `mesh`, one rank
        per replica group reads and broadcasts (restore.py); `last_restore` says what was read."""
        trainer_state, self.last_restore = restore(path, model, optimizer, mesh)
        return trainer_state


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
