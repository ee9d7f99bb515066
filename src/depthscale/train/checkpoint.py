"""Checkpoints: model and optimizer through torch.distributed.checkpoint (sharded, reshardable on
load), plus the trainer's own small state (step, data position, RNG).

A checkpoint is written into `step_XXXXXXXX.tmp/` and renamed to `step_XXXXXXXX/` only when complete,
so a crash mid-save never leaves something that looks loadable, and nothing older is touched until a
newer checkpoint exists. With `async_save`, saving is MegaScale's two stages: the state is first copied
into host memory (training waits only for this), then a background thread writes it to disk.
"""

from __future__ import annotations

import json
import shutil
import threading
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from depthscale.config import CheckpointConfig
from depthscale.errors import CheckpointError

TRAINER_STATE = "trainer_state.json"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under root, oldest first."""
    if not root.is_dir():
        return []
    done = [
        p
        for p in root.glob("step_*")
        if p.is_dir() and not p.name.endswith(".tmp") and (p / TRAINER_STATE).is_file()
    ]
    return sorted(done, key=lambda p: int(p.name.split("_")[1]))


def _stage(obj: Any) -> Any:
    """Copy every tensor in a nested state dict into host memory, detached from the live state."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _stage(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_stage(v) for v in obj)
    return obj


def _dcp_quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        # DCP warns that it runs without a process group on a single process; that is intended.
        warnings.filterwarnings("ignore", message=".*single process.*")
        warnings.filterwarnings("ignore", category=FutureWarning)
        return fn(*args, **kwargs)


class Checkpointer:
    def __init__(self, root: Path, cfg: CheckpointConfig) -> None:
        self.root = Path(root)
        self.cfg = cfg
        self._pending: threading.Thread | None = None
        self._error: BaseException | None = None
        self._group: dist.ProcessGroup | None = None

    def latest(self) -> Path | None:
        found = list_checkpoints(self.root)
        return found[-1] if found else None

    def resolve_resume(self) -> Path | None:
        """The checkpoint to resume from per `checkpoint.resume`, or None to start fresh."""
        if self.cfg.resume == "none":
            if self.latest() is not None:
                raise CheckpointError(
                    f"{self.root} already holds checkpoints and checkpoint.resume='none' would train "
                    "over them; use --checkpoint.resume auto to continue, or a new --train.name"
                )
            return None
        if self.cfg.resume == "auto":
            return self.latest()
        path = Path(self.cfg.resume)
        if not (path / TRAINER_STATE).is_file():
            raise CheckpointError(
                f"checkpoint.resume={str(path)!r} is not a complete checkpoint "
                f"(no {TRAINER_STATE}); allowed: 'auto', 'none' or a step_* directory"
            )
        return path

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
        final = _step_dir(self.root, step)
        if self.cfg.async_save and dist.is_initialized() and self._group is None:
            # A background save must not interleave its collectives with training's on one group.
            self._group = dist.new_group(backend="gloo")
        if self.cfg.async_save:
            staged = _stage(state)
            self._pending = threading.Thread(
                target=self._write_guarded, args=(staged, rng, trainer_state, final), daemon=True
            )
            self._pending.start()
        else:
            self._write(state, rng, trainer_state, final)
        return final

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

    def _write(self, state: dict, rng: dict, trainer_state: dict, final: Path) -> None:
        tmp = final.with_name(final.name + ".tmp")
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        if dist.is_initialized():
            dist.barrier(group=self._group)
        _dcp_quiet(dcp.save, state, checkpoint_id=str(tmp), process_group=self._group)
        torch.save(rng, tmp / f"rng_rank{_rank()}.pt")
        if dist.is_initialized():
            dist.barrier(group=self._group)
        if _rank() == 0:
            (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=1))
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            self._prune()

    def _prune(self) -> None:
        if self.cfg.keep <= 0:
            return
        for old in list_checkpoints(self.root)[: -self.cfg.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
        """Load model (and optimizer) state in place; returns the trainer state."""
        trainer_state = read_trainer_state(path)
        if optimizer is None:
            load_model(path, model)
            return trainer_state
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        _dcp_load(state, path)
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        rng_file = path / f"rng_rank{_rank()}.pt"
        if rng_file.is_file():
            rng = torch.load(rng_file, weights_only=True)
            torch.set_rng_state(rng["torch"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
        return trainer_state


def read_trainer_state(path: Path) -> dict:
    file = Path(path) / TRAINER_STATE
    if not file.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint: {TRAINER_STATE} is missing")
    return json.loads(file.read_text())


def _dcp_load(state: dict, path: Path) -> None:
    try:
        _dcp_quiet(dcp.load, state, checkpoint_id=str(path))
    except Exception as err:  # DCP's errors on mismatched keys/shapes are long; lead with the cause
        raise CheckpointError(f"cannot load checkpoint {path} into this model: {err}") from err


def load_model(path: Path, model: nn.Module) -> None:
    """Load only the model weights of a checkpoint (generation, conversion, evaluation)."""
    state = {"model": model.state_dict()}
    _dcp_load(state, path)
    model.load_state_dict(state["model"])


def save_model(path: Path, model: nn.Module, trainer_state: dict[str, Any]) -> None:
    """Write a model-only checkpoint (e.g. a converted Hugging Face model) in the same layout."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _dcp_quiet(dcp.save, {"model": model.state_dict()}, checkpoint_id=str(path))
    (path / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=1))
