"""What `train.gc_interval` buys: how late the slowest rank launches the step's last collective.

    python benchmarks/gc_interval.py [--world 2 --steps 400 --interval 50 --garbage 2000 --live 1000000
                                      --out benchmarks/results/gc_interval_cpu.json]

MegaScale §6.3: MFU declined over a long run because ranks launched the data-parallel
reduce-scatter at different times — Python's garbage collector paused each rank at its own
moments. Here `--world` gloo processes hold `--live` long-lived Python objects (what a full
collection must walk) and run steps of a fixed matmul plus Python work that leaves reference
cycles behind (`--garbage` small objects per step, as data pipelines and hooks do), then an
all-reduce. Per step, the launch skew is the latest rank's launch time minus the earliest's
(one host, one clock). Two policies, the same processes, interleaved in blocks:

- `default`: Python's collector runs whenever its thresholds say, on each rank separately;
- `interval`: what `train.gc_interval` does (`train.telemetry.Telemetry`): collection disabled,
  then run on every rank at the start of every `--interval`-th step.

Reported per policy: median / p99 / max skew, and the mean step time including the collections
(the price of collecting everything every N steps). Keep `--world` at most the core count: ranks
that take turns on a core skew each other by whole time slices, which no GC policy changes.
Prints one JSON object; `--out` also writes it.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import device_info, run_ranks  # noqa: E402


def _garbage(n: int) -> None:
    """Objects in reference cycles: only the cyclic collector frees them."""
    for _ in range(n // 2):
        a, b = {}, {}
        a["b"], b["a"] = b, a


def _worker(rank: int, world: int, args: argparse.Namespace, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    x = torch.randn(192, 192)
    # long-lived objects the collector must walk at every full collection (a tokenizer's caches,
    # a dataset index, the framework's own objects): what makes a pause long
    live = [{"i": i} for i in range(args.live)]
    launches: dict[str, list[int]] = {"default": [], "interval": []}
    steps: dict[str, list[float]] = {"default": [], "interval": []}
    block = args.interval * 2
    for i in range(args.steps):
        policy = "default" if (i // block) % 2 == 0 else "interval"
        if policy == "interval" and gc.isenabled():
            gc.collect()
            gc.disable()
        elif policy == "default" and not gc.isenabled():
            gc.enable()
        t0 = time.perf_counter_ns()
        if policy == "interval" and i % args.interval == 0:
            gc.collect()  # at the step's start on every rank: the next collective absorbs it
        dist.barrier()  # every step starts together: the skew is this step's own
        y = x
        for _ in range(4):
            y = torch.tanh(y @ x)
        _garbage(args.garbage)
        launch = time.perf_counter_ns()
        dist.all_reduce(y[:1, :1].contiguous())
        steps[policy].append((time.perf_counter_ns() - t0) / 1e6)
        launches[policy].append(launch)
    gc.enable()
    del live
    dist.destroy_process_group()
    queue.put({"rank": rank, "launches": launches, "steps": steps})


def _summary(results: list[dict], policy: str) -> dict:
    per_step = zip(*(r["launches"][policy] for r in results))
    skews = sorted((max(ts) - min(ts)) / 1e6 for ts in per_step)
    step_ms = [statistics.fmean(r["steps"][policy]) for r in results]
    return {
        "steps": len(skews),
        "launch_skew_ms_median": statistics.median(skews),
        "launch_skew_ms_p99": skews[min(len(skews) - 1, int(0.99 * len(skews)))],
        "launch_skew_ms_max": skews[-1],
        "step_ms_mean": statistics.fmean(step_ms),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2, help="≤ cores, or ranks take turns")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--interval", type=int, default=50)
    parser.add_argument("--garbage", type=int, default=2000)
    parser.add_argument("--live", type=int, default=1_000_000)
    parser.add_argument("--out")
    args = parser.parse_args()
    results = run_ranks(_worker, args.world, args.world, args)
    default, interval = _summary(results, "default"), _summary(results, "interval")
    result = {
        **device_info(),
        "world": args.world,
        "gc_interval": args.interval,
        "garbage_objects_per_step": args.garbage,
        "live_objects": args.live,
        "default": default,
        "interval": interval,
        "p99_skew_ratio_interval_vs_default": interval["launch_skew_ms_p99"]
        / default["launch_skew_ms_p99"],
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
