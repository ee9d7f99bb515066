"""The supervisor: launch the worker group, watch it, and on a fault collect forensics, stop the
group and restart it from the newest verified checkpoint; the restarted group first runs the
diagnostics, and a node that fails them is excluded for good (MegaScale §4).

    depthscale train -c configs/tiny.toml --nproc 4       # supervised by default when --nproc > 1

Launching uses torch's elastic machinery (`start_processes`: the process context torchrun's agent
uses, with its error files and process-group kill), and the supervisor hosts the rendezvous store
the way torchrun's agent does (`TORCHELASTIC_USE_AGENT_STORE`): every attempt gets a fresh key
prefix (`TORCHELASTIC_RESTART_COUNT`, see `parallel/mesh.init_distributed`). The restart loop is
ours, because torchrun restarts only on a process exit, and a hung rank never exits.

Detection (`watch.py`, every 50 ms): **dead** — a worker exited (its signal or exit code) or its
heartbeat went silent (SIGSTOP, a frozen host); **hung** — the group's progress counter stalled
past a limit derived from the measured step time; **slow** — the straggler detector flagged the same
rank for `resilience.slow_steps` steps; **error** — a worker raised. Bad input is not a fault: it is
reported once and the supervisor exits 2 without a restart.

Diagnostics run inside the restarted group itself (`diagnostics.diagnose_in_group`, right after
its process group is up), not in a group of their own: a restart then pays one launch, not two.
The supervisor judges the rows rank 0 publishes (`diagnose.verdict`: peers and the run's
baseline); a failing node is a fault — excluded (`nodes.py`), a spare takes its ranks.

Every decision goes to `RUN/supervisor/log.jsonl` with its inputs, and one line to the console.
Exit codes: 0 done; 2 bad input; 75 gave up (restart limits; `RUN/supervisor/report.json`);
128+N stopped by signal N.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import socket
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from depthscale.config import Config
from depthscale.errors import TrainingError
from depthscale.parallel.host_cpus import threads_per_rank
from depthscale.parallel.launcher import (
    ERROR_DIR_ENV,
    INPUT,
    PEER_LOST,
    quiet_elastic_logs,
    read_worker_errors,
    root_cause,
)
from depthscale.resilience.diagnostics import DIAGNOSE_ENV, FAULT_ENV
from depthscale.resilience.faults import ATTEMPT_ENV, bad_diag_nodes, parse_faults
from depthscale.resilience.heartbeat import (
    NODE_ENV,
    PERIOD_ENV,
    STACKS_ENV,
    SUPERVISOR_ENV,
    node_id,
)
from depthscale.resilience.keeper import (
    SNAPSHOT_DIR_ENV,
    SNAPSHOT_PEERS_ENV,
    Keeper,
    snapshot_dir,
    start_keeper,
)
from depthscale.resilience.nodes import NodePool
from depthscale.resilience.peers import Lost, Peers, PeersLost, Pulse
from depthscale.resilience.watch import Fault, Watch

SUSPECT_NODES = ("dead", "hung", "slow", "bad_node")
"""Faults after which the restarted group runs the diagnostics first: a node may be to blame (a
worker's own Python error is not: it names its cause)."""
DIAGNOSE_MB = 4

GAVE_UP = 75
"""Exit code when the restart limits are reached (EX_TEMPFAIL: a person must look)."""


class Supervisor:
    def __init__(self, cfg: Config, train_args: list[str]) -> None:
        import torch.distributed as dist

        self.cfg, self.r, p = cfg, cfg.resilience, cfg.parallel
        self.nproc, self.nnodes, self.node_rank = p.nproc, p.nnodes, p.node_rank
        self.train_args = train_args
        self.run_dir = cfg.run_path
        self.dir = self.run_dir / "supervisor"
        self.faults = parse_faults(self.r.faults)
        self.peers: Peers | None = None
        self.watch: Watch | None = None
        """The attempt's watch, while its group may run."""
        if self.nnodes == 1:
            self.addr = "127.0.0.1"
            self.store = dist.TCPStore(self.addr, 0, is_master=True, wait_for_workers=False)
            self.nodes = NodePool(self.dir, node_id(), self.r.local_nodes, self.r.spare_nodes)
        else:  # node 0 hosts the store; every node's supervisor and workers are its clients
            self.addr, self.dir = p.master_addr, self.dir / f"node{self.node_rank}"
            self.store, self.peers = self._join_nodes()
            self.nodes = NodePool(self.dir, node_id(), 1, 0)
        self.attempt = 0
        self.stop_signal: int | None = None
        self.diagnose_next = False
        """Whether the next group runs the diagnostics before training (after a fault that may be
        a node's)."""
        self.diagnostic_runs = 0
        self.keeper: Keeper | None = None
        self.keepers: list[str] = []
        """Each node's keeper URL (multi-node: restores fetch parts from other nodes)."""

    def _join_nodes(self):
        """Node 0's store (hosted here on node 0) and this node's place among the supervisors,
        beating in that store from now on (`peers.Pulse`)."""
        import torch.distributed as dist

        p = self.cfg.parallel
        where = f"{p.master_addr}:{p.master_port}"
        try:
            store = dist.TCPStore(
                p.master_addr,
                p.master_port,
                is_master=self.node_rank == 0,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=self.r.startup_timeout_s),
            )
            pulse = Pulse(
                p.master_addr,
                store.port,
                self.nnodes,
                self.node_rank,
                self.r.heartbeat_s,
                self.r.node_lost_s,
            )
        except (RuntimeError, OSError) as err:  # DistNetworkError is a RuntimeError
            role = "host the rendezvous store on" if self.node_rank == 0 else "reach node 0 at"
            raise TrainingError(
                f"node {self.node_rank}: cannot {role} {where} within "
                f"resilience.startup_timeout_s={self.r.startup_timeout_s:g} s "
                f"({str(err).splitlines()[0]}); check parallel.master_addr / master_port "
                "and that node 0's supervisor runs"
            ) from None
        # past the connection, a call that node 0 leaves unanswered this long means it is gone
        store.set_timeout(datetime.timedelta(seconds=self.r.node_lost_s))
        me = {"node": node_id(), "host": socket.gethostname()}
        pulse.abandon = self._abandon
        return store, Peers(store, self.nnodes, self.node_rank, self.r.startup_timeout_s, pulse, me)

    def _abandon(self, lost: Lost) -> None:
        """On the pulse's thread: node 0 is gone while the main thread waits inside a call to
        its store that never returns (torch gives those calls no timeout; a frozen or vanished
        host answers nothing). Stop this node's workers, report, and exit 75 from here."""
        if self.watch is not None:
            with contextlib.suppress(Exception):
                self.watch.stop_group()
        fault = self._lost_fault(PeersLost(self.peers.describe(lost), lost))
        self.log(
            "fault",
            f"attempt {self.attempt}: {fault.describe()}",
            fault=asdict(fault),
            attempt=self.attempt,
        )
        code = self._give_up_lost(fault, self.attempt)
        sys.stdout.flush()
        os._exit(code)  # the main thread cannot be woken from inside torch's call

    # ------------------------------------------------------------------ logging

    def log(self, event: str, text: str, **inputs: Any) -> None:
        """One console line and one JSON record (with the decision's inputs)."""
        print(f"depthscale: supervisor: {text}", file=sys.stderr, flush=True)
        self.dir.mkdir(parents=True, exist_ok=True)
        record = {"time": time.time(), "event": event, "text": text, **inputs}
        with open(self.dir / "log.jsonl", "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record, default=str) + "\n")

    # ------------------------------------------------------------------ the loop

    def run(self) -> int:
        previous = self._catch_stop_signals()
        code = 1
        try:
            if self.cfg.checkpoint.snapshot_every:  # the node's snapshots (train/snapshot.py)
                self.keeper, self.keepers = start_keeper(
                    snapshot_dir(self.run_dir, self.node_rank), self.log, self.store,
                    self.node_rank, self.nnodes, self.addr, self.cfg.checkpoint.replica_mb_s,
                )  # fmt: skip
            code = self._loop()
        except (PeersLost, TimeoutError) as lost:  # another node is gone, between two attempts
            code = self._gave_up_waiting(lost)
        finally:
            if self.peers is not None:  # node 0 keeps the store up for the others' last word
                self.peers.close(f"exit {code}", wait=code in (0, GAVE_UP))
            for s, handler in previous.items():
                signal.signal(s, handler)
            if self.keeper is not None:  # kept for a requeue (75), else freed
                self.keeper.close(keep=code == GAVE_UP)
        return code

    def _catch_stop_signals(self) -> dict[int, Any]:
        """SIGINT / SIGTERM only set a flag: the watch forwards the same signal to the workers
        (they save and exit) and returns. Installed again after every launch: torch's process
        context installs its own handlers, which would raise out of the watch loop."""
        return {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stop_signal = signum

    def _loop(self) -> int:
        attempt, restarts, stalled, best = 0, 0, 0, 0
        pending_breakdown: dict[str, float] | None = None
        while True:
            self.attempt = attempt
            nodes = self.nodes.active()
            if nodes is None:
                return self._give_up(
                    f"fewer healthy nodes than the {self.r.local_nodes} the run needs "
                    f"(excluded: {', '.join(self.nodes.excluded) or 'none'}; no spare left)",
                    attempt,
                )
            if self.peers is not None:
                self.peers.ready(attempt)
            with tempfile.TemporaryDirectory(prefix="depthscale-errors-") as errors:
                watch = self.watch = self._launch(attempt, nodes, Path(errors))
                try:
                    fault = watch.run(pending_breakdown, self)
                except BaseException:  # a supervisor bug must not leave the workers running
                    watch.stop_group()
                    raise
                pending_breakdown = None
                if fault is None:  # every worker finished
                    return 0
                if fault.kind == "stopped":
                    return 128 + (self.stop_signal or signal.SIGTERM)
                cause = root_cause(read_worker_errors(Path(errors)))
                # bad input ends the job, unless it only followed another fault (a dead peer)
                if cause is not None and cause.kind == INPUT and fault.kind == "error":
                    watch.stop_group()
                    print(cause.message, file=sys.stderr, flush=True)
                    return 2
                if self.peers is not None:
                    fault = self._agree(attempt, fault, cause)
                watch.settle_saves(fault, self)
                t_stop = time.time()
                watch.forensics(fault, self.dir / f"attempt{attempt}")
                t_forensics = time.time()
                watch.stop_group()
                t_stopped = time.time()
            if cause is not None and fault.kind == "error":
                fault.detail = cause.message.splitlines()[-1][:300]
            self.log(
                "fault",
                f"attempt {attempt}: {fault.describe()}",
                fault=asdict(fault),
                attempt=attempt,
            )
            if fault.kind == "lost":  # the job cannot go on without that node: requeue it
                return self._give_up_lost(fault, attempt)
            if fault.kind == "bad_node":
                for node in fault.nodes:
                    self.nodes.exclude(node, {"attempt": attempt, **fault.evidence})
            # every node decides alike (the diagnostics are collective): by the original fault
            kind = fault.evidence.get("remote", {}).get("kind", fault.kind)
            self.diagnose_next = self.r.diagnose and kind in SUSPECT_NODES
            newest = max(watch.checkpoint_step, self._newest_published())
            stalled = 0 if newest > best else stalled + 1
            best = max(best, newest)
            restarts += 1
            why = self._give_up_reason(restarts, stalled)
            if self.peers is not None:  # node 0 sees rank 0 (progress, diagnostics): it decides
                why = self.peers.decide(attempt, {"give_up": why})["give_up"]
            if why is not None:
                return self._give_up(why, attempt)
            self._log_restart(attempt, best, restarts, stalled)
            pending_breakdown = {
                "fault": fault.since,
                "detected": fault.detected_at,
                "forensics": t_forensics - t_stop,
                "stop": t_stopped - t_forensics,
                "relaunch_at": time.time(),
            }
            if self.keeper is not None:  # no group runs: unfinished snapshots can go
                self.keeper.sweep()
            attempt += 1

    def _give_up_reason(self, restarts: int, stalled: int) -> str | None:
        """Why this job stops restarting, or None: too many restarts, too many without a newer
        checkpoint, or (several nodes, no spare) a node excluded by the diagnostics."""
        if restarts > self.r.max_restarts:
            return f"{restarts - 1} restarts (resilience.max_restarts)"
        if stalled > self.r.max_restarts_without_progress:
            return (
                f"{stalled - 1} restarts in a row without a newer checkpoint "
                "(resilience.max_restarts_without_progress)"
            )
        if self.peers is not None and self.nodes.excluded:
            return (
                f"node(s) {', '.join(self.nodes.excluded)} failed the diagnostics; a "
                "multi-node job has no spare: requeue it without them (SLURM --exclude)"
            )
        return None

    def _log_restart(self, attempt: int, best: int, restarts: int, stalled: int) -> None:
        newest = f" (the newest saved is of step {best})" if best else " (none yet: from the start)"
        if self.keeper is not None:  # the workers choose, memory first, and the restart says
            newest = " or snapshot in memory"
        self.log(
            "restart",
            f"restarting (attempt {attempt + 1}) from the newest verified checkpoint{newest}",
            attempt=attempt + 1,
            checkpoint_step=best,
            restarts=restarts,
            restarts_without_progress=stalled,
        )

    def _launch(self, attempt: int, nodes: list[str], errors: Path) -> Watch:
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

        quiet_elastic_logs()  # we report exits and kills ourselves, once

        per_node = self.nproc // len(nodes)
        threads = str(threads_per_rank(self.nproc))
        first = self.node_rank * self.nproc  # this node's first global rank
        base = {
            "WORLD_SIZE": str(self.nproc * self.nnodes),
            "LOCAL_WORLD_SIZE": str(self.nproc),
            "MASTER_ADDR": self.addr,
            "MASTER_PORT": str(self.store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            ATTEMPT_ENV: str(attempt),
            SUPERVISOR_ENV: f"{self.addr}:{self.store.port}",
            PERIOD_ENV: str(self.r.heartbeat_s),
            STACKS_ENV: str(self.dir / f"attempt{attempt}" / "stacks"),
            ERROR_DIR_ENV: str(errors),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads),
        }
        if self.keeper is not None:
            base[SNAPSHOT_DIR_ENV] = str(self.keeper.root)
            if self.nnodes > 1:
                peers = {"node": self.node_rank, "keepers": self.keepers}
                base[SNAPSHOT_PEERS_ENV] = json.dumps(peers)
        judge = None
        if self.diagnose_next and self.nproc * self.nnodes > 1:
            base[DIAGNOSE_ENV] = str(DIAGNOSE_MB)
            slow = bad_diag_nodes(self.faults, self.diagnostic_runs)
            if slow:
                base[FAULT_ENV] = ",".join(f"slow@{n}" for n in slow)
            self.diagnostic_runs += 1
            if self.node_rank == 0:  # global rank 0 publishes the rows here
                judge = self._judge(attempt)
        envs = {
            rank: {
                **base,
                "RANK": str(first + rank),
                "LOCAL_RANK": str(rank),
                "GROUP_RANK": str(self.node_rank if self.nnodes > 1 else rank // per_node),
                NODE_ENV: nodes[rank // per_node],
            }
            for rank in range(self.nproc)
        }
        args = {rank: ("-m", "depthscale", "train", *self.train_args) for rank in range(self.nproc)}
        context = start_processes(
            name="depthscale",
            entrypoint=sys.executable,
            args=args,
            envs=envs,
            logs_specs=DefaultLogsSpecs(log_dir=tempfile.mkdtemp(prefix="depthscale-elastic-")),
        )
        self._catch_stop_signals()
        self.log(
            "launch",
            f"attempt {attempt}: started {self.nproc} workers on "
            f"{len(nodes)} node(s) ({', '.join(nodes)})",
            attempt=attempt,
            nodes=nodes,
            pids=context.pids(),
        )
        remote = (lambda: self._remote(attempt)) if self.peers is not None else None
        node_of = [envs[r][NODE_ENV] for r in envs]
        return Watch(
            context, self.store, attempt, self.r, node_of, judge, first, remote,
            published=self._newest_published,
        )  # fmt: skip

    # ------------------------------------------------------------------ between attempts

    def _judge(self, attempt: int):
        """How the diagnostics a restarted group publishes are judged: against the peers and the
        run's baseline (`diagnose.verdict`); a failing node becomes a fault (and is excluded)."""
        from depthscale.resilience.diagnose import verdict

        started = time.monotonic()

        def judge(published: dict) -> Fault | None:
            report = verdict(
                published["rows"], self.run_dir, published["size_mb"], self.run_dir / "checkpoints"
            )
            bad = report.bad_nodes
            self.log(
                "diagnose",
                f"attempt {attempt}: diagnostics "
                + (
                    "; ".join(f"node {n} failed ({'; '.join(why)})" for n, why in bad.items())
                    if bad
                    else f"passed on every node ({time.monotonic() - started:.2f} s after launch)"
                ),
                attempt=attempt,
                bad_nodes=bad,
                warnings=report.warnings,
            )
            if not bad:
                return None
            now = time.time()
            rows = published["rows"]
            ranks = [r for r, row in enumerate(rows) if (row or {}).get("node") in bad]
            return Fault(
                "bad_node",
                ranks,
                sorted(bad),
                "failed the diagnostics: excluded",
                now,
                now,
                {"failures": bad},
            )

        return judge

    def _remote(self, attempt: int) -> Fault | dict | None:
        """Multi-node, watched with this node's group: another node gone (a Fault), or the fault
        another node reported (its record)."""
        try:
            self.peers.raise_if_lost()
            return self.peers.fault(attempt)
        except PeersLost as lost:
            return self._lost_fault(lost)

    def _lost_fault(self, lost: PeersLost) -> Fault:
        """A lost node as this attempt's fault: its ranks, its name, how it was found."""
        found = lost.lost
        if found is None:  # only the coordination failed: node 0 hosts it
            now = time.time()
            return Fault("lost", [], ["node 0"], str(lost), now, now, {"node_rank": 0})
        ranks = list(range(found.node * self.nproc, (found.node + 1) * self.nproc))
        node_id = (self.peers.names.get(found.node) or {}).get("node") or f"node {found.node}"
        return Fault(
            "lost", ranks, [node_id], found.how, found.since, found.detected_at,
            {"node_rank": found.node, "node": self.peers.name(found.node), **found.evidence},
        )  # fmt: skip

    def _agree(self, attempt: int, fault: Fault, cause=None) -> Fault:
        """Multi-node: one fault per attempt, the first any node saw (a lost node is one too). A
        worker that only lost its peers exits with an error a moment after the real fault
        elsewhere: wait for it briefly — up to resilience.node_lost_s when its error says a peer
        is gone, for a node gone whole reports nothing: the pulse finds it within that limit."""
        if fault.kind == "peer":
            return fault
        try:
            if fault.kind == "error":
                lost_peer = cause is not None and cause.kind == PEER_LOST
                self._wait_for_a_cause(attempt, self.r.node_lost_s + 0.5 if lost_peer else 1.0)
        except PeersLost as lost:
            fault = self._lost_fault(lost)
        if fault.kind == "lost" and fault.evidence.get("node_rank") == 0:
            return fault  # node 0's store is gone with it: nobody to agree with
        try:
            won = self.peers.report_fault(attempt, asdict(fault))
        except PeersLost as lost:
            return self._lost_fault(lost)
        if won["node_rank"] == self.node_rank:
            return fault
        return Fault(
            "peer",
            won["ranks"],
            won["nodes"],
            f"node {won['node_rank']} reported: {won['kind']}: {won['detail']}",
            won["since"],
            won["detected_at"],
            {"remote": won},
        )

    def _wait_for_a_cause(self, attempt: int, seconds: float) -> None:
        """Until another node reports a fault or the pulse finds a node gone (PeersLost)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and self.peers.fault(attempt) is None:
            self.peers.raise_if_lost()
            time.sleep(0.05)

    def _newest_published(self) -> int:
        """The newest step whose checkpoint directory was published (renamed into place when
        complete; the workers verify it before resuming). The heartbeats say the same a moment
        later, and also where the run directory is not shared."""
        steps = [0]
        for path in (self.run_dir / "checkpoints").glob("step_*"):
            if path.is_dir() and path.name[5:].isdigit():
                steps.append(int(path.name[5:]))
        return max(steps)

    def _give_up_lost(self, fault: Fault, attempt: int) -> int:
        """Another node is gone: no restart can bring its ranks back (no spare across nodes), so
        every surviving node gives up; node 0 tells the others, whose pulse may not see it."""
        why = (
            f"{fault.evidence.get('node', fault.nodes[0])} is gone ({fault.detail}); the job "
            "cannot go on without it: "
            "requeue it (without that node if it stays down; the run resumes from its newest "
            "verified checkpoint)"
        )
        if self.peers.leader:
            with contextlib.suppress(PeersLost, TimeoutError):
                self.peers.decide(attempt, {"give_up": why})
        lost = {"node_id": fault.nodes[0], "ranks": fault.ranks, **fault.evidence}
        return self._give_up(why, attempt, lost_node=lost)

    def _gave_up_waiting(self, lost: PeersLost | TimeoutError) -> int:
        """Another node was found gone, or never came, while this node waited for it between two
        attempts (no group of this node runs then): the same give-up as during one."""
        if isinstance(lost, PeersLost) and lost.lost is not None:
            fault = self._lost_fault(lost)
            self.log(
                "fault",
                f"attempt {self.attempt}: {fault.describe()}",
                fault=asdict(fault),
                attempt=self.attempt,
            )
            return self._give_up_lost(fault, self.attempt)
        return self._give_up(f"{lost}; requeue the job", self.attempt)

    def _give_up(self, why: str, attempt: int, **more: Any) -> int:
        report = {
            "gave_up": why,
            "attempts": attempt + 1,
            "excluded_nodes": self.nodes.excluded,
            "log": str(self.dir / "log.jsonl"),
            **more,
        }
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "report.json").write_text(json.dumps(report, indent=1, default=str))
        self.log("gave_up", f"giving up: {why}; report in {self.dir / 'report.json'}", **report)
        return GAVE_UP


def supervise(cfg: Config, train_args: list[str]) -> int:
    """Run `depthscale train TRAIN_ARGS` on `cfg.parallel.nproc` supervised local workers."""
    return Supervisor(cfg, train_args).run()
