"""Checkpoints: model and optimizer through torch.distributed.checkpoint (sharded, reshardable on
load), plus the trainer's own small state (step, data position, RNG). What makes a checkpoint
directory complete and trustworthy (its manifest, verification, choosing one) is in manifest.py.

Writing: everything goes into `step_XXXXXXXX.tmp/`. Each rank saves its DCP shards and RNG state,
fsyncs them and hashes what it wrote (SHA-256; one read per rank, in parallel, usually from the page
cache); rank 0 gathers the hashes, writes `trainer_state.json`, then the manifest last. Only then is
the directory renamed to `step_XXXXXXXX/` and its parent fsynced. A re-save of an existing step moves
the old directory aside and deletes it only once the new one is in place.

Reading: resuming takes the newest checkpoint that verifies ('auto'), or a named one that must
verify; a multi-rank run verifies on rank 0 alone and broadcasts the choice.

Retention (`checkpoint.keep`) counts verified checkpoints only, runs after the new one is complete,
and never deletes a damaged one (it is named in a warning instead, for inspection).

With `async_save`, saving is MegaScale's two stages: the state is first copied into host memory
(training waits only for this), then a background thread writes it to disk.
"""

from __future__ import annotations

import json
import shutil
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

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

if TYPE_CHECKING:
    from depthscale.model.transformer import Transformer


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


_FLAT_OPTIMIZER = StateDictOptions(flatten_optimizer_state_dict=True)
"""Optimizer state saved with per-parameter keys, param-group settings included
("optim.param_groups.<fqn>.lr"): ranks holding different parameters (pipeline stages) then write
different keys. Nested, the param groups are keyed by group index, every rank writes the same keys
with its own parameter list, and one rank's list wins — resuming a pipeline mixed up the groups."""


def _optimizer_flat(path: Path) -> bool:
    """Whether the checkpoint's optimizer state is flattened (older checkpoints are nested)."""
    try:
        keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as err:
        raise CheckpointError(f"cannot read checkpoint metadata {path}: {_cause(err)}") from err
    return not any(k.startswith("optim.param_groups.0.") for k in keys)


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

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer_state: dict[str, Any],
    ) -> Path:
        """Save; with async_save, returns once the state is staged in host memory."""
        self.wait()
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_FLAT_OPTIMIZER)
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
        return step_dir(self.root, step)

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
        final = step_dir(self.root, step)
        tmp = tmp_dir_of(final)
        if global_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted save of this step
            tmp.mkdir(parents=True)
        if dist.is_initialized():
            dist.barrier(group=self._group)
        _dcp_save(state, tmp, self._group)
        torch_save_synced(rng, tmp / rng_file_name(global_rank()))
        files = _gathered(manifest_entries(_own_files(tmp, global_rank())), self._group)
        if global_rank() != 0:
            return
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
                warn_from_rank0(
                    f"leaving damaged checkpoint {path} in place, not counted toward "
                    f"checkpoint.keep: {problem}"
                )
        for old in kept[self.cfg.keep :]:
            shutil.rmtree(old, ignore_errors=True)
            del self._verdicts[old]

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
        """Load model (and optimizer) state in place; returns the trainer state. `path` should
        have been chosen through verification (resolve_resume).

        The optimizer's state (moments, step counts) comes from the checkpoint, its group settings
        (weight decay, betas, eps, LAMB's options) from `optimizer` as the config built it. Torch's
        flattened load would give each group the saved settings of its *first* parameter: after a
        config change that moves a parameter between groups (`optim.decay_embeddings`), the
        embedding's saved weight_decay 0 would end up on every matrix."""
        trainer_state = read_trainer_state(path)
        if optimizer is None or is_model_only(trainer_state):
            load_model(path, model)
            return trainer_state
        configured = [
            {k: v for k, v in g.items() if k not in ("params", "lr")}
            for g in optimizer.param_groups
        ]
        settings = [set(g) for g in optimizer.param_groups]
        options = StateDictOptions(flatten_optimizer_state_dict=_optimizer_flat(path))
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        state = {"model": model_sd, "optim": optim_sd}
        _dcp_load(state, path)
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
        rng_file = path / rng_file_name(global_rank())
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
    tmp = tmp_dir_of(final)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    trainer_state = {**trainer_state, "model_only": True}
    _dcp_save({"model": model.state_dict()}, tmp, None)
    write_synced(tmp / TRAINER_STATE, json.dumps(trainer_state, indent=1).encode())
    files = manifest_entries([*tmp.glob("*.distcp"), tmp / DCP_METADATA, tmp / TRAINER_STATE])
    write_manifest(tmp, trainer_state.get("step", 0), 0, model.cfg, files)
    aside = publish_checkpoint(tmp, final)
    if aside is not None:
        shutil.rmtree(aside)
