"""Snapshots in memory every `checkpoint.snapshot_every` steps, kept by the node's keeper
(`train/snapshot.py`), after the step's periodic checkpoint point."""

from __future__ import annotations

from depthscale.train.hooks import Hook, Run
from depthscale.train.snapshot import Snapshots


class Snapshotting(Hook):
    def __init__(self, snapshots: Snapshots) -> None:
        self.snapshots = snapshots

    def after_step(self, run: Run) -> None:
        self.snapshots.after_step(run.trainer, run.event)
