"""Run a test body in N real processes on gloo, with the environment torchrun gives its workers.

Starting processes and joining a process group costs seconds, so a `DistPool` of N workers is started
once and then runs many test bodies: `pool.run(fn, *args)` executes the module-level function
`fn(*args)` on every rank and returns the per-rank results. An exception on any rank fails the call
with that rank's traceback; a hang (a rank stuck in a collective) hits the timeout, and the pool is
then restarted so later tests start clean.
"""

from __future__ import annotations

import os
import socket
import traceback
from typing import Any

import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 180.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, tasks, results) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    from depthscale.parallel.mesh import destroy_distributed, init_distributed

    init_distributed("cpu")
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, True, fn(*args)))
        except BaseException:  # report, keep serving: the parent decides whether to restart
            results.put((rank, False, traceback.format_exc()))
    destroy_distributed()


class DistPool:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.tasks = [ctx.Queue() for _ in range(self.world_size)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.world_size, port, self.tasks[r], self.results),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, *args: Any, timeout: float = DEFAULT_TIMEOUT_S) -> list[Any]:
        """fn(*args) on every rank; returns results ordered by rank."""
        for q in self.tasks:
            q.put((fn, args))
        out: dict[int, Any] = {}
        errors: list[str] = []
        try:
            for _ in range(self.world_size):
                rank, ok, value = self.results.get(timeout=timeout)
                if ok:
                    out[rank] = value
                else:
                    errors.append(f"--- rank {rank} ---\n{value}")
                    break  # peers may now be stuck in a collective: restart below
        except Exception:
            errors.append(
                f"timed out after {timeout:.0f} s waiting for ranks {sorted(set(range(self.world_size)) - set(out))}"
            )
        if errors:
            self.restart()
            raise AssertionError(
                f"{fn.__qualname__} failed on {self.world_size} ranks:\n" + "\n".join(errors)
            )
        return [out[r] for r in range(self.world_size)]

    def restart(self) -> None:
        self.close(graceful=False)
        self._start()

    def close(self, graceful: bool = True) -> None:
        if graceful:
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=30)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()
