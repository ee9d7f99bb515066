"""The metrics log: `RUN/metrics.jsonl` (one JSON object a line), TensorBoard under `RUN/tb`, and
Weights & Biases when asked for (`observe/wandb_sink.py`).

A run that resumes from a checkpoint, or rolls back to one after a non-finite step, trains the
steps after it again. Their first records describe a timeline that no longer exists, and kept
beside the new ones they made `metrics.jsonl` hold a step twice (111 of 211 records after a few
restarts) and TensorBoard draw the curve jumping backwards. So the log is *superseded* from the
step the run goes on from: records of later steps move to `metrics.superseded.jsonl` (kept, not
deleted: they are what happened before the fault), and TensorBoard is told to purge its later
events (SummaryWriter's `purge_step`, written as a session restart into the event file).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import torch

from depthscale.config import Config

METRICS = "metrics.jsonl"
SUPERSEDED = "metrics.superseded.jsonl"


def _step_of(line: str) -> int | None:
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return None  # a line torn by a crash
    return step if isinstance(step, int) else None


def supersede(run_dir: Path, step: int) -> int:
    """Move the records of steps after `step` (and torn lines) from metrics.jsonl to
    metrics.superseded.jsonl; returns how many moved. The rewrite is atomic (rename), so a crash
    leaves either log whole."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        return 0
    keep, moved = [], []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        s = _step_of(line)
        (keep if s is not None and s <= step else moved).append(line)
    if not moved:
        return 0
    with (Path(run_dir) / SUPERSEDED).open("a", encoding="utf-8") as fh:
        fh.writelines(line if line.endswith("\n") else line + "\n" for line in moved)
    part = path.with_name(METRICS + ".part")
    part.write_text("".join(keep), encoding="utf-8")
    os.replace(part, path)
    return len(moved)


class MetricsLogger:
    """Appends one JSON object per `log` call to run_dir/metrics.jsonl, and mirrors the scalars to
    TensorBoard under run_dir/tb when enabled. Meant for one process (rank 0).

    Each line is {"step", "split", "time", **metrics} and is flushed at once, so a crash loses at
    most the line being written; non-finite values and None are written as null (strict JSON).
    TensorBoard tags are "{split}/{name}". `start_step`: the step the run goes on from (its
    checkpoint's); the records of later steps are superseded (see the module docstring).
    """

    RESERVED = ("step", "split", "time")

    def __init__(
        self,
        run_dir: Path,
        tensorboard: bool,
        start_step: int | None = None,
        wandb: Config | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.tensorboard = tensorboard
        self._file: IO[str] | None = None
        self._writer: Any = None
        self._open(start_step)
        self._wandb = None
        if wandb is not None:  # the config to send; the package is imported only here
            from depthscale.observe.wandb_sink import WandbSink

            self._wandb = WandbSink(self.run_dir, wandb)

    def _open(self, start_step: int | None) -> None:
        if start_step is not None:
            supersede(self.run_dir, start_step)
        self._file = (self.run_dir / METRICS).open("a", encoding="utf-8")
        if self.tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # imported lazily: slow, optional

            purge = None if start_step is None else start_step + 1
            self._writer = SummaryWriter(log_dir=str(self.run_dir / "tb"), purge_step=purge)

    def supersede(self, step: int) -> None:
        """The run went back to `step` (a rollback): later records are superseded."""
        self._close_files()
        self._open(step)

    def log(self, step: int, metrics: dict[str, float], prefix: str = "train") -> None:
        """Write one record of `metrics` at `step` under `prefix` (e.g. train, val)."""
        if self._file is None:
            raise RuntimeError("MetricsLogger.log called after close()")
        clash = [k for k in metrics if k in self.RESERVED]
        if clash:
            raise ValueError(f"metric names {clash} are reserved in metrics.jsonl")
        values = {k: _scalar(v) for k, v in metrics.items()}
        record = {"step": step, "split": prefix, "time": time.time()}
        record |= {k: v if v is None or math.isfinite(v) else None for k, v in values.items()}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        if self._writer is not None:
            for key, value in values.items():
                if value is not None:
                    self._writer.add_scalar(f"{prefix}/{key}", value, step)
            self._writer.flush()
        if self._wandb is not None:
            self._wandb.log(step, values, prefix)

    def event(self, step: int, kind: str, fields: dict[str, Any]) -> None:
        """One structured event (a straggler, an alarm) as its own metrics.jsonl line, with
        `split` = kind; not sent to TensorBoard."""
        if self._file is None:
            raise RuntimeError("MetricsLogger.event called after close()")
        record = {"step": step, "split": kind, "time": time.time(), **fields}
        self._file.write(json.dumps(record, default=str) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._close_files()
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None

    def _close_files(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _scalar(value: Any) -> float | int | None:
    """A Python number from a float, int, bool or one-element tensor; None stays None."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, bool | int):
        return int(value)
    return float(value)
