"""Stopping on SIGINT / SIGTERM at a step boundary (Ctrl-C; what SLURM and torchrun send before they
kill a job).

The handler only records the signal, as Megatron's does: a handler cannot run while the main thread
waits inside a gloo collective, and a collective inside a handler could deadlock. The training loop
reads the flag once per step, folded into the step's existing loss reduction so that every rank
makes the same decision, then saves a checkpoint and exits. A second Ctrl-C in a single process
stops at once (KeyboardInterrupt); under a launcher the workers keep to the clean stop, since the
launcher forwards the terminal's signal a second time and kills them itself after its grace period.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

HANDLED = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """Context manager: while active, SIGINT / SIGTERM set `received` instead of ending the process."""

    def __init__(self, second_sigint_interrupts: bool = True) -> None:
        self.received: signal.Signals | None = None
        self._second_sigint_interrupts = second_sigint_interrupts
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None and signum == signal.SIGINT and self._second_sigint_interrupts:
            raise KeyboardInterrupt
        if self.received is None:
            self.received = signal.Signals(signum)

    def __enter__(self) -> StopSignals:
        # Handlers can only be installed from the main thread (a Trainer driven from another
        # thread, as in some tests, just keeps the process defaults).
        if threading.current_thread() is threading.main_thread():
            for sig in HANDLED:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()


def stopped_line(received: signal.Signals | None, step: int, latest) -> str:
    """What a run stopped by a signal says last: which signal, and where it resumes."""
    name = received.name if received is not None else "a signal on another rank"
    where = (
        f"checkpoint {latest}; run the same command to resume"
        if latest is not None
        else "no checkpoint saved (checkpoint.on_signal=false)"
    )
    return f"depthscale: stopped by {name} after step {step}; {where}"
