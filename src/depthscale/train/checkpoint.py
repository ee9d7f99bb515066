"""Checkpoints: model and optimizer through torch.distributed.checkpoint (sharded, reshardable on
load), plus the trainer's own small state (step, data position, RNG). This is the training side,
the `Checkpointer`: when and how a save is handed off, what training waits for, which checkpoint a
run resumes from. Writing one (files, hashes, manifest, publishing, retention) is in
checkpoint_write.py; what makes a checkpoint directory complete and trustworthy (its manifest,
verification, choosing one) in manifest.py; reading one back (once per replica group, bytes
counted) in restore.py.

Two stages (MegaScale), the default when several processes train (`async_save='auto'`): the state
is copied into host memory — training waits only for this, `last_blocking_s` — and written in the
background: by a writer process of this rank's (save_process.py, `async_writer='process'`) or a
thread, with its collectives on a gloo group of its own.

A failing write (a full disk, a file-size limit) does not stop training: it is reported and the
next save is attempted as usual (checkpoint_write.py). Only the last save of a run
(`wait(final=True)`) turns such a failure into an error: the run would otherwise end believing its
end state was kept.

Reading: resuming takes the newest checkpoint that verifies ('auto'), or a named one that must
verify; a multi-rank run verifies on rank 0 alone and broadcasts the choice.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import DeviceMesh

from depthscale.config import CheckpointConfig, ModelConfig
from depthscale.errors import CheckpointError
from depthscale.parallel import startup
from depthscale.train.checkpoint_write import CheckpointWriter, SaveRecord, save_model
from depthscale.train.manifest import (
    choose_on_rank0,
    global_rank,
    list_checkpoints,
    newest_verified,
    step_dir,
    verified,
)
from depthscale.train.restore import (
    Resolve,
    RestoreStats,
    is_model_only,
    load_model,
    read_trainer_state,
    restore,
)
from depthscale.train.save_process import SaveProcess, can_start

__all__ = [
    "Checkpointer",
    "SaveRecord",
    "is_model_only",
    "load_model",
    "read_trainer_state",
    "save_model",
]

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
        self._save_process: SaveProcess | None = None
        self._error: BaseException | None = None
        self._last: SaveRecord | None = None
        self._done: list[SaveRecord] = []
        self._writer = CheckpointWriter(self.root, cfg, model)

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
        args = (record, state, rng, trainer_state)
        if record.is_async and self._writer_process() is not None:
            fail = self.inject_write_error_at == step
            delay = self._delay_at(step)
            self._save_process.submit(step, state, rng, trainer_state, fail, global_rank(), delay)
            record.blocking_s = time.perf_counter() - start
        elif record.is_async:
            if dist.is_initialized() and self._writer.group is None:
                # A background save must not interleave its collectives with training's on one
                # group. It spans the world: DCP plans the save over every rank in one group (made
                # once, at the first background save, off the step's path; the writer process's
                # group, save_process.py, likewise).
                self._writer.group = dist.new_group(backend="gloo", timeout=startup.group_timeout)
            args = (record, _stage(state), rng, trainer_state)
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
        return self._save_process is None and self._pending is None

    @property
    def saving_step(self) -> int | None:
        """The step of a background save still being written, else None. Read by the heartbeat
        thread: the supervisor treats a save in flight as a long phase and lets it finish before it
        stops a group (a save killed half-way is progress lost and, repeated, a restart loop)."""
        if self._save_process is not None:
            return self._save_process.writing_step
        pending, last = self._pending, self._last
        return last.step if pending is not None and pending.is_alive() and last else None

    @property
    def writer_pid(self) -> int | None:
        """The pid of this rank's checkpoint writer process, once started (for drills)."""
        return self._save_process.pid if self._save_process is not None else None

    def _writer_process(self) -> SaveProcess | None:
        """This rank's writer process, started at the first async save; None where saves are
        written by a thread (`async_writer='thread'`, or no writer process can start here)."""
        if self.cfg.async_writer != "process":
            return None
        if self._save_process is None and can_start():
            self._save_process = SaveProcess(self.root, self.cfg, self.model)
        return self._save_process

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
        if self._save_process is not None and self._save_process.in_flight:
            self._collect(self._save_process.result())
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
        if self._save_process is not None and (outcome := self._save_process.poll()) is not None:
            self._collect(outcome)
        done, self._done = self._done, []
        return [("checkpoint_failed" if r.error else "checkpoint", asdict(r)) for r in done]

    def _write_recorded(
        self, record: SaveRecord, state: dict, rng: dict, trainer_state: dict
    ) -> None:
        """CheckpointWriter.write, recorded; a storage failure was reported there, anything else is
        raised (in the background: kept for `wait` to raise)."""
        fail, delay_s = self.inject_write_error_at == record.step, self._delay_at(record.step)
        try:
            self._writer.write(record, state, rng, trainer_state, fail=fail, delay_s=delay_s)
        except BaseException as err:
            self._fail(record, err)
        finally:
            self._done.append(record)

    def _fail(self, record: SaveRecord, err: BaseException) -> None:
        if not record.is_async:
            raise err
        self._error = err  # raised by wait() on the training thread

    def load(
        self,
        path: Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        mesh: DeviceMesh | None = None,
        resolve: Resolve | None = None,
    ) -> dict:
        """Load model (and optimizer) state in place; returns the trainer state. `path` should
        have been chosen through verification (resolve_resume). With replicas in `mesh`, one rank
        per replica group reads and broadcasts (restore.py); `last_restore` says what was read.
        `resolve`: where each file is, for a version spread over nodes' memory."""
        trainer_state, self.last_restore = restore(path, model, optimizer, mesh, resolve=resolve)
        return trainer_state
