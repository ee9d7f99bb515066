"""The supervisors of a multi-node job, one per node, agreeing through the rendezvous store.

Node 0's supervisor hosts the store (the workers' rendezvous store too); every other node's
supervisor is a client of it. Per attempt A they agree on three things, each a store key:

- `sup/A/ready` — a counter: an attempt starts only when every node's supervisor has stopped its
  previous group and is ready, so no old worker meets a new one;
- `sup/A/fault` — the first fault any node saw (compare-and-set: the first writer wins); every
  other node reads it, stops its own workers and reports the same fault;
- `sup/A/decision` — written by node 0, which sees global rank 0 (checkpoint progress, the
  diagnostics): restart, or give up with the reason.

A node's supervisor only watches its own workers; a hang elsewhere shows here as local ranks all
waiting, and the node hosting the culprit names it (`Watch`, `local culprit only`).

A node that is gone — power lost, cut off, its supervisor killed — is found by `Pulse`, within
`resilience.node_lost_s`, not at the next start-up limit: every supervisor beats in node 0's store
and node 0 watches the beats; the other nodes watch node 0 through their connection to the store
it hosts. The job cannot go on without a node (its ranks, or the store), so the survivors give up
at once, naming it, for the scheduler to requeue the job.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Lost:
    """A node found gone: which, how it was found, since when (wall time) and the inputs."""

    node: int
    how: str
    since: float
    detected_at: float
    evidence: dict[str, Any] = field(default_factory=dict)


class PeersLost(RuntimeError):
    """Another node's supervisor is gone (its node lost power or its network, or the supervisor
    was killed): this node cannot go on with the job. `lost` says which node and how it was found
    (None when only the coordination itself failed)."""

    def __init__(self, message: str, lost: Lost | None = None) -> None:
        super().__init__(message)
        self.lost = lost


def _within(seconds: float, call: Callable[[], Any]) -> BaseException | None:
    """Run `call` on a thread of its own; its error, or a TimeoutError when it has not returned
    within `seconds` (it is left waiting: torch's store client cannot be interrupted)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except Exception as err:  # noqa: BLE001 — handed to the caller
            outcome.append(err)

    thread = threading.Thread(target=run, name="depthscale-pulse-call", daemon=True)
    thread.start()
    thread.join(seconds)
    if not outcome:
        return TimeoutError(f"no answer within {seconds:g} s")
    return outcome[0]


def _guarded(method):
    """Store errors, and a node the pulse found gone, become PeersLost, which the supervisor
    reports in one line. Checked before each call: once node 0 is known gone, a store call would
    only fail inside torch, which prints a C++ stack for it."""

    def call(self, *args, **kwargs):
        self.raise_if_store_gone()
        try:
            return method(self, *args, **kwargs)
        except (TimeoutError, PeersLost):
            raise
        except Exception as err:
            self.raise_if_store_gone()
            lost = self.pulse.store_failed(err)
            self.pulse.took.set()
            raise PeersLost(self.describe(lost), lost) from None

    call.__name__, call.__doc__ = method.__name__, method.__doc__
    return call


class Peers:
    POLL_S = 0.05

    def __init__(
        self,
        store,
        nnodes: int,
        node_rank: int,
        timeout_s: float,
        pulse: Pulse,
        me: dict[str, Any],
    ) -> None:
        """`pulse`: this node's beat (started); `me`: what the other nodes name this one by
        (node id, host), published for their messages."""
        self.store, self.nnodes, self.node_rank, self.timeout_s = (
            store,
            nnodes,
            node_rank,
            timeout_s,
        )
        self.pulse = pulse
        self.names: dict[int, dict[str, Any]] = {node_rank: me}
        self._publish(me)

    @property
    def leader(self) -> bool:
        return self.node_rank == 0

    @_guarded
    def _publish(self, me: dict[str, Any]) -> None:
        self.store.set(f"sup/node/{self.node_rank}", json.dumps(me))

    def raise_if_lost(self) -> None:
        """Raise PeersLost once the pulse found a node gone (waits for the others call this)."""
        lost = self.pulse.check()
        if lost is not None:
            self.pulse.took.set()
            raise PeersLost(self.describe(lost), lost)

    def raise_if_store_gone(self) -> None:
        """Raise PeersLost once node 0, and the store it hosts, is found gone (on node 0 itself,
        another node gone leaves the store working: its fault and decision still go through)."""
        lost = self.pulse.check()
        if lost is not None and lost.node == 0 and not self.leader:
            self.pulse.took.set()
            raise PeersLost(self.describe(lost), lost)

    def describe(self, lost: Lost) -> str:
        return f"{self.name(lost.node)}: {lost.how}"

    def name(self, node: int) -> str:
        """'node 1 (gpu17)', or 'node 1 (n1 on host gpu17)' where the node id is not the host
        name, as far as this node learnt it (nothing more once node 0's store is gone)."""
        known = self.names.get(node) or {}
        node_id, host = known.get("node"), known.get("host")
        if not node_id:
            return f"node {node}"
        return f"node {node} ({node_id}" + (
            f" on host {host})" if host and host != node_id else ")"
        )

    @_guarded
    def ready(self, attempt: int) -> None:
        """Wait until every node's supervisor is ready for `attempt`."""
        key = f"sup/{attempt}/ready"
        self.store.add(key, 1)
        deadline = time.monotonic() + self.timeout_s
        while self.store.add(key, 0) < self.nnodes:
            self.raise_if_lost()
            if time.monotonic() > deadline:
                missing = [k for k in range(self.nnodes) if not self._beating(k)]
                raise TimeoutError(
                    f"only {self.store.add(key, 0)} of {self.nnodes} nodes' supervisors were ready "
                    f"for attempt {attempt} within {self.timeout_s:g} s "
                    "(resilience.startup_timeout_s): "
                    + (
                        f"{', '.join(self.name(k) for k in missing)} never joined the job"
                        if missing
                        else "a node is gone"
                    )
                )
            time.sleep(self.POLL_S)
        self._learn_names()

    def _beating(self, node: int) -> bool:
        return bool(self.store.check([f"sup/alive/{node}"]))

    def _learn_names(self) -> None:
        """Every node's name, once all have joined: read now, while node 0's store is up."""
        for k in range(self.nnodes):
            if k not in self.names and self.store.check([f"sup/node/{k}"]):
                self.names[k] = json.loads(self.store.get(f"sup/node/{k}"))

    @_guarded
    def report_fault(self, attempt: int, fault: dict[str, Any]) -> dict[str, Any]:
        """Publish this node's fault unless another node's came first; returns the one that won."""
        key = f"sup/{attempt}/fault"
        mine = json.dumps({**fault, "node_rank": self.node_rank}, default=str)
        won = self.store.compare_set(key, "", mine)
        return json.loads(won)

    @_guarded
    def fault(self, attempt: int) -> dict[str, Any] | None:
        key = f"sup/{attempt}/fault"
        if not self.store.check([key]):
            return None
        return json.loads(self.store.get(key))

    @_guarded
    def decide(self, attempt: int, decision: dict[str, Any]) -> dict[str, Any]:
        """Node 0 decides what follows attempt `attempt`; the others wait for it."""
        key = f"sup/{attempt}/decision"
        if self.leader:
            self.store.set(key, json.dumps(decision, default=str))
            return decision
        deadline = time.monotonic() + self.timeout_s
        while not self.store.check([key]):
            self.raise_if_lost()
            if time.monotonic() > deadline:
                raise TimeoutError(f"node 0's supervisor decided nothing after attempt {attempt}")
            time.sleep(self.POLL_S)
        return json.loads(self.store.get(key))

    def close(self, why: str, wait: bool) -> None:
        """This node's supervisor leaves the job (`why`: finished, gave up, ...), saying so first,
        so that node 0 does not take its silence for a lost node. Node 0 hosts the store: with
        `wait` (the job finished, or node 0 decided to give up, so every node leaves) it keeps
        the store up until every other node has left or is gone, up to the start-up limit, so
        none of them finds the store gone instead of the decision."""
        if self.pulse.check() is not None and not self.leader:
            self.pulse.stop()  # node 0 is gone: nothing to tell, nobody to wait for
            return
        if not self.leader:
            self.pulse.stop()  # no beat may meet the store node 0 closes once all have left
        with contextlib.suppress(Exception):  # leaving must not fail the exit it is part of
            self._leave(why)
            if self.leader and wait:
                self._wait_for_the_others()
        self.pulse.stop()

    @_guarded
    def _leave(self, why: str) -> None:
        self.store.set(f"sup/left/{self.node_rank}", why)

    def _wait_for_the_others(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        others = {k for k in range(1, self.nnodes) if self._beating(k)}  # not one that never came
        while others and time.monotonic() < deadline:
            others -= {k for k in others if self.store.check([f"sup/left/{k}"])}
            others -= self.pulse.gone
            time.sleep(self.POLL_S)


class _Sentinel:
    """An idle TCP connection from a node other than node 0 to the store node 0's supervisor
    hosts. The kernel reports the end of that process on it at once (the connection closes), and
    a host that stops answering within `limit_s` (keep-alive probes) — read in Python: a store
    call failing inside torch prints a C++ stack. The store never writes to it."""

    def __init__(self, host: str, port: int, limit_s: float) -> None:
        self.sock = socket.create_connection((host, port), timeout=limit_s)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        every = max(1, int(limit_s / 3))  # idle, then two unanswered probes: ~limit_s
        for name, value in (("TCP_KEEPIDLE", every), ("TCP_KEEPINTVL", every), ("TCP_KEEPCNT", 2)):
            if hasattr(socket, name):
                self.sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)

    def broken(self) -> str | None:
        """How the connection ended, or None while it stands."""
        readable, _, _ = select.select([self.sock], [], [], 0)
        if not readable:
            return None
        try:
            data = self.sock.recv(1, socket.MSG_PEEK)
        except OSError as err:
            return err.strerror or str(err)
        return None if data else "closed"

    def close(self) -> None:
        self.sock.close()


class Pulse:
    """This supervisor's beat in node 0's store, from a thread of its own (the main thread waits
    in saves, launches and decisions). Node 0 watches every other node's beat: one silent for
    `limit_s` is gone, unless it said it left. The other nodes watch node 0: its store closing
    their connection (its process ended) is conclusive at once; a host that stops answering
    (powered off, cut off: its keep-alive probes fail) or a frozen node 0 (its beat unanswered:
    torch's store calls have no timeout of their own, so each beat is waited for `limit_s` on a
    thread of its own) after `limit_s`.

    A main thread waiting inside a store call to a node 0 that answers nothing never returns to
    read the verdict: `abandon` (set by the supervisor) then acts from this thread, `GRACE_S`
    after the verdict, unless the main thread `took` it."""

    GRACE_S = 1.0

    def __init__(
        self, host: str, port: int, nnodes: int, node_rank: int, period: float, limit_s: float
    ) -> None:
        import torch.distributed as dist

        self.address, self.nnodes, self.node_rank = f"{host}:{port}", nnodes, node_rank
        self.period, self.limit_s = period, limit_s
        timeout = datetime.timedelta(seconds=limit_s)
        self.client = dist.TCPStore(
            host, port, is_master=False, wait_for_workers=False, timeout=timeout
        )
        self.sentinel = _Sentinel(host, port, limit_s) if node_rank else None
        self.lost: Lost | None = None
        self.gone: set[int] = set()
        """Nodes node 0 found gone (a verdict is kept for the first; the others are skipped)."""
        self.left: set[int] = set()
        self.abandon: Callable[[Lost], None] | None = None
        self.took = threading.Event()
        """Set by the main thread once it acts on the verdict itself."""
        self._seen: dict[int, tuple[int, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="depthscale-pulse", daemon=True)
        self._thread.start()

    def check(self) -> Lost | None:
        """The verdict, if any; on the caller's thread too (the sentinel is read in a syscall)."""
        if self.lost is None and self.sentinel is not None and not self._stop.is_set():
            broken = self.sentinel.broken()
            if broken is not None:
                self._found(0, self._node0_ended(broken), time.time())
        return self.lost

    def store_failed(self, err: BaseException) -> Lost:
        """A store call of the main thread failed: on another node, node 0 is gone (its store);
        on node 0, its own store failed."""
        return self.check() or self._found(
            0,
            f"the rendezvous store it hosts at {self.address} failed a call "
            f"({str(err).splitlines()[0][:200]}): its supervisor or its host is gone",
            time.time(),
        )

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self.limit_s + self.GRACE_S + 1)
        if self.sentinel is not None:
            self.sentinel.close()

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while not self._stop.is_set() and self.check() is None:
            began = time.time()
            failed = self._beat()
            if failed is not None:
                if not self._stop.is_set() and self.check() is None:
                    self._found(0, self._node0_silent(failed, time.time() - began), began)
                break
            self._stop.wait(self.period)
        lost = self.lost
        blocked = lost is not None and lost.node == 0 and self.node_rank and self.abandon
        if blocked and not self.took.wait(self.GRACE_S) and not self._stop.is_set():
            self.abandon(lost)

    def _beat(self) -> BaseException | None:
        """One beat (node 0: and a look at the others'); the store's failure, if any."""
        key = f"sup/alive/{self.node_rank}"
        if self.node_rank == 0:  # its own store, in this process: it answers while we run
            try:
                self.client.add(key, 1)
                self._watch_the_others(time.monotonic())
            except Exception as err:  # noqa: BLE001
                return err
            return None
        return _within(self.limit_s, lambda: self.client.add(key, 1))

    def _watch_the_others(self, now: float) -> None:
        for node in range(1, self.nnodes):
            if node in self.left or node in self.gone:
                continue
            count = self.client.add(f"sup/alive/{node}", 0)
            if count == 0:  # not started yet: the start-up limit covers a node that never comes
                continue
            last = self._seen.get(node)
            if last is None or last[0] != count:
                self._seen[node] = (count, now)
                continue
            silent = now - last[1]
            if silent <= self.limit_s:
                continue
            if self.client.check([f"sup/left/{node}"]):
                self.left.add(node)
                continue
            self.gone.add(node)
            self._found(
                node,
                f"its supervisor has not beaten in node 0's store for {silent:.1f} s (limit "
                f"resilience.node_lost_s={self.limit_s:g}; it beats every {self.period:g} s): the "
                "node lost power or its network, or its supervisor was killed",
                time.time() - silent,
                silent_s=round(silent, 3),
            )

    def _found(self, node: int, how: str, since: float, **evidence: Any) -> Lost:
        if self.lost is None:
            self.lost = Lost(
                node, how, since, time.time(), {"limit_s": self.limit_s, "how": how, **evidence}
            )
        return self.lost

    def _node0_ended(self, broken: str) -> str:
        if broken == "closed":
            return (
                f"the rendezvous store its supervisor hosts at {self.address} closed this node's "
                "connection: node 0's supervisor is gone, and the job's coordination with it"
            )
        return (
            f"this node's connection to the rendezvous store it hosts at {self.address} failed "
            f"({broken}): its host is down or cut off"
        )

    def _node0_silent(self, err: BaseException, waited: float) -> str:
        first = str(err).splitlines()[0][:200]
        if waited < self.limit_s / 2:  # refused or reset: nothing listens there any more
            return (
                f"the rendezvous store its supervisor hosts at {self.address} refused this node's "
                f"beat ({first}): node 0's supervisor is gone, and the job's coordination with it"
            )
        why = "" if isinstance(err, TimeoutError) else f"; {first}"
        return (
            f"the rendezvous store it hosts at {self.address} did not answer this node's beat "
            f"for {waited:.1f} s (limit resilience.node_lost_s={self.limit_s:g}{why}): its host "
            "is down, cut off or frozen"
        )
