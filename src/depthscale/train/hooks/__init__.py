"""Hooks: every feature of the step loop at named points, so the loop itself knows none of them.

OLMo-core's callbacks are the model. `Trainer._fit` runs the step and calls, in list order, each
hook's

- `step_end(run, metrics, seconds)`: every step, once its metrics are queued (device numbers not
  read: the hot path never waits on the host);
- `metrics_read(run, metrics)`: the steps whose device numbers were read (log steps, a stop);
- `log(run, metrics)`: log steps; a hook may add keys before `Logging` writes them;
- `after_step(run)`: evaluation, checkpoints, the progress bar;
- `fit_end(run)`: the loop is done, before the final checkpoint;
- `nan_event(event)`: the NaN guard replayed or rolled back a step (also outside `fit`).

A feature is one `Hook` subclass in its own module here, added to the list in
`default_hooks` (the order is the order it runs in).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from depthscale.train import console


@dataclass
class Run:
    """One `fit` invocation as hooks see it: the trainer, the metrics logger, the progress bar."""

    trainer: Any
    logger: Any
    bar: Any
    history: list[dict[str, Any]] = field(default_factory=list)
    events: list[tuple[str, dict]] = field(default_factory=list)
    """(kind, fields) logged this step (stragglers, MFU alarms, checkpoints written)."""
    saved_at: int | None = None
    """The step last saved by a periodic checkpoint of this invocation."""

    def say(self, text: str) -> None:
        console.write(self.bar, f"depthscale: {text}")

    def event(self, step: int, kind: str, fields: dict) -> None:
        self.logger.event(step, kind, fields)
        self.events.append((kind, fields))


class Hook:
    """A feature at the loop's named points; every point is a no-op unless overridden."""

    def step_end(self, run: Run, metrics: dict[str, Any], seconds: float) -> None:
        pass

    def metrics_read(self, run: Run, metrics: dict[str, Any]) -> None:
        pass

    def log(self, run: Run, metrics: dict[str, Any]) -> None:
        pass

    def after_step(self, run: Run) -> None:
        pass

    def fit_end(self, run: Run) -> None:
        pass

    def nan_event(self, event: dict[str, Any]) -> None:
        pass


class Hooks:
    """An ordered list of hooks, called point by point."""

    def __init__(self, hooks: list[Hook]) -> None:
        self.hooks = list(hooks)

    def step_end(self, run: Run, metrics: dict[str, Any], seconds: float) -> None:
        run.events.clear()
        for hook in self.hooks:
            hook.step_end(run, metrics, seconds)

    def metrics_read(self, run: Run, metrics: dict[str, Any]) -> None:
        for hook in self.hooks:
            hook.metrics_read(run, metrics)

    def log(self, run: Run, metrics: dict[str, Any]) -> None:
        for hook in self.hooks:
            hook.log(run, metrics)

    def after_step(self, run: Run) -> None:
        for hook in self.hooks:
            hook.after_step(run)

    def fit_end(self, run: Run) -> None:
        for hook in self.hooks:
            hook.fit_end(run)

    def nan_event(self, event: dict[str, Any]) -> None:
        for hook in self.hooks:
            hook.nan_event(event)


__all__ = ["Hook", "Hooks", "Run"]
