"""Run a test body in N real processes on gloo, with the environment torchrun gives its workers.

Starting processes and joining a process group costs seconds, so a `DistPool` of N workers is started
once and then runs many test bodies: `pool.run(fn, *args)` executes the module-level function
`fn(*args)` on every rank and returns the per-rank results. An exception on any rank fails the call
with that rank's traceback; a hang (a rank stuck in a collective) hits the timeout, and the pool is
then restarted so later tests start clean.

Timeout: it only has to tell a hang from slow progress. A test body takes seconds on an idle 2-core
box, but the first call also waits for N spawned processes to import torch and join the group, and
under load (4 workers × OMP threads on 2 busy cores, a parallel CI job) one call took over 180 s.
Hence 900 s by default; $DEPTHSCALE_DIST_TIMEOUT_S overrides it.

Threads: each worker uses $OMP_NUM_THREADS intra-op threads when that is set (a stress run varies
it), otherwise 1 (N workers share 2 cores).

Start: workers are forked from multiprocessing's fork server, which imports torch and the modules
the test bodies share once (`PRELOAD`), instead of spawned: a spawned worker imported them itself,
~3 CPU-seconds each, 17 workers a session (pools of 2, 3, 4 and 8) on 2 cores. The fork server is a
fresh interpreter that starts no thread (forking it is safe, unlike forking pytest), and each worker
takes the environment its pool's starter has at that moment, as a spawned one did.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from typing import Any

import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = float(os.environ.get("DEPTHSCALE_DIST_TIMEOUT_S", "900"))
PRELOAD = [
    "torch",
    "torch.distributed.tensor",
    "depthscale.parallel.mesh",
    "depthscale.model.transformer",
    "depthscale.parallel.parallelize",
]
"""Imported by the fork server before it forks any worker (one that fails to import is left to the
worker that needs it)."""


def _worker_threads() -> int:
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(env) if env.isdigit() and int(env) > 0 else 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, tasks, results, environ: dict) -> None:
    os.environ.clear()  # the starter's environment, not the fork server's (made by an earlier pool)
    os.environ.update(environ)
    threads = _worker_threads()
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS=str(threads),
    )
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hang's stacks, on demand
    import torch

    torch.set_num_threads(threads)
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


def small_config(residual: str, dims_kw: dict, batch: int = 4, seq: int = 16, vocab: int = 64):
    """A `Config` for the layout tests: 4 layers, d = 32, 4 heads (2 KV), `batch` sequences of
    `seq` tokens per step in one-row micro-batches, AttnRes in 2 blocks, the layout in `dims_kw`
    (ParallelConfig fields)."""
    from depthscale.config import Config

    cfg = Config()
    m = cfg.model
    m.vocab_size, m.dim, m.n_layers, m.n_heads, m.n_kv_heads = vocab, 32, 4, 4, 2
    m.max_seq_len, m.residual, m.attnres_n_blocks = seq, residual, 2
    cfg.train.batch_size, cfg.train.micro_batch_size = batch, 1
    for name, value in dims_kw.items():
        setattr(cfg.parallel, name, value)
    return cfg


_MESHES: dict = {}


def cached_mesh(dims):
    """`dims.build_mesh("cpu")`, once per layout per worker process. Every mesh creates process
    groups, and each gloo group keeps threads alive (and polling) until the process ends: building
    one per test call left ~900 threads per worker and slowed the whole suite several-fold."""
    if dims not in _MESHES:
        import torch.distributed as dist

        _MESHES[dims] = dims.validate(dist.get_world_size()).build_mesh("cpu")
    return _MESHES[dims]


class DistPool:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (the first pool)
        port = _free_port()
        self.tasks = [ctx.Queue() for _ in range(self.world_size)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.world_size, port, self.tasks[r], self.results, dict(os.environ)),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, *args: Any, timeout: float | None = None) -> list[Any]:
        """fn(*args) on every rank; returns results ordered by rank."""
        timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
        for q in self.tasks:
            q.put((fn, args))
        out: dict[int, Any] = {}
        errors: list[str] = []
        deadline = time.monotonic() + timeout
        while len(out) < self.world_size and not errors:
            try:  # poll, so that a worker that died (no result will ever come) fails the call now
                rank, ok, value = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                if dead:
                    codes = {r: self.procs[r].exitcode for r in dead}
                    errors.append(f"worker process(es) died, exit codes by rank: {codes}")
                elif time.monotonic() > deadline:
                    missing = sorted(set(range(self.world_size)) - set(out))
                    errors.append(f"timed out after {timeout:.0f} s waiting for ranks {missing}")
                continue
            if ok:
                out[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
                # peers may now be stuck in a collective: restart below
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
