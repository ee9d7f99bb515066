"""The hooks every run has, in the order they run."""

from __future__ import annotations

from depthscale.resilience.heartbeat import Heartbeat
from depthscale.train.hooks import Hook
from depthscale.train.hooks.checkpointing import Checkpointing
from depthscale.train.hooks.evaluation import Evaluation
from depthscale.train.hooks.heartbeat import HeartbeatHook
from depthscale.train.hooks.reporting import (
    FirstStep,
    Logging,
    Progress,
    TelemetryNotices,
    Throughput,
)
from depthscale.train.hooks.snapshots import Snapshotting
from depthscale.train.snapshot import Snapshots


def default_hooks(heartbeat: Heartbeat | None, snapshots: Snapshots | None) -> list[Hook]:
    """Throughput before the heartbeat (which reports tokens/s) and before the notices (the MFU
    alarm reads the step's MFU); the heartbeat before the notices, as its slow ranks are those
    flagged up to the previous step; evaluation before the periodic checkpoint; the progress bar
    last."""
    hooks: list[Hook] = [FirstStep(), Throughput()]
    if heartbeat is not None:
        hooks.append(HeartbeatHook(heartbeat))
    hooks += [TelemetryNotices(), Logging(), Evaluation(), Checkpointing()]
    if snapshots is not None:
        hooks.append(Snapshotting(snapshots))
    return hooks + [Progress()]
