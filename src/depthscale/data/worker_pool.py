"""Worker processes that know which job each one holds, so a dead one is named at once.

`multiprocessing.Pool` never hears of a worker killed from outside (the out-of-memory killer's
SIGKILL): `imap_unordered` waits for the lost job forever, silent at 0 % CPU. Here each worker
has a pipe of its own, the parent hands out one job at a time and remembers who holds it, and
waits on the pipes and on every worker's sentinel together: a worker that ends is a `WorkerDied`
naming its pid, the signal or exit code it ended with, and what it was doing, within
milliseconds. The other workers are then stopped (`__exit__`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.connection import Connection, wait
from typing import Any

from depthscale.errors import DepthscaleError

_STOP_S = 5.0
"""How long a stopped worker gets to end after SIGTERM before SIGKILL."""


class WorkerDied(DepthscaleError, RuntimeError):
    """A worker process ended without finishing its job (killed, or crashed in native code)."""


def _serve(conn: Connection) -> None:
    """A worker's loop: (fn, job) in, ("ok", fn(job)) or ("error", exception) out, until None (or
    until the parent is gone)."""
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        fn, job = task
        try:
            answer = ("ok", fn(job))
        except Exception as err:  # the parent raises it, as Pool does
            answer = ("error", err)
        try:
            conn.send(answer)
        except Exception as err:  # an answer that does not pickle
            conn.send(("error", RuntimeError(f"{answer[1]!r} (unpicklable: {err})")))


class WorkerPool:
    """`processes` workers of a multiprocessing context, started with SIGINT ignored (Ctrl-C is
    the parent's: it stops them)."""

    def __init__(self, ctx, processes: int) -> None:
        self.workers: list[tuple[Any, Connection]] = []
        with _sigint_ignored():  # an ignored signal stays ignored in the child from its start
            for _ in range(processes):
                parent, child = ctx.Pipe()
                process = ctx.Process(target=_serve, args=(child,), daemon=True)
                process.start()
                child.close()
                self.workers.append((process, parent))

    def map_unordered(
        self, fn: Callable[[Any], Any], jobs: Iterable[Any], describe: Callable[[Any], str]
    ) -> Iterator[Any]:
        """`fn(job)` of every job (`fn` importable: it is sent by name), as each finishes; a
        job's exception is raised here, and a worker that ends (whether it held a job or not)
        is a `WorkerDied`, whose message says what it was doing: `describe(job)`."""
        pending, holding = list(jobs), {}
        idle = list(range(len(self.workers)))
        while pending or holding:
            while idle and pending:
                w = idle.pop()
                holding[w] = pending.pop(0)
                self.workers[w][1].send((fn, holding[w]))
            pipes = {self.workers[w][1]: w for w in holding}
            sentinels = {p.sentinel: w for w, (p, _) in enumerate(self.workers)}
            ready = wait([*pipes, *sentinels])
            for pipe in (r for r in ready if r in pipes):
                w = pipes[pipe]
                try:
                    status, value = pipe.recv()
                except EOFError:  # it died
                    raise WorkerDied(self._death(w, holding.get(w), describe)) from None
                del holding[w]
                idle.append(w)
                if status == "error":
                    raise value
                yield value
            for w in {sentinels[r] for r in ready if r in sentinels}:
                if w in holding and self.workers[w][1].poll():
                    continue  # its answer (or the end of its pipe) is read on the next round
                raise WorkerDied(self._death(w, holding.get(w), describe))

    def _death(self, w: int, job: Any, describe: Callable[[Any], str]) -> str:
        process = self.workers[w][0]
        process.join(1.0)
        code = process.exitcode
        if code is not None and code < 0:
            name = signal.Signals(-code).name
            how = f"was killed by {name}"
            if -code == signal.SIGKILL:
                how += " (what the out-of-memory killer sends)"
        else:
            how = f"exited with code {code}"
        doing = f"while {describe(job)}" if job is not None else "between jobs"
        return f"worker pid {process.pid} {how} {doing}"

    def close(self) -> None:
        """Stop the workers: asked to end if idle, else SIGTERM, then SIGKILL after `_STOP_S`."""
        for _, pipe in self.workers:
            with contextlib.suppress(OSError):  # a worker already gone
                pipe.send(None)
        for process, _ in self.workers:
            process.join(0.5)
            if process.is_alive():
                process.terminate()
                process.join(_STOP_S)
            if process.is_alive():
                process.kill()
                process.join()
        for _, pipe in self.workers:
            pipe.close()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:  # a failure or Ctrl-C: do not wait for the jobs they hold
            for process, _ in self.workers:
                if process.is_alive():
                    process.terminate()
        self.close()


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """SIGINT ignored while workers start (a handler can only be set on the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


__all__ = ["WorkerDied", "WorkerPool"]
