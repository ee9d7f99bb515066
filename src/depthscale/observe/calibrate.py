"""Measure this machine as `depthscale plan` describes a cluster, so its time model can be checked
against real runs here (`depthscale plan --calibrate OUT.json --nproc N`).

Each rank of an N-process job runs with cpu_count // N threads (what `depthscale train` gives its
workers); with more ranks than cores they share the cores, so per-rank rates are the measured ones
scaled by cores / N. Measured: GEMM FLOP/s over shapes (fitted to peak · x / (x + x½) in the
smallest dimension), fused causal attention's fraction of that peak, elementwise memory bandwidth,
and gloo all-reduce latency and bandwidth between N local processes.
"""

from __future__ import annotations

import math
import os
import socket
import time

import torch
import torch.nn.functional as F

GEMM_SHAPES = [(64, 64, 64), (128, 256, 128), (256, 256, 256), (512, 512, 512),
               (1024, 512, 512), (1024, 1024, 1024), (2048, 256, 256), (512, 2048, 128)]  # fmt: skip


def _best_time(fn, budget_s: float) -> float:
    fn()
    best, start = math.inf, time.perf_counter()
    while time.perf_counter() - start < budget_s or best == math.inf:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def fit_gemm(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """(peak, x½) of rate(x) = peak · x / (x + x½) from (smallest dim, FLOP/s) samples: a line
    1/rate = 1/peak + (x½/peak) · (1/x), fitted by least squares."""
    xs = [1 / x for x, _ in samples]
    ys = [1 / r for _, r in samples]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    intercept = my - slope * mx
    if intercept <= 0:  # rates still rising at the largest shape: take the best as the peak
        return max(r for _, r in samples), 0.0
    return 1 / intercept, max(0.0, slope / intercept)


def fit_link(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """(bytes/s, latency s) of time = latency + bytes / bandwidth, least squares."""
    n = len(samples)
    mx = sum(b for b, _ in samples) / n
    my = sum(t for _, t in samples) / n
    var = sum((b - mx) ** 2 for b, _ in samples)
    slope = sum((b - mx) * (t - my) for b, t in samples) / var
    return 1 / slope, max(0.0, my - slope * mx)


def _local(budget_s: float) -> dict:
    samples = []
    for m, n, k in GEMM_SHAPES:
        a, b = torch.randn(m, k), torch.randn(k, n)
        samples.append((min(m, n, k), 2 * m * n * k / _best_time(lambda a=a, b=b: a @ b, budget_s)))
    peak, half = fit_gemm(samples)
    q = torch.randn(2, 4, 512, 64)
    t_attn = _best_time(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True), budget_s)
    attention = 0.5 * 4 * 2 * 4 * 512 * 512 * 64 / t_attn / peak
    x = torch.randn(4 * 2**20)
    y = torch.empty_like(x)
    t_copy = _best_time(lambda: torch.add(x, 1.0, out=y), budget_s)
    return {
        "peak": peak,
        "half_dim": half,
        "attention_efficiency": min(1.0, attention),
        "memory_bw": 2 * x.nbytes / t_copy,
        "gemm_samples": samples,
    }


def _comm_worker(rank: int, world: int, port: int, threads: int, queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    samples = []
    for size in (2**10, 2**14, 2**18, 2**20, 2**22):
        t = torch.ones(size // 4)
        dist.all_reduce(t)
        times = []
        for _ in range(5):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        # a ring all-reduce moves 2·(n−1)/n of the buffer over 2·(n−1) steps
        samples.append((2 * (world - 1) / world * size, sorted(times)[len(times) // 2]))
    if rank == 0:
        queue.put(samples)
    dist.destroy_process_group()


def _comm(world: int, threads: int) -> list[tuple[float, float]]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_comm_worker, args=(r, world, port, threads, queue))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    samples = queue.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    return samples


def measure_cluster(nproc: int = 1, budget_s: float = 0.2) -> dict:
    """A cluster description (the fields of `plan.hardware.Cluster`) of this machine for jobs of
    `nproc` local ranks."""
    cores = os.cpu_count() or 1
    threads = max(1, cores // nproc)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        local = _local(budget_s)
    finally:
        torch.set_num_threads(previous)
    share = min(1.0, cores / (nproc * threads))  # oversubscribed ranks share the cores
    bw, latency = fit_link(_comm(nproc, threads)) if nproc > 1 else (1e12, 0.0)
    step_latency = latency / max(1, 2 * (nproc - 1))
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return {
        "name": f"cpu-{nproc}",
        "peak_flops": {"float32": local["peak"] * share, "bfloat16": local["peak"] * share},
        "hbm_bytes": pages / nproc,
        "hbm_bw": local["memory_bw"] * share,
        "gpus_per_node": nproc,
        "intra_bw": bw,
        "inter_bw": bw,
        "intra_latency": step_latency,
        "inter_latency": step_latency,
        "gemm_efficiency": 1.0,
        "gemm_half_dim": local["half_dim"],
        "attention_efficiency": local["attention_efficiency"],
        "memory_efficiency": 1.0,
        "comm_efficiency": 1.0,
        "memory_reserve": 0.0,
        "measured": {"threads_per_rank": threads, "gemm": local["gemm_samples"]},
    }
