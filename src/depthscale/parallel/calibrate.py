"""Measure this machine as `depthscale plan` describes a cluster, so its time model can be checked
against real runs here (`depthscale plan --calibrate OUT.json --nproc N`).

Each rank of an N-process job runs with usable CPUs // N threads (what `depthscale train` gives
its workers: `parallel/host_cpus.py`), all N at once, so the rates are what a rank gets beside the
others (with more ranks than cores they share the cores), and each rate is the slowest rank's: a
synchronous step waits for it. Shapes are timed in interleaved rounds, so a burst of load hits all
alike, and each sample spans several scheduler time slices, so ranks that share a core read their
share. Measured:
GEMM FLOP/s by the smallest dimension (a curve of fractions of the best), fused causal
attention's fraction of that peak, elementwise memory bandwidth, and gloo collective and P2P
latency and bandwidth per group size — each call timed between bursts of compute, as a step makes
it, not right after a barrier.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from depthscale.parallel.host_cpus import threads_per_rank
from depthscale.shape.model import ELEMENTWISE_PASSES

GEMM_SIDES = (32, 64, 128, 256, 512, 1024)
"""Smallest dimensions measured: [4096 or 8·x] × [x] GEMMs against a wide third dimension, the
shapes of a layer's projections."""


def fit_link(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """(bytes/s, latency s) of time = latency + bytes / bandwidth through a small and the
    largest sample: a small call is nearly all latency, the large one nearly all bandwidth, and
    two medians resist the outliers a shared machine produces better than a least-squares line.
    The small one is the quicker of the two smallest: noise only adds time."""
    ordered = sorted(samples)
    (b0, t0), (b1, t1) = min(ordered[:2], key=lambda s: s[1]), ordered[-1]
    if t1 <= t0:  # the small call was the slow one (the machine was busy): bound, don't fit
        return b1 / t1, min(t for _, t in samples)
    bw = (b1 - b0) / (t1 - t0)
    return bw, max(0.0, t0 - b0 / bw)


def _interleaved_medians(
    fns: dict[str, Callable[[], object]],
    budget_s: float,
    window_s: float = 0.0,
    rounds: int = 5,
) -> dict[str, float]:
    """Median seconds of one call of each fn, timed in rounds that run every fn once, for at
    least `rounds` rounds and `budget_s` per fn.
    Medians: under a full machine the best run would be one that found a core free, not the rate
    a job gets. Rounds: a shared machine slows down in bursts; timed one after the other, a burst
    lands on one shape and bends the curve, timed in rounds it hits every shape alike.

    `window_s` > 0 times each sample as back-to-back calls lasting at least that long (the count
    is set by the warm-up call): with more processes than cores, a call shorter than the
    scheduler's time slice mostly runs unpreempted and reads a whole core's speed, while a job's
    ranks get a share of one."""
    reps: dict[str, int] = {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        fn()
        first = max(time.perf_counter() - t0, 1e-6)
        reps[name] = max(1, math.ceil(window_s / first)) if window_s > 0 else 1
    samples: dict[str, list[float]] = {name: [] for name in fns}
    start = time.perf_counter()
    done = 0
    while done < rounds or time.perf_counter() - start < budget_s * len(fns):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(reps[name]):
                fn()
            samples[name].append((time.perf_counter() - t0) / reps[name])
        done += 1
    return {name: statistics.median(t) for name, t in samples.items()}


WINDOW_S = 0.05
"""Shortest sample of a local measurement: several of Linux's time slices, so that ranks sharing
a core each read their share of it."""


def _local(budget_s: float, window_s: float = WINDOW_S) -> dict:
    work: dict[str, float] = {}
    fns: dict[str, Callable[[], object]] = {}
    for x in GEMM_SIDES:
        wide = max(1024, 4 * x)
        a, b = torch.randn(wide, x), torch.randn(x, wide)
        work[f"gemm{x}"], fns[f"gemm{x}"] = 2 * wide * wide * x, lambda a=a, b=b: a @ b
    q = torch.randn(2, 4, 512, 64)
    work["attention"] = 0.5 * 4 * 2 * 4 * 512 * 512 * 64
    fns["attention"] = lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True)
    work["elementwise"], fns["elementwise"] = _elementwise_pass()
    seconds = _interleaved_medians(fns, budget_s, window_s=window_s)
    rate = {name: work[name] / seconds[name] for name in fns}
    samples = [(float(x), rate[f"gemm{x}"]) for x in GEMM_SIDES]
    peak = max(r for _, r in samples)
    return {
        "peak": peak,
        "curve": [(x, r / peak) for x, r in samples],
        "attention_efficiency": min(1.0, rate["attention"] / peak),
        "memory_bw": rate["elementwise"],
        "gemm_samples": samples,
    }


def _elementwise_pass(tokens: int = 8192, dim: int = 256) -> tuple[float, Callable[[], None]]:
    """(bytes, fn) of the memory-bound work of a training step as the planner charges it: an
    RMSNorm and a SiLU-gated product, forward and backward, against ELEMENTWISE_PASSES × (1 + 2)
    times the bytes they keep for backward (fp32: the norm's input, rsqrt, x̂ and output; the
    gate's input and silu)."""
    x = torch.randn(tokens, dim, requires_grad=True)
    weight = torch.ones(dim, requires_grad=True)

    def step() -> None:
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight
        (F.silu(h) * h).sum().backward()

    kept = tokens * (4 * dim + 4 + 4 * dim + 4 * dim + 4 * dim)
    return ELEMENTWISE_PASSES * 3 * kept, step


def _slowest(results: list[dict]) -> dict:
    """Each rate from the rank that measured it lowest: a synchronous step waits for its slowest
    rank at every collective, and on a shared machine which rank that is varies by core."""
    gemm = [
        (x, min(r["gemm_samples"][i][1] for r in results))
        for i, (x, _) in enumerate(results[0]["gemm_samples"])
    ]
    peak = max(r for _, r in gemm)
    return {
        "peak": peak,
        "curve": [(x, r / peak) for x, r in gemm],
        "attention_efficiency": min(r["attention_efficiency"] * r["peak"] / peak for r in results),
        "memory_bw": min(r["memory_bw"] for r in results),
        "gemm_samples": gemm,
    }


def _local_worker(rank: int, threads: int, budget_s: float, sync, queue) -> None:
    """`_local` beside the other ranks: all start together, and each keeps a core busy until the
    last has finished, so no rank measures with the machine to itself."""
    start, finished = sync
    torch.set_num_threads(threads)
    a = torch.randn(256, 256)
    start.wait(timeout=300)
    result = _local(budget_s)
    with finished.get_lock():
        finished.value += 1
    deadline = time.monotonic() + 300  # a rank that died leaves the parent to stop us
    while finished.value < start.parties and time.monotonic() < deadline:
        a @ a
    queue.put((rank, result))


def _concurrent_local(nproc: int, threads: int, budget_s: float) -> dict:
    """`_local` in `nproc` processes at once (ranks of a job share caches, memory bandwidth and
    clocks); each rate from the slowest rank."""
    if nproc == 1:
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return _local(budget_s)
        finally:
            torch.set_num_threads(previous)
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    sync = (ctx.Barrier(nproc), ctx.Value("i", 0))
    results = dict(_spawn(_local_worker, nproc, (threads, budget_s, sync), nproc, 600))
    return _slowest([results[r] for r in range(nproc)])


def _ignoring_interrupts(target: Callable[..., None], *args: object) -> None:
    """A worker's body: Ctrl-C reaches the terminal's whole process group, and the parent alone
    reports it and stops the workers (no traceback from each)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    target(*args)


def _spawn(
    target: Callable[..., None], nproc: int, args: tuple, replies: int, timeout_s: float
) -> list:
    """Run `target(rank, *args, queue)` in `nproc` spawned processes at once; returns the first
    `replies` items they put on the queue. On an interrupt or an error the workers are stopped."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_ignoring_interrupts, args=(target, r, *args, queue))
        for r in range(nproc)
    ]
    done = False
    try:
        # started with Ctrl-C blocked, the workers inherit the block: one interrupted while it
        # still imports (before `_ignoring_interrupts` runs) printed a traceback. The parent
        # takes a Ctrl-C that came meanwhile once it unblocks.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            for p in procs:
                p.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        out = [queue.get(timeout=timeout_s) for _ in range(replies)]
        done = True
        return out
    finally:
        for p in procs:
            if not done and p.is_alive():
                p.terminate()
            p.join(timeout=60)


COLLECTIVE_SIZES = (2**12, 2**16, 2**20, 2**22)
"""Payload bytes each collective is timed at."""
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
COMM_ROUNDS = 9
"""Samples of each operation and size, interleaved with the compute-only loop they are taken
against; their median resists a burst of load on a shared machine."""
SYNC_CALLS = 4
"""Calls of an operation in one sample (each after a burst of compute): their mean keeps the
occasional slow wake-up a step pays as well."""
SYNC_BURST_S = 0.01
"""Compute before each timed call: longer than a scheduler time slice (ranks sharing a core are
preempted within it, as in a step's layer) and about what a layer computes between two of its
collectives in the runs the model is checked against. Timed right after a barrier, a two-rank
all-reduce reads ~0.4 ms here; after compute it costs 1.5-4 ms, and a four-rank one on two cores
5 ms against 7-10 ms (measured on this 2-core VM): the ranks that arrive first have gone idle and
must be woken, and ranks leave it at different moments. A step pays the second figure."""


def _costs_after_compute(
    fns: dict[str, Callable[[], object]],
    burst: Callable[[], object],
    rounds: int = COMM_ROUNDS,
    calls: int = SYNC_CALLS,
    before: Callable[[], object] | None = None,
) -> dict[str, float]:
    """Seconds one call of each fn adds to a loop of `burst(); fn()` over the loop of `burst()`
    alone, as a training step meets a collective: between two stretches of compute. Median over
    `rounds` samples, each fn's taken beside a compute-only loop of the same round."""

    def loop(fn: Callable[[], object] | None) -> float:
        if before is not None:
            before()
        t0 = time.perf_counter()
        for _ in range(calls):
            burst()
            if fn is not None:
                fn()
        return (time.perf_counter() - t0) / calls

    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        alone = loop(None)
        for name, fn in fns.items():
            samples[name].append(loop(fn) - alone)
    # noise can make a tiny call read as negative: the cost is at least a microsecond
    return {name: max(1e-6, statistics.median(t)) for name, t in samples.items()}


def _comm_worker(rank: int, world: int, port: int, threads: int, queue) -> None:
    """Time each operation in groups of every power-of-two size up to `world`, all groups of a
    size at once (as a layout's groups run), each call after the same burst of compute on every
    rank (`_costs_after_compute`): rank 0 reports, per size, (payload, seconds)."""
    import torch.distributed as dist

    from depthscale.parallel import p2p as p2p_layer

    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    a = torch.randn(256, 256)
    t0 = time.perf_counter()
    for _ in range(50):
        a @ a
    reps = torch.tensor([max(1, round(SYNC_BURST_S * 50 / (time.perf_counter() - t0)))])
    dist.broadcast(reps, 0)  # every rank bursts the same work, as a layout's ranks compute

    def burst(n: int = int(reps)) -> None:
        for _ in range(n):
            a @ a

    out: dict[int, dict[str, list[tuple[float, float]]]] = {}
    size = 2
    while size <= world:
        groups = [dist.new_group(list(range(g, g + size))) for g in range(0, world, size)]
        group = groups[rank // size]
        me = rank % size
        samples: dict[str, list[tuple[float, float]]] = {k: [] for k in OPS}
        for payload in COLLECTIVE_SIZES:
            n = payload // 4 // size * size
            full, part = torch.ones(n), torch.ones(n // size)

            def p2p(full=full, g=group, me=me, size=size):
                # through the project's P2P layer, as the pipeline and the ring post theirs
                sends = [p2p_layer.Send(full, (me + 1) % size, "calibrate")]
                recvs = [
                    p2p_layer.Recv(tuple(full.shape), full.dtype, (me - 1) % size, "calibrate")
                ]
                p2p_layer.post(g, sends, recvs, full.device, p2p_layer.Traffic()).wait()

            runs = {
                "all_reduce": lambda full=full, g=group: dist.all_reduce(full, group=g),
                "all_gather": lambda full=full, part=part, g=group: gather(full, part, group=g),
                "reduce_scatter": lambda full=full, part=part, g=group: scatter(
                    part, full, group=g
                ),
                "all_to_all": lambda full=full, g=group: dist.all_to_all_single(
                    torch.empty_like(full), full, group=g
                ),  # even splits: expert parallelism's rows with balanced routing
                "p2p": p2p,
            }
            seconds = _costs_after_compute(runs, burst, before=dist.barrier)
            for op in runs:
                samples[op].append((float(n * 4), seconds[op]))
        out[size] = samples
        size *= 2
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def _comm(world: int, threads: int) -> dict[int, dict[str, list[tuple[float, float]]]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return _spawn(_comm_worker, world, (world, port, threads), 1, 300)[0]


def measure_compute(nproc: int = 1, budget_s: float = 0.2) -> dict:
    """The compute fields of a cluster description (peak, GEMM curve, attention, memory
    bandwidth) for jobs of `nproc` local ranks: the quick part of `measure_cluster`, to re-measure
    beside each run on a machine whose speed drifts."""
    threads = threads_per_rank(nproc)
    local = _concurrent_local(nproc, threads, budget_s)
    return {
        "peak_flops": {"float32": local["peak"], "bfloat16": local["peak"]},
        "hbm_bw": local["memory_bw"],
        "gemm_curve": local["curve"],
        "attention_efficiency": local["attention_efficiency"],
        "measured": {"threads_per_rank": threads, "gemm": local["gemm_samples"]},
    }


def measure_links(nproc: int) -> dict[str, list[tuple[int, float, float]]]:
    """Per operation, (group size, latency s per call, payload bytes/s) for every group size of a
    job of `nproc` local ranks (a cluster description's `collectives`); none for one rank."""
    links: dict[str, list[tuple[int, float, float]]] = {}
    if nproc > 1:
        threads = threads_per_rank(nproc)
        for n, ops in _comm(nproc, threads).items():
            for op, samples in ops.items():
                bw, latency = fit_link(samples)
                links.setdefault(op, []).append((n, latency, bw))  # per call, payload bytes
    return links


def describe(nproc: int, compute: dict, links: dict[str, list[tuple[int, float, float]]]) -> dict:
    """A cluster description (the fields of `plan.hardware.Cluster`, and what was `measured`) of
    this machine for jobs of `nproc` local ranks, from `measure_compute` and `measure_links`."""
    _, latency, bw = links["all_reduce"][-1] if links else (1, 0.0, 1e12)
    step_latency = latency / max(1, 2 * (nproc - 1))
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return {
        "name": f"cpu-{nproc}",
        **compute,
        "hbm_bytes": pages / nproc,
        "gpus_per_node": nproc,
        "intra_bw": bw,
        "inter_bw": bw,
        "intra_latency": step_latency,
        "inter_latency": step_latency,
        "gemm_efficiency": 1.0,
        "memory_efficiency": 1.0,
        "comm_efficiency": 1.0,
        "memory_reserve": 0.0,
        "collectives": links,
    }


def measure_cluster(nproc: int = 1, budget_s: float = 0.2) -> dict:
    """A cluster description of this machine for jobs of `nproc` local ranks (`describe`)."""
    return describe(nproc, measure_compute(nproc, budget_s), measure_links(nproc))
