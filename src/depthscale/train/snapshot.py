"""Snapshots in host memory that outlive the worker, and the tiered restore that prefers them.

API (for the goodput planner and benchmarks/recovery.py):

    snaps = Snapshots(cfg, checkpointer)     # enabled when a keeper serves this node (supervised)
    snaps.enabled, snaps.every, snaps.root   # root: /dev/shm/depthscale-<uid>-<run hash>/
    path, tier = snaps.resolve_resume()      # tier: "memory" | "disk" | None; every rank agrees
    snaps.after_step(trainer, logger.event)  # saves every snapshot_every steps, logs them
    snaps.last_blocking_s                    # seconds training waited for the latest snapshot
    snaps.report(heartbeat, path, stats)     # the tier and bytes read go to the supervisor
    snapshot_dir(run_path)                   # where a run's snapshots live (keeper.py owns it)

Each `metrics.jsonl` record of kind "snapshot" has step, blocking_s (training's wait) and
write_s (the background write); "snapshot_failed" one that could not be written.

How. A snapshot *is* a DCP checkpoint, written by the same machinery as one on disk
(`Checkpointer` → `SaveProcess` → `CheckpointWriter`) into a directory on /dev/shm, a tmpfs: its
files are shared-memory segments, named by run (the directory), version (`step_N/`) and rank
(`__R_0.distcp`, `rng_rank_R.pt`). So everything the disk path guarantees holds here too:

- asynchronous: training copies its state into the writer process's shared staging buffer
  (save_process.py) and goes on; planning, writing and hashing happen in that process, niced, with
  the collectives of its own gloo group (never the job's);
- committed last: every rank hashes what it wrote (SHA-256), rank 0 gathers the hashes and writes
  the manifest last, then the version's directory is renamed into place. A rank killed during a
  snapshot leaves `step_N.tmp/` (the keeper sweeps it) and the previous version intact; only once
  a version is in place is the older one deleted (keep=1);
- reshardable: DCP's planner reads it at any layout, exactly as it reads one on disk
  (`restore.restore`, with its one-read-per-replica-group and counted bytes).

The memory belongs to the node's keeper (resilience/keeper.py), which the supervisor starts: the
files stay when a worker dies, and the keeper removes them when the job ends well.

Restore (`resolve_resume`): rank 0 tries the tiers in order and every rank takes its choice
(`choose_on_rank0`, one broadcast): this node's memory, newest version first, as long as it is
not older than the newest checkpoint on disk; then the newest verified checkpoint on disk. Each
candidate is verified (manifest, sizes, hashes) before use; one that fails is named in one line
and the next is tried — never the same broken one again, so no restart loop. Not built: a buddy
replica on another node (the tier between the two), and a memory tier across real nodes: the
manifest and its files must all be on rank 0's node (true on one host, where the multi-node
drills run); elsewhere the memory tier fails verification, named, and disk is used.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from depthscale.resilience.keeper import SNAPSHOT_DIR_ENV, snapshot_dir
from depthscale.train import console
from depthscale.train.checkpoint import Checkpointer
from depthscale.train.manifest import _step_of, choose_on_rank0, list_checkpoints, verify
from depthscale.train.restore import RestoreStats

if TYPE_CHECKING:
    from depthscale.config import Config, ModelConfig
    from depthscale.resilience.heartbeat import Heartbeat


class Snapshots:
    """The training side: when to snapshot, and which tier a (re)start restores from."""

    def __init__(self, cfg: Config, checkpointer: Checkpointer) -> None:
        self.cfg = cfg
        self.disk = checkpointer
        root = os.environ.get(SNAPSHOT_DIR_ENV)
        self.root = Path(root) if root else None
        self.every = cfg.checkpoint.snapshot_every if self.root is not None else 0
        self.memory: Checkpointer | None = None
        if self.every:
            # async into the writer process always; keep=1: the older version goes only once the
            # newer one is in place
            own = replace(cfg.checkpoint, keep=1, async_save=True, async_writer="process")
            self.memory = Checkpointer(self.root, own, cfg.model)
        self.failed: list[str] = []
        """The versions that failed verification at this start, one line each."""

    @property
    def enabled(self) -> bool:
        return self.memory is not None

    @property
    def last_blocking_s(self) -> float | None:
        return self.memory.last_blocking_s if self.memory is not None else None

    # ------------------------------------------------------------------ restore

    def resolve_resume(self) -> Path | None:
        """The checkpoint to resume from, memory first (see the module docstring)."""
        if self.root is None or self.cfg.checkpoint.resume != "auto":
            return self.disk.resolve_resume()  # a named checkpoint, or none: never memory
        path, self.failed = choose_on_rank0(self._choose)
        return path if path is not None else self.disk.resolve_resume()

    def _choose(self) -> tuple[Path | None, list[str]]:
        """On rank 0: the newest snapshot that verifies and is not older than the newest
        checkpoint on disk, or None; and the lines naming the ones that failed."""
        on_disk = list_checkpoints(self.disk.root)
        floor = _step_of(on_disk[-1].name) if on_disk else -1
        path, failed = newest_verified_version(self.root, "memory", self.cfg.model, floor)
        if path is not None:
            return path, failed
        if failed:
            nxt = f"checkpoint {on_disk[-1].name} on disk" if on_disk else "the start"
            console.say(f"depthscale: {failed[0]}; restoring from the next tier ({nxt})")
        return None, failed

    def tier(self, path: Path | None) -> str | None:
        if path is None:
            return None
        return "memory" if self.root is not None and path.parent == self.root else "disk"

    def report(
        self, heartbeat: Heartbeat | None, path: Path | None, stats: RestoreStats | None
    ) -> dict[str, Any] | None:
        """What this rank restored from, for the supervisor's restart breakdown (heartbeat field
        `restore`): tier, step, bytes read, and the tiers that failed verification."""
        if path is None:
            return None
        record = {
            "tier": self.tier(path),
            "step": _step_of(path.name),
            "bytes": (stats.shard_bytes + stats.other_bytes) if stats is not None else 0,
            "from_storage": stats.from_storage if stats is not None else True,
            "seconds": round(stats.seconds, 3) if stats is not None else None,
            "failed": self.failed,
        }
        if heartbeat is not None:
            heartbeat.update(restore=record)
        return record

    # ------------------------------------------------------------------ saving

    def after_step(self, trainer: Any, event: Callable[[int, str, dict], None]) -> None:
        """Snapshot every `every` steps (not the last: a checkpoint follows); log each finished
        one through `event(step, kind, fields)` (the metrics logger's)."""
        if self.memory is None:
            return
        for kind, fields in self.memory.events():
            event(trainer.step, kind.replace("checkpoint", "snapshot"), fields)
        step = trainer.step
        if step % self.every or step >= self.cfg.train.steps:
            return
        faults = trainer.faults  # drills: slowsave@S and corrupt@S reach a snapshot of step S too
        self.memory.inject_write_delay = faults.slow_save()
        path = self.memory.save(step, trainer.model, trainer.optimizer, trainer.trainer_state())
        faults.corrupt_after_save(step, path, self.memory.wait, trainer.env.is_main)


def newest_verified_version(
    root: Path, tier: str, model: ModelConfig | None, floor: int = -1
) -> tuple[Path | None, list[str]]:
    """The newest version under `root` that verifies, no older than step `floor`, or None; and
    one line for each newer one that failed (what a restart tries, in its order)."""
    failed = []
    for path in reversed(list_checkpoints(root)):
        if _step_of(path.name) < floor:
            break
        problem = verify(path, model)
        if problem is None:
            return path, failed
        what = "snapshot" if tier == "memory" else "checkpoint"
        where = "in memory" if tier == "memory" else f"on {tier}"
        failed.append(f"{what} {path.name} {where} ({path}) failed verification: {problem}")
    return None, failed


def recovery_tiers(
    run: Path, model: ModelConfig | None, memory_root: Path | None = None
) -> list[dict[str, Any]]:
    """What each tier of `run` would give a restart now, in the order it tries them: this
    node's memory (its keeper's directory), then the checkpoints on disk. Per tier: its
    directory, its versions, the newest that verifies and the lines naming newer ones that do
    not (`depthscale diagnose --run` prints them, so a damaged tier is named before a fault
    needs it)."""
    rows = []
    memory_root = memory_root if memory_root is not None else snapshot_dir(run)
    for tier, root in (("memory", memory_root), ("disk", Path(run) / "checkpoints")):
        good, failed = newest_verified_version(root, tier, model)
        rows.append(
            {
                "tier": tier,
                "root": str(root),
                "versions": [p.name for p in list_checkpoints(root)],
                "verified": good.name if good is not None else None,
                "failed": failed,
            }
        )
    return rows
