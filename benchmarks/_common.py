"""Shared helpers for benchmark scripts: device description, interleaved timing, peak RSS, and
spawning one process per rank."""

from __future__ import annotations

import platform
import socket
import statistics
import time
import weakref
from collections.abc import Callable
from queue import Empty

import torch


def device_info() -> dict:
    if torch.cuda.is_available():
        return {
            "device": torch.cuda.get_device_name(),
            "cuda": torch.version.cuda,
            "torch": torch.__version__,
        }
    return {
        "device": f"cpu ({platform.processor() or platform.machine()})",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def print_result(result: dict, out: str | None) -> None:
    """Print a benchmark's JSON object, and write it to `out` when given."""
    import json
    from pathlib import Path

    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def interleaved_times(
    fns: dict[str, Callable[[], None]], rounds: int, warmup: int = 2
) -> dict[str, float]:
    """Median seconds per call of each fn, measured in alternating rounds so drift hits all equally."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(s) for name, s in samples.items()}


class SentBuffers:
    """Peak bytes of tensors handed to `torch.distributed.isend` and still alive, observed from
    outside the library (`install` wraps `isend`), so that any revision of depthscale — whatever
    its own counters — is measured the same way. The set only grows at a send, so the peak is
    sampled exactly there. Covers `batch_isend_irecv` too (it calls `isend` per send)."""

    def __init__(self) -> None:
        self._live: list[tuple[weakref.ref, int]] = []
        self.peak = 0

    def install(self) -> SentBuffers:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        real = c10d.isend

        def isend(tensor, *args, **kwargs):
            self._live = [(ref, n) for ref, n in self._live if ref() is not None]
            self._live.append((weakref.ref(tensor), tensor.numel() * tensor.element_size()))
            self.peak = max(self.peak, sum(n for _, n in self._live))
            return real(tensor, *args, **kwargs)

        # batch_isend_irecv and P2POp compare ops with c10d.isend: patch both names alike
        dist.isend = c10d.isend = isend
        return self

    def reset(self) -> None:
        self._live, self.peak = [], 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def peak_rss_delta(fn: Callable[[], object]) -> int | None:
    """Bytes the peak RSS rose above the current RSS while running fn (None off Linux)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
    except OSError:
        return None
    before = _rss_kib("VmRSS")
    fn()
    return (_rss_kib("VmHWM") - before) * 1024


def run_ranks(target: Callable, world: int, *args: object) -> list[dict]:
    """Spawn `world` processes running target(rank, *args, port, queue); each puts one dict with a
    "rank" key on the queue. Returns them in rank order; a worker that dies fails the run at once
    (its traceback is on stderr) instead of leaving the others waiting."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, *args, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results: list[dict] = []
    while len(results) < world:
        try:
            results.append(queue.get(timeout=5))
        except Empty:
            if any(p.exitcode for p in procs):
                for p in procs:
                    p.kill()
                raise RuntimeError(f"a worker of {target.__name__} failed (see above)") from None
    for p in procs:
        p.join()
    return sorted(results, key=lambda r: r["rank"])
