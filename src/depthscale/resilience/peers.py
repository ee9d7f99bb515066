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
"""

from __future__ import annotations

import json
import time
from typing import Any


class PeersLost(RuntimeError):
    """Node 0's store (the job's coordination) is unreachable: node 0's supervisor is gone."""


def _guarded(method):
    """Store errors become PeersLost, which the supervisor reports in one line."""

    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except (TimeoutError, PeersLost):
            raise
        except Exception as err:
            raise PeersLost(
                f"node {self.node_rank}: the rendezvous store on node 0 is unreachable ({err}); "
                "node 0's supervisor is gone"
            ) from None

    call.__name__, call.__doc__ = method.__name__, method.__doc__
    return call


class Peers:
    POLL_S = 0.05

    def __init__(self, store, nnodes: int, node_rank: int, timeout_s: float) -> None:
        self.store, self.nnodes, self.node_rank, self.timeout_s = (
            store,
            nnodes,
            node_rank,
            timeout_s,
        )

    @property
    def leader(self) -> bool:
        return self.node_rank == 0

    @_guarded
    def ready(self, attempt: int) -> None:
        """Wait until every node's supervisor is ready for `attempt`."""
        key = f"sup/{attempt}/ready"
        self.store.add(key, 1)
        deadline = time.monotonic() + self.timeout_s
        while self.store.add(key, 0) < self.nnodes:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only {self.store.add(key, 0)} of {self.nnodes} nodes' supervisors were ready "
                    f"for attempt {attempt} within {self.timeout_s:g} s "
                    "(resilience.startup_timeout_s): a node is gone"
                )
            time.sleep(self.POLL_S)

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
            if time.monotonic() > deadline:
                raise TimeoutError(f"node 0's supervisor decided nothing after attempt {attempt}")
            time.sleep(self.POLL_S)
        return json.loads(self.store.get(key))

    @_guarded
    def finish(self) -> None:
        """This node's workers are done. Node 0 keeps the store up until every node is."""
        self.store.add("sup/finished", 1)
        if not self.leader:
            return
        deadline = time.monotonic() + self.timeout_s
        while self.store.add("sup/finished", 0) < self.nnodes and time.monotonic() < deadline:
            time.sleep(self.POLL_S)
