"""What torch.compile is doing in this process, for the heartbeat: how many compilations have ended,
and whether one is under way.

A cold start with `train.compile` compiles every transformer block (and, lazily, its backward)
inside the first step: minutes in which no span ends, so the supervisor could not tell a start
that compiles from one that is stuck. Each compilation's start and end change the heartbeat's
record, and the watch counts a change as start-up progress (`resilience/startup_watch.py`).

The counts come from dynamo's compilation callbacks (`torch._dynamo.callback_handler`, private,
torch 2.11–2.13: pinned by tests/unit/test_startup_watch.py). They are registered from the
heartbeat thread once dynamo has been imported by whoever compiles — this module imports
nothing of torch, so a run that never compiles never loads dynamo.
"""

from __future__ import annotations

import sys
import threading


class CompileCounter:
    """Counts dynamo's compilations (the outermost ones: a nested compile is part of its parent)."""

    def __init__(self) -> None:
        self.started = self.ended = 0
        self.installed = False
        self._lock = threading.Lock()

    def install(self) -> bool:
        """Register the callbacks if dynamo is loaded (by the main thread: never imported here,
        where a half-done import would race it); True once registered."""
        if self.installed:
            return True
        dynamo = sys.modules.get("torch._dynamo")
        handler = getattr(dynamo, "callback_handler", None)
        if handler is None:
            return False
        with self._lock:
            if not self.installed:
                handler.register_start_callback(self._start)
                handler.register_end_callback(self._end)
                self.installed = True
        return True

    def _start(self, *args: object) -> None:  # torch ≥ 2.8 passes CallbackArgs; earlier none
        self.started += 1

    def _end(self, *args: object) -> None:
        self.ended += 1

    def snapshot(self) -> dict[str, int | bool]:
        """{"compiles": compilations ended, "compiling": one under way}: the heartbeat's fields."""
        return {"compiles": self.ended, "compiling": self.started > self.ended}


COMPILES = CompileCounter()
"""This process's counter (dynamo's callbacks are per process too)."""
