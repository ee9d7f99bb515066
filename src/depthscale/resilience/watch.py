"""Watching one attempt of the worker group: exits, heartbeats and progress, every 50 ms, until the
group finishes or a fault is found (`Watch.run`); then forensics and stopping the group.

The limits, and why (each decision's inputs go to the supervisor's log):
- silent heartbeat: max(4 heartbeats, 1.5 s). A live worker writes one every period (the record
  says which: `heartbeat_s`, longer in a large group, `heartbeat.beat_period`) from a daemon thread
  that only needs the GIL for a moment; a SIGSTOPped or frozen process writes none. Heartbeats are
  read back every quarter period (at most every 50 ms), not every poll: one store serves them all.
- no progress: max(`hang_floor_s`, `hang_factor` × the group's p99 step time, 2 heartbeats) —
  a healthy rank ends a span (data, forward, backward, optimizer, a message, a collective) many
  times a step. Inside a checkpoint save (its blocking part, or its background writer still in
  flight on any rank: the writer competes with the steps beside it for cores and disk) or an
  evaluation, or after the last step, `long_phase_s`; before the first step, `startup_timeout_s`
  for each stretch in which the start does not advance (`startup_watch.py`: imports, data,
  kernel builds and compilations may take many times that in all).
- the culprit of a hang is the rank whose progress is oldest, preferring one that is not waiting
  for others: the ranks blocked in a collective are its victims.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from depthscale.resilience.fault_record import Fault
from depthscale.resilience.heartbeat import diagnostics_key, heartbeat_key
from depthscale.resilience.keeper import with_restore
from depthscale.resilience.startup_watch import StartupProgress, last_phase, start_record

if TYPE_CHECKING:
    from depthscale.config.schema import ResilienceConfig

POLL_S = 0.05
SILENT_FLOOR_S = 1.5
LONG_PHASES = ("checkpoint", "eval")
ENDING = ("finishing", "exiting")


class _Rank:
    def __init__(self, launched: float) -> None:
        self.hb: dict[str, Any] | None = None
        self.seen_at = launched  # when its heartbeat last changed
        self.progress = -1
        self.progress_at = launched  # when its progress last changed
        self.exit: int | None = None


class Watch:
    def __init__(
        self,
        context,
        store,
        attempt: int,
        r: ResilienceConfig,
        nodes: list[str],
        diagnose: Callable[[dict], Fault | None] | None = None,
        base: int = 0,
        remote_fault: Callable[[], dict | Fault | None] | None = None,
        published: Callable[[], int] = lambda: 0,
    ) -> None:
        """`nodes`: the node of each local worker; `base`: the global rank of the first (a node
        of a multi-node job). `diagnose`: judges the diagnostics rows the group publishes on a
        restart (a Fault when a node fails them); None when the group runs none.
        `remote_fault`: another node's fault, if any (multi-node): this group then stops too;
        a Fault when another node is gone.
        `published`: the newest step whose checkpoint is on disk."""
        self.context, self.store, self.attempt, self.r = context, store, attempt, r
        self.nodes = nodes
        self.diagnose = diagnose
        self.base = base
        self.remote_fault = remote_fault
        self.published = published
        self.launched = time.time()
        self.ranks = [_Rank(self.launched) for _ in nodes]
        self.starting = StartupProgress(len(nodes), self.launched)
        self.read_at = float("-inf")
        self.stopping_since: float | None = None
        self.slow_since: dict[int, int] = {}
        self.nan_seen = 0
        self.checkpoint_step = 0
        """The newest checkpoint step the group reported saved (rank 0's heartbeat)."""
        self.started_logged = False

    # ------------------------------------------------------------------ the loop

    def run(self, breakdown: dict[str, float] | None, supervisor) -> Fault | None:
        """Until every worker exits 0 (None) or a fault (returned; the group is still running)."""
        while True:
            now = time.time()
            self._poll_exits()
            if supervisor.stop_signal is not None:
                if self._stop_gracefully(supervisor.stop_signal, now):
                    return Fault("stopped", [], [], "stop signal", now, now)
            elif all(s.exit == 0 for s in self.ranks):
                return None
            else:
                fault = (
                    self._exit_fault(now)
                    or self._remote(now)
                    or self._diagnosed()
                    or self._read_and_judge(now, supervisor)
                )
                if fault is not None:
                    return fault
                if not self.started_logged and self._all_marked("first_step"):
                    self.started_logged = True
                    self._log_start(breakdown, supervisor)
            time.sleep(POLL_S)

    def _poll_exits(self) -> None:
        for rank, handler in self.context.subprocess_handlers.items():
            if self.ranks[rank].exit is None:
                self.ranks[rank].exit = handler.proc.poll()

    def _stop_gracefully(self, signum: int, now: float) -> bool:
        """Forward the stop to the workers (they save and exit), as the signal that came: their
        stop message names it. True once all have exited."""
        if self.stopping_since is None:
            self.stopping_since = now
            for s, pid in zip(self.ranks, self.context.pids().values()):
                if s.exit is None:
                    _signal(pid, signum)
        if all(s.exit is not None for s in self.ranks):
            return True
        if now - self.stopping_since > 60:
            self.stop_group()
            return True
        return False

    def _exit_fault(self, now: float) -> Fault | None:
        failed = {r: s.exit for r, s in enumerate(self.ranks) if s.exit not in (None, 0)}
        if not failed:
            return None
        killed = {r: c for r, c in failed.items() if c < 0}
        if killed:
            rank, code = min(killed.items())
            detail = f"killed by {signal.Signals(-code).name} (pid {self._pid(rank)})"
            kind = "dead"
        else:
            rank, code = min(failed.items())
            detail, kind = f"exited with code {code}", "error"
        return Fault(
            kind,
            [self.base + rank],
            [self.nodes[rank]],
            detail,
            now - POLL_S / 2,
            now,
            self._evidence(exits=failed),
        )

    def _remote(self, now: float) -> Fault | None:
        """Another node's supervisor found a fault: this node's part of the group stops too. Or
        another node is gone (a Fault already: `peers.Pulse` found it)."""
        other = self.remote_fault() if self.remote_fault is not None else None
        if other is None or isinstance(other, Fault):
            return other
        return Fault(
            "peer",
            other.get("ranks", []),
            other.get("nodes", []),
            f"node {other.get('node_rank')} reported: {other.get('kind')}: {other.get('detail')}",
            other.get("since", now),
            now,
            {"remote": other},
        )

    def _diagnosed(self) -> Fault | None:
        """The restarted group's diagnostics, once rank 0 has published them."""
        if self.diagnose is None:
            return None
        key = diagnostics_key(self.attempt)
        try:
            if not self.store.check([key]):
                return None
            published = json.loads(self.store.get(key))
        except Exception:
            return None
        judge, self.diagnose = self.diagnose, None
        return judge(published)

    # ------------------------------------------------------------------ heartbeats

    def _read(self, now: float) -> None:
        for rank, s in enumerate(self.ranks):
            key = heartbeat_key(self.attempt, self.base + rank)
            try:
                if s.hb is None and not self.store.check([key]):
                    continue
                hb = json.loads(self.store.get(key))
            except Exception:  # the store failed a call: the rest would wait out its timeout too
                return
            if s.hb is None or hb.get("seq") != s.hb.get("seq"):
                s.seen_at = now
            self.starting.observe(rank, hb, now)
            self.checkpoint_step = max(self.checkpoint_step, int(hb.get("checkpoint_step") or 0))
            if hb.get("progress") != s.progress:
                s.progress, s.progress_at = hb.get("progress"), now
            s.hb = hb

    def _period(self, rank: int) -> float:
        """The rank's heartbeat period, as its record says (`heartbeat.beat_period`)."""
        return float((self.ranks[rank].hb or {}).get("period") or self.r.heartbeat_s)

    def _read_and_judge(self, now: float, supervisor) -> Fault | None:
        running = [r for r, s in enumerate(self.ranks) if s.exit is None]
        periods = [self._period(r) for r in running] or [self.r.heartbeat_s]
        if now - self.read_at >= max(POLL_S, min(periods) / 4):
            self.read_at = now
            self._read(now)
        for rank in running:
            s = self.ranks[rank]
            silent_limit = max(4 * self._period(rank), SILENT_FLOOR_S)
            exiting = (s.hb or {}).get("state") == "exiting"
            if s.hb is not None and now - s.seen_at > (
                self.r.long_phase_s if exiting else silent_limit
            ):
                state = _process_state(self._pid(rank))
                return self._hang(
                    [rank],
                    f"heartbeat silent for {now - s.seen_at:.2f} s (limit {silent_limit:.2f} s; "
                    f"process state: {state})",
                    s.seen_at,
                    now,
                    limit=silent_limit,
                )
        if not self._all_marked("first_step"):
            return self._startup_hang(running, now)
        limit, why = self._progress_limit(running)
        culprit = self._culprit(running)
        if (
            culprit is not None
            and self.remote_fault is not None
            and ((self.ranks[culprit].hb or {}).get("waiting"))
        ):  # every local rank waits: the culprit is on another node, whose supervisor names it
            limit, why = 2 * limit, why + "; doubled: every rank of this node is waiting"
        if culprit is not None and now - self.ranks[culprit].progress_at > limit:
            s = self.ranks[culprit]
            phase = (s.hb or {}).get("phase") or "between spans"
            return self._hang(
                [culprit],
                f"no progress for {now - s.progress_at:.2f} s in {phase} (limit {limit:.2f} s: "
                f"{why}); the others wait for it",
                s.progress_at,
                now,
                limit=limit,
            )
        self._note_nan(supervisor)
        return self._slow(running, now)

    def _progress_limit(self, running: list[int]) -> tuple[float, str]:
        hbs = [self.ranks[r].hb or {} for r in running]
        if any(hb.get("phase") in LONG_PHASES or hb.get("state") in ENDING for hb in hbs):
            return (
                self.r.long_phase_s,
                "a checkpoint save, evaluation or the run's end: long_phase_s",
            )
        saving = self.saving_steps()
        if saving:  # its writer takes cores and disk from the steps beside it
            return (
                self.r.long_phase_s,
                f"a background save of step {max(saving)} in flight: long_phase_s",
            )
        p99 = max((hb.get("step_p99_s") or 0.0) for hb in hbs) if hbs else 0.0
        beat = max((self._period(r) for r in running), default=self.r.heartbeat_s)
        limit = max(self.r.hang_floor_s, self.r.hang_factor * p99, 2 * beat)
        return limit, (
            f"max(hang_floor_s {self.r.hang_floor_s:g}, {self.r.hang_factor:g} × p99 step "
            f"{p99:.3f} s, 2 heartbeats)"
        )

    def _startup_hang(self, running: list[int], now: float) -> Fault | None:
        """Before the group's first step: hung once no rank still starting has advanced for
        `startup_timeout_s` (`startup_watch.py`)."""
        limit = self.r.startup_timeout_s
        starting = [r for r in running if "first_step" not in self._marks(r)]
        stalled = self.starting.stalled(starting, now, limit)
        if stalled is None:
            return None
        culprit, since = stalled
        phase = last_phase(self._marks(culprit))
        return self._hang(
            [culprit],
            f"start-up made no progress for {now - since:.2f} s (limit {limit:g} s: "
            f"resilience.startup_timeout_s, each stretch without a new start-up phase, "
            f"compilation or span; {now - self.launched:.0f} s since launch); its last phase "
            f"done: {phase}",
            since,
            now,
            limit=limit,
        )

    def saving_steps(self) -> set[int]:
        """Steps whose background save a running rank reports still in flight, and not yet
        published (a rank reports its own writer; the newest directory on disk says it is done)."""
        steps = {
            int(s.hb["saving"])
            for s in self.ranks
            if s.exit is None and s.hb and s.hb.get("saving") is not None
        }
        return {step for step in steps if step > self.published()}

    def settle_saves(self, fault: Fault, supervisor) -> None:
        """Before a hung or slow group is stopped, let a background save in flight finish: its
        writers run beside the stuck main thread, and killing them loses the checkpoint the restart
        would resume from (restart after restart, each killing the next save, is a loop).
        Bounded by long_phase_s; a dead or failed rank's writer died with it, so no wait there."""
        if fault.kind not in ("hung", "slow"):
            return
        saving = self.saving_steps()
        if not saving:
            return
        limit = self.r.long_phase_s
        supervisor.log(
            "settle",
            f"attempt {self.attempt}: waiting up to {limit:g} s (resilience.long_phase_s) for the "
            f"save of step {max(saving)} in flight before stopping the group",
            steps=sorted(saving),
        )
        start = time.time()
        while saving and time.time() - start < limit:
            time.sleep(POLL_S)
            self._poll_exits()
            self._read(time.time())
            saving = self.saving_steps()
        supervisor.log(
            "settled",
            f"attempt {self.attempt}: "
            + (
                f"the save is still in flight after {limit:g} s; stopping anyway"
                if saving
                else f"the save finished after {time.time() - start:.2f} s"
            ),
            waited_s=round(time.time() - start, 3),
            published=self.published(),
        )

    def _culprit(self, running: list[int]) -> int | None:
        """The rank with the oldest progress, preferring one not waiting for others."""
        if not running:
            return None
        busy = [r for r in running if not (self.ranks[r].hb or {}).get("waiting")]
        return min(busy or running, key=lambda r: self.ranks[r].progress_at)

    def _slow(self, running: list[int], now: float) -> Fault | None:
        if not self.r.slow_steps or not running:
            return None
        hb = self.ranks[running[0]].hb or {}
        step = int(hb.get("step", 0))
        local = range(self.base, self.base + len(self.ranks))
        flagged = {r for r in hb.get("slow_ranks") or [] if r in local}
        self.slow_since = {r: self.slow_since.get(r, step) for r in flagged}
        for rank, since in sorted(self.slow_since.items()):
            if step - since >= self.r.slow_steps:
                return Fault(
                    "slow",
                    [rank],
                    [self.nodes[rank - self.base]],
                    f"slower than its peers for {step - since} steps (resilience.slow_steps="
                    f"{self.r.slow_steps}; see the straggler lines above)",
                    now,
                    now,
                    self._evidence(),
                )
        return None

    def _note_nan(self, supervisor) -> None:
        events = (self.ranks[0].hb or {}).get("nan_events") or []
        for event in events[self.nan_seen :]:
            supervisor.log(
                "nan", f"attempt {self.attempt}: {event['text']}", step=event["step"],
                kind=event["kind"],
            )  # fmt: skip
        self.nan_seen = len(events)

    # ------------------------------------------------------------------ reports

    def _hang(self, ranks: list[int], detail: str, since: float, now: float, limit: float) -> Fault:
        return Fault(
            "hung",
            [self.base + r for r in ranks],
            [self.nodes[r] for r in ranks],
            detail,
            since,
            now,
            self._evidence(limit_s=limit),
        )

    def _evidence(self, **more: Any) -> dict[str, Any]:
        now = time.time()
        ranks = {}
        for r, s in enumerate(self.ranks):
            hb = s.hb or {}
            ranks[str(self.base + r)] = {
                "exit": s.exit,
                "heartbeat_age_s": round(now - s.seen_at, 3) if s.hb else None,
                "progress_age_s": round(now - s.progress_at, 3),
                "step": hb.get("step"),
                "step_p99_s": hb.get("step_p99_s"),
                "phase": hb.get("phase"),
                "waiting": hb.get("waiting"),
                "in_flight": hb.get("in_flight"),
                "last_collective": hb.get("collective"),
            }
        coords = {str(self.base + r): (s.hb or {}).get("coords") for r, s in enumerate(self.ranks)}
        return {"ranks": ranks, "coords": coords, **more}

    def _marks(self, rank: int) -> dict[str, float]:
        return (self.ranks[rank].hb or {}).get("marks") or {}

    def _all_marked(self, mark: str) -> bool:
        return all(mark in self._marks(r) for r in range(len(self.ranks)))

    def _log_start(self, breakdown: dict[str, float] | None, supervisor) -> None:
        """The (re)start's phases: the slowest rank's time to each start-up mark."""
        n = range(len(self.ranks))
        event, text, fields = start_record(
            self.attempt,
            [self._marks(r) for r in n],
            [(self.ranks[r].hb or {}).get("process_start") for r in n],
            self.launched,
            breakdown,
        )
        restored = [(self.ranks[r].hb or {}).get("restore") for r in n]  # train/snapshot.py
        text, fields = with_restore(text, fields, restored, self.base)
        supervisor.log(event, text, attempt=self.attempt, **fields)

    def forensics(self, fault: Fault, directory: Path) -> None:
        """Python stacks of every live worker (faulthandler, on SIGUSR1) and the fault's evidence,
        before the group is stopped. A stopped (SIGSTOP) process cannot answer: its last
        heartbeat, with the operation it had in flight, is the record."""
        directory.mkdir(parents=True, exist_ok=True)
        if fault.kind in ("hung", "slow"):
            for rank, pid in self.context.pids().items():
                if self.ranks[rank].exit is None:
                    _signal(pid, signal.SIGUSR1)
            time.sleep(0.3)
        heartbeats = {str(self.base + r): s.hb for r, s in enumerate(self.ranks)}
        record = {
            "fault": asdict(fault),
            "heartbeats": heartbeats,
            "stacks": str(directory / "stacks"),
        }
        (directory / "forensics.json").write_text(json.dumps(record, indent=1, default=str))

    def stop_group(self) -> None:
        """SIGKILL every worker's process group: a hung gloo collective cannot be aborted."""
        self.context.close(death_sig=signal.SIGKILL)

    def _pid(self, rank: int) -> int:
        return self.context.pids()[rank]


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _process_state(pid: int) -> str:
    """The kernel's word for the process: 'T (stopped)' for a SIGSTOPped one."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "unknown"
    names = {"R": "running", "S": "sleeping", "D": "disk wait", "T": "stopped", "Z": "zombie"}
    return f"{state} ({names.get(state, '?')})"
