"""The supervisor's view of a worker (`resilience/heartbeat.py`): per-step numbers, the loss when
read, the newest checkpoint on disk, NaN-guard events, and the run finishing."""

from __future__ import annotations

from typing import Any

from depthscale.resilience.heartbeat import Heartbeat
from depthscale.train.hooks import Hook, Run


class HeartbeatHook(Hook):
    def __init__(self, heartbeat: Heartbeat) -> None:
        self.heartbeat = heartbeat
        self.nan_events: list[dict[str, Any]] = []

    def step_end(self, run: Run, metrics: dict[str, Any], seconds: float) -> None:
        t = run.trainer
        self.heartbeat.update(
            seconds,
            step=t.step,
            tokens_per_s=metrics["tokens_per_s"],
            slow_ranks=t.telemetry.slow_ranks(),
        )

    def metrics_read(self, run: Run, metrics: dict[str, Any]) -> None:
        self.heartbeat.update(loss=metrics["loss"])

    def after_step(self, run: Run) -> None:
        # progress for the supervisor once on disk, not once staged in memory
        for kind, fields in run.events:
            if kind == "checkpoint":
                self.heartbeat.update(checkpoint_step=fields["step"])

    def fit_end(self, run: Run) -> None:
        self.heartbeat.update(state="finishing")

    def nan_event(self, event: dict[str, Any]) -> None:
        self.nan_events.append(event)
        self.heartbeat.update(nan_events=list(self.nan_events))
