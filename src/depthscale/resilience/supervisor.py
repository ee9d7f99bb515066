"""The supervisor: launch the worker group, watch it, and on a fault collect forensics, stop the
group, diagnose, exclude bad nodes and restart from the newest verified checkpoint (MegaScale §4).

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

Every decision goes to `RUN/supervisor/log.jsonl` with its inputs, and one line to the console.
Exit codes: 0 done; 2 bad input; 75 gave up (restart limits; `RUN/supervisor/report.json`);
128+N stopped by signal N.
"""

from __future__ import annotations

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
from depthscale.parallel.launcher import (
    ERROR_DIR_ENV,
    INPUT,
    quiet_elastic_logs,
    read_worker_errors,
    root_cause,
)
from depthscale.resilience.faults import ATTEMPT_ENV, bad_diag_nodes, parse_faults
from depthscale.resilience.heartbeat import NODE_ENV, PERIOD_ENV, STACKS_ENV, SUPERVISOR_ENV
from depthscale.resilience.nodes import NodePool
from depthscale.resilience.watch import Fault, Watch

GAVE_UP = 75
"""Exit code when the restart limits are reached (EX_TEMPFAIL: a person must look)."""


class Supervisor:
    def __init__(self, cfg: Config, train_args: list[str]) -> None:
        import torch.distributed as dist

        self.cfg, self.r = cfg, cfg.resilience
        self.nproc = cfg.parallel.nproc
        self.train_args = train_args
        self.run_dir = cfg.run_path
        self.dir = self.run_dir / "supervisor"
        self.faults = parse_faults(self.r.faults)
        self.host = socket.gethostname()
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.nodes = NodePool(self.dir, self.host, self.r.local_nodes, self.r.spare_nodes)
        self.stop_signal: int | None = None
        self.log_file = None

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
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._loop()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stop_signal = signum

    def _loop(self) -> int:
        attempt, restarts, stalled, best = 0, 0, 0, 0
        pending_breakdown: dict[str, float] | None = None
        while True:
            nodes = self.nodes.active()
            if nodes is None:
                return self._give_up(
                    f"fewer healthy nodes than the {self.r.local_nodes} the run needs "
                    f"(excluded: {', '.join(self.nodes.excluded) or 'none'}; no spare left)",
                    attempt,
                )
            with tempfile.TemporaryDirectory(prefix="depthscale-errors-") as errors:
                watch = self._launch(attempt, nodes, Path(errors))
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
                if cause is not None and cause.kind == INPUT:
                    watch.stop_group()
                    print(cause.message, file=sys.stderr, flush=True)
                    return 2
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
            self._diagnose(attempt, fault)
            t_diagnosed = time.time()
            newest = watch.checkpoint_step  # the newest this attempt saved (heartbeats)
            stalled = 0 if newest > best else stalled + 1
            best = max(best, newest)
            restarts += 1
            if restarts > self.r.max_restarts:
                return self._give_up(f"{restarts - 1} restarts (resilience.max_restarts)", attempt)
            if stalled > self.r.max_restarts_without_progress:
                return self._give_up(
                    f"{stalled - 1} restarts in a row without a newer checkpoint "
                    "(resilience.max_restarts_without_progress)",
                    attempt,
                )
            self.log(
                "restart",
                f"restarting (attempt {attempt + 1}) from the newest verified checkpoint"
                + (
                    f" (the newest saved is of step {best})"
                    if best
                    else " (none yet: from the start)"
                ),
                attempt=attempt + 1,
                checkpoint_step=best,
                restarts=restarts,
                restarts_without_progress=stalled,
            )
            pending_breakdown = {
                "fault": fault.since,
                "detected": fault.detected_at,
                "forensics": t_forensics - t_stop,
                "stop": t_stopped - t_forensics,
                "diagnose": t_diagnosed - t_stopped,
                "relaunch_at": time.time(),
            }
            attempt += 1

    def _launch(self, attempt: int, nodes: list[str], errors: Path) -> Watch:
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

        quiet_elastic_logs()  # we report exits and kills ourselves, once

        per_node = self.nproc // len(nodes)
        threads = str(max(1, (os.cpu_count() or 1) // self.nproc))
        base = {
            "WORLD_SIZE": str(self.nproc),
            "LOCAL_WORLD_SIZE": str(self.nproc),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(self.store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            ATTEMPT_ENV: str(attempt),
            SUPERVISOR_ENV: f"127.0.0.1:{self.store.port}",
            PERIOD_ENV: str(self.r.heartbeat_s),
            STACKS_ENV: str(self.dir / f"attempt{attempt}" / "stacks"),
            ERROR_DIR_ENV: str(errors),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads),
        }
        envs = {
            rank: {
                **base,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "GROUP_RANK": str(rank // per_node),
                NODE_ENV: nodes[rank // per_node],
            }
            for rank in range(self.nproc)
        }
        args = {rank: ("-m", "depthscale.train", *self.train_args) for rank in range(self.nproc)}
        context = start_processes(
            name="depthscale",
            entrypoint=sys.executable,
            args=args,
            envs=envs,
            logs_specs=DefaultLogsSpecs(log_dir=tempfile.mkdtemp(prefix="depthscale-elastic-")),
        )
        self.log(
            "launch",
            f"attempt {attempt}: started {self.nproc} workers on "
            f"{len(nodes)} node(s) ({', '.join(nodes)})",
            attempt=attempt,
            nodes=nodes,
            pids=context.pids(),
        )
        return Watch(context, self.store, attempt, self.r, [envs[r][NODE_ENV] for r in envs])

    # ------------------------------------------------------------------ between attempts

    def _diagnose(self, attempt: int, fault: Fault) -> None:
        """Run the diagnostics on every node (as the group ran: same ranks, same nodes) and exclude
        those that fail; the list is kept in the run directory. A worker's own error (a Python
        exception) says what broke; the nodes are not suspected."""
        if not self.r.diagnose or fault.kind == "error":
            return
        from depthscale.resilience.diagnose import diagnose
        from depthscale.resilience.diagnostics import FAULT_ENV

        nodes = self.nodes.active() or []
        per_node = self.nproc // max(1, len(nodes))
        slow = ",".join(f"slow@{n}" for n in bad_diag_nodes(self.faults, attempt))
        env = {
            r: {NODE_ENV: nodes[r // per_node], **({FAULT_ENV: slow} if slow else {})}
            for r in range(self.nproc)
        }
        report = diagnose(self.nproc, self.run_dir, env, ckpt_dir=self.run_dir / "checkpoints")
        bad = report.bad_nodes
        self.log(
            "diagnose",
            "diagnostics: "
            + (
                "; ".join(f"node {n} failed ({'; '.join(why)}), excluded" for n, why in bad.items())
                if bad
                else f"every node passed ({report.info.get('wall_s', 0):.1f} s)"
            ),
            attempt=attempt,
            bad_nodes=bad,
            warnings=report.warnings,
        )
        for node, why in bad.items():
            self.nodes.exclude(node, {"attempt": attempt, "failures": why})

    def _give_up(self, why: str, attempt: int) -> int:
        report = {
            "gave_up": why,
            "attempts": attempt + 1,
            "excluded_nodes": self.nodes.excluded,
            "log": str(self.dir / "log.jsonl"),
        }
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "report.json").write_text(json.dumps(report, indent=1, default=str))
        self.log("gave_up", f"giving up: {why}; report in {self.dir / 'report.json'}", **report)
        return GAVE_UP


def supervise(cfg: Config, train_args: list[str]) -> int:
    """Run `depthscale train TRAIN_ARGS` on `cfg.parallel.nproc` supervised local workers."""
    return Supervisor(cfg, train_args).run()
