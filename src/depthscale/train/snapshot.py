"""Snapshots in host memory that outlive the worker, and the tiered restore that prefers them.

API (for the goodput planner and benchmarks/recovery.py):

    snaps = Snapshots(cfg, checkpointer)     # enabled when a keeper serves this node (supervised)
    snaps.enabled, snaps.every, snaps.root   # root: /dev/shm/depthscale-<uid>-<run hash>-node<k>/
    path = snaps.resolve_resume()            # every rank agrees; snaps.tier(path): its tier
    snaps.resolver(path)                     # where each file is (a version spread over nodes)
    snaps.after_step(trainer, logger.event)  # saves every snapshot_every steps, logs them
    snaps.last_blocking_s                    # seconds training waited for the latest snapshot
    snaps.report(heartbeat, path, stats)     # the tier and bytes read go to the supervisor
    snapshot_dir(run_path, node)             # where a node's snapshots live (keeper.py owns it)

Each `metrics.jsonl` record of kind "snapshot" has step, blocking_s (training's wait) and
write_s (the background write); "snapshot_failed" one that could not be written.

How. A snapshot *is* a DCP checkpoint, written by the same machinery as one on disk
(`Checkpointer` → `SaveProcess` → `CheckpointWriter`) into a directory on /dev/shm, a tmpfs: its
files are shared-memory segments, named by run and node (the directory), version (`step_N/`) and
rank (`__R_0.distcp`, `rng_rank_R.pt`). So everything the disk path guarantees holds here too:

- asynchronous: training copies its state into the writer process's shared staging buffer
  (save_process.py) and goes on; planning, writing and hashing happen in that process, niced, with
  the collectives of its own gloo group (never the job's). Training waits for a snapshot at the
  end of the step after it (`after_step`), so a fault loses at most `snapshot_every` steps;
- committed last: every rank hashes what it wrote (SHA-256), rank 0 gathers the hashes and writes
  the manifest last; each node then holds its ranks' files and a copy of the shared ones (DCP's
  `.metadata`, the trainer state, the manifest, which names the node of every file) and renames
  its version into place (checkpoint_write). A rank killed during a snapshot leaves
  `step_N.tmp/` (the keeper sweeps it) and the previous version intact;
- replicated: each node's keeper copies every committed version to the next node's keeper (the
  buddy, resilience/replica.py); a node keeps an older version until every node's copy of a
  newer one is in, so a node lost whole mid-copy still leaves one version every part survives of;
- reshardable: DCP's planner reads it at any layout, exactly as it reads one on disk
  (`restore.restore`, with its one-read-per-replica-group and counted bytes).

The memory belongs to the node's keeper (resilience/keeper.py), which the supervisor starts: the
files stay when a worker dies, and the keeper removes them when the job ends well.

Restore (`resolve_resume`): each node's first rank verifies what its memory holds (manifest,
sizes, hashes: its own versions, and the copies it holds of its predecessor's), every rank gathers
those reports and makes the same choice (`choose_version`): the newest version, not older than
the newest checkpoint on disk, of which every node's part can be had, from that node's memory
(tier "memory") or from its buddy's copy ("replica": a replacement node, or a damaged part); else
the newest verified checkpoint on disk. A part that fails verification is named, once, and the
next source is tried, never the same broken one again, so no restart loop. A rank reads the files
of parts that another node serves through that node's keeper (`Fetcher`), each checked against
the manifest's SHA-256.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from depthscale.resilience.keeper import (
    FETCHED,
    SHM,
    SNAPSHOT_DIR_ENV,
    SNAPSHOT_PEERS_ENV,
    snapshot_dir,
)
from depthscale.resilience.replica import fetch, replica_root
from depthscale.train import console
from depthscale.train.checkpoint import Checkpointer
from depthscale.train.manifest import (
    MANIFEST,
    SHARED_FILES,
    _step_of,
    global_rank,
    list_checkpoints,
    verify,
)
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
        peers = os.environ.get(SNAPSHOT_PEERS_ENV)
        self.peers: dict[str, Any] | None = json.loads(peers) if peers and self.every else None
        """Multi-node: {"node": this node, "keepers": each node's keeper URL}."""
        self.fetcher: Fetcher | None = None
        """Where the files of the version being restored are, when it is spread over nodes."""
        self._written = -2
        """The step of the newest snapshot started."""

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
        path = self._choose_across_nodes()
        return path if path is not None else self.disk.resolve_resume()

    def _choose_across_nodes(self) -> Path | None:
        """The newest snapshot every rank can have, verified, and not older than the newest
        checkpoint on disk; or None. Every node's first rank reports what its memory holds,
        verified (its own versions and the copies it keeps of its predecessor's); every rank
        then makes the same choice from the same reports (`choose_version`): the newest version
        of which each node's part can be had, from its node's memory or its buddy's copy."""
        on_disk = list_checkpoints(self.disk.root)
        floor = _step_of(on_disk[-1].name) if on_disk else -1
        node = self.peers["node"] if self.peers is not None else 0
        keepers = self.peers["keepers"] if self.peers is not None else []
        leads = os.environ.get("LOCAL_RANK", "0") == "0"
        mine = node_report(self.root, node, self.cfg.model, floor) if leads else None
        reports = [mine]
        if dist.is_initialized():
            reports = [None] * dist.get_world_size()
            dist.all_gather_object(reports, mine)
        choice, self.failed = choose_version([r for r in reports if r is not None])
        if choice is None:
            if self.failed and global_rank() == 0:
                nxt = f"checkpoint {on_disk[-1].name} on disk" if on_disk else "the start"
                console.say(f"depthscale: {self.failed[0]}; restoring from the next tier ({nxt})")
            return None
        step, serve = choice
        self.fetcher = Fetcher(self.root, node, step, serve, keepers)
        if self.failed and global_rank() == 0:
            console.say(f"depthscale: {self.failed[0]}; restoring from {describe(step, serve)}")
        return self.root / f"step_{step:08d}"

    def resolver(self, path: Path | None) -> Fetcher | None:
        """What `Checkpointer.load` reads `path` through (None: all of it is in `path`)."""
        spread = self.fetcher is not None and path is not None and path.parent == self.root
        return self.fetcher if spread else None

    def tier(self, path: Path | None) -> str | None:
        if path is None:
            return None
        if self.resolver(path) is not None:  # this node's part: its memory, or a buddy's copy
            return self.fetcher.tier
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
        if self.fetcher is not None and self.tier(path) != "disk":
            record["served_by"] = self.fetcher.served_by
            record["parts"] = {str(w): list(src) for w, src in self.fetcher.serve.items()}
            self._drop_fetched()
        if heartbeat is not None:
            heartbeat.update(restore=record)
        return record

    def _drop_fetched(self) -> None:
        """The files fetched from other nodes served their one read: free their memory once every
        rank of this node is past it."""
        if dist.is_initialized():
            dist.barrier()
        if os.environ.get("LOCAL_RANK", "0") == "0":
            shutil.rmtree(self.root / FETCHED, ignore_errors=True)

    # ------------------------------------------------------------------ saving

    def after_step(self, trainer: Any, event: Callable[[int, str, dict], None]) -> None:
        """Snapshot every `every` steps (not the last: a checkpoint follows); log each finished
        one through `event(step, kind, fields)` (the metrics logger's).

        A snapshot is written in the background while the next step runs, and training waits
        for it at that step's end: a fault then loses at most `every` steps (the version of the
        step S being written when it strikes is not committed, but no fault after step S+1 finds
        S-every the newest). The wait is zero while a write takes less than a step."""
        if self.memory is None:
            return
        step = trainer.step
        if step == self._written + 1:  # the one before must be in place before the next step
            self.memory.wait()
        for kind, fields in self.memory.events():
            event(trainer.step, kind.replace("checkpoint", "snapshot"), fields)
        if step % self.every or step >= self.cfg.train.steps:
            return
        self._written = step
        faults = trainer.faults  # drills: slowsave@S and corrupt@S reach a snapshot of step S too
        self.memory.inject_write_delay = faults.slow_save()
        path = self.memory.save(step, trainer.model, trainer.optimizer, trainer.trainer_state())
        faults.corrupt_after_save(step, path, self.memory.wait, trainer.env.is_main)


def newest_verified_version(
    root: Path, what: str, model: ModelConfig | None, node: int = 0
) -> tuple[Path | None, list[str]]:
    """The newest version under `root` that verifies (node `node`'s part of it, in memory), or
    None; and one line for each newer one that failed, naming it as `what` ("snapshot ... in the
    memory of node 0")."""
    failed = []
    for path in reversed(list_checkpoints(root)):
        problem = verify(path, model, node)
        if problem is None:
            return path, failed
        failed.append(f"{what.format(path.name)} ({path}) failed verification: {problem}")
    return None, failed


def recovery_tiers(run: Path, model: ModelConfig | None, base: Path = SHM) -> list[dict[str, Any]]:
    """What each tier of `run` on this host would give a restart now: the memory of each node
    whose keeper is here and the copies it holds of other nodes' parts, then the checkpoints on
    disk. Per tier: its directory, its versions, the newest that verifies and the lines naming
    newer ones that do not (`depthscale diagnose --run` prints them, so a damaged tier is named
    before a fault needs it)."""
    sources = []
    for root in node_dirs(run, base):
        node = int(root.name.rsplit("-node", 1)[1])
        memory = f"snapshot {{}} in the memory of node {node}"
        sources.append((f"memory of node {node}", root, node, memory))
        for of, held in copies_held(root):
            sources.append(
                (f"copy of node {of} on node {node}", held, of,
                 f"the copy of node {of}'s snapshot {{}} on node {node}")
            )  # fmt: skip
    sources.append(("disk", Path(run) / "checkpoints", 0, "checkpoint {} on disk"))
    rows = []
    for tier, root, node, what in sources:
        good, failed = newest_verified_version(root, what, model, node)
        versions = [p.name for p in list_checkpoints(root)]
        verified = good.name if good is not None else None
        rows.append(
            {"tier": tier, "root": str(root), "versions": versions, "verified": verified,
             "failed": failed}
        )  # fmt: skip
    return rows


def node_dirs(run: Path, base: Path = SHM) -> list[Path]:
    """The snapshot directories of `run`'s nodes on this host (one, on a node of a cluster)."""
    stem = snapshot_dir(run, 0, base).name.rsplit("-node", 1)[0]
    found = [p for p in base.glob(f"{stem}-node*") if p.name.rsplit("-node", 1)[1].isdigit()]
    return sorted(found, key=lambda p: int(p.name.rsplit("-node", 1)[1]))


def copies_held(root: Path) -> list[tuple[int, Path]]:
    """(node, directory) of each copy of another node's snapshots that `root`'s keeper holds."""
    held = replica_root(root)
    found = [p for p in held.iterdir() if re.fullmatch(r"node\d+", p.name)] if held.is_dir() else []
    return sorted((int(p.name[4:]), p) for p in found)


# ---------------------------------------------------------------------------- across nodes


def _writers(version: Path) -> int:
    """How many nodes hold a part of `version` (its manifest's "nodes"; 1 if unreadable)."""
    try:
        return int(json.loads((version / MANIFEST).read_bytes()).get("nodes", 1))
    except (OSError, ValueError, AttributeError):
        return 1


def node_report(root: Path, node: int, model: ModelConfig | None, floor: int) -> dict[str, Any]:
    """What this node's memory offers a restart, each version verified (its part of it): its own
    versions, and the copies it holds of other nodes' (by node), none older than `floor`."""
    own, writers, copies = {}, {}, {}
    for version in list_checkpoints(root):
        step = _step_of(version.name)
        if step >= floor:
            own[step], writers[step] = verify(version, model, node), _writers(version)
    for source, of in copies_held(root):
        for version in list_checkpoints(of):
            step = _step_of(version.name)
            if step >= floor:
                copies.setdefault(source, {})[step] = verify(version, model, source)
                writers.setdefault(step, _writers(version))
    return {"node": node, "own": own, "replica": copies, "writers": writers}


def choose_version(
    reports: list[dict[str, Any]],
) -> tuple[tuple[int, dict[int, tuple[str, int]]] | None, list[str]]:
    """The newest version of which every part can be had, and from where: {writing node: (tier,
    serving node)}, tier "memory" (the writing node's own) or "replica" (a buddy's copy); and one
    line for each part that failed verification on the way (a part merely absent, with its node,
    is no failure). The same reports give every rank the same answer."""
    steps = {s for r in reports for s in r["own"]}
    steps |= {s for r in reports for held in r["replica"].values() for s in held}
    failed: list[str] = []
    for step in sorted(steps, reverse=True):
        writers = max(r["writers"].get(step, 0) for r in reports)
        serve = {}
        for w in range(writers):
            source = _source(reports, step, w, failed)
            if source is None:
                break
            serve[w] = source
        else:
            return (step, serve), failed
    return None, failed


def _source(reports: list[dict], step: int, w: int, failed: list[str]) -> tuple[str, int] | None:
    name = f"step_{step:08d}"
    for r in reports:
        if r["node"] == w and step in r["own"]:
            if r["own"][step] is None:
                return "memory", w
            failed.append(
                f"snapshot {name} in the memory of node {w} failed verification: {r['own'][step]}"
            )
    for r in reports:
        problem = r["replica"].get(w, {}).get(step, "absent")
        if problem is None:
            return "replica", r["node"]
        if problem != "absent":
            failed.append(
                f"the copy of node {w}'s snapshot {name} on node {r['node']} failed "
                f"verification: {problem}"
            )
    return None


def describe(step: int, serve: dict[int, tuple[str, int]]) -> str:
    parts = [
        f"node {w}'s {'memory' if tier == 'memory' else f'copy on node {s}'}"
        for w, (tier, s) in sorted(serve.items())
    ]
    return f"snapshot step_{step:08d} ({', '.join(parts)})"


class Fetcher:
    """Where each file of a version spread over nodes' memory is, by name (`restore.Resolve`): in
    this node's memory when this node serves that part, else fetched once from the keeper that
    does (its SHA-256 checked against the manifest) into this node's memory."""

    def __init__(
        self,
        root: Path,
        node: int,
        step: int,
        serve: dict[int, tuple[str, int]],
        keepers: list[str],
    ) -> None:
        self.root, self.node, self.serve, self.keepers = root, node, serve, keepers
        self.name = f"step_{step:08d}"
        self._files: dict[str, dict] | None = None

    @property
    def _home(self) -> int:
        """The part whose shared files (metadata, trainer state, manifest) this node reads."""
        return self.node if self.node in self.serve else 0

    @property
    def tier(self) -> str:
        return self.serve[self._home][0]

    @property
    def served_by(self) -> int:
        return self.serve[self._home][1]

    def __call__(self, name: str) -> Path:
        if name in SHARED_FILES:
            part = self._home
        else:
            part = self._manifest()[name].get("node", 0)  # KeyError: not in this version
        tier, node = self.serve[part]
        where = "" if tier == "memory" else f"node{part}"
        if node == self.node:
            base = self.root if tier == "memory" else replica_root(self.root) / where
            return base / self.name / name
        cached = self.root / FETCHED / self.name / name
        if not cached.is_file():
            kind = "own" if tier == "memory" else f"replica/{where}"
            url = f"{self.keepers[node]}/{kind}/{self.name}/{name}"
            entry = None if name == MANIFEST else self._manifest()[name]
            fetch(url, cached, entry)
        return cached

    def _manifest(self) -> dict[str, dict]:
        if self._files is None:
            self._files = json.loads(self(MANIFEST).read_bytes())["files"]
        return self._files
