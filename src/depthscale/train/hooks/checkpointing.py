"""Periodic checkpoints (`checkpoint.every`; the last step's is the loop's own) and the
checkpointer's events: blocking time of each save, saves that failed in the background."""

from __future__ import annotations

from typing import Any

from depthscale.train.hooks import Hook, Run


class Checkpointing(Hook):
    def step_end(self, run: Run, metrics: dict[str, Any], seconds: float) -> None:
        t = run.trainer
        for kind, fields in t.checkpointer.events():
            run.event(t.step, kind, fields)

    def after_step(self, run: Run) -> None:
        t = run.trainer
        every = t.cfg.checkpoint.every
        if every and t.step % every == 0 and t.step != t.cfg.train.steps:
            t.save_checkpoint()
            run.saved_at = t.step
