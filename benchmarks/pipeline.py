"""Pipeline parallelism with Block AttnRes vs the standard residual, side by side in one run.

    python benchmarks/pipeline.py [--pp 2 4 --virtual 1 2 --dim 256 512 --microbatches 8 16
                                   --layers 8 --seq 128 --rounds 5]

For every layout of the grid (pp × virtual × dim × microbatches) it spawns `pp` gloo workers, each
with one thread, and runs three variants in interleaved rounds (so drift hits all alike): the
standard residual, Block AttnRes with the cross-stage cache, Block AttnRes without it. Per variant:
step time (median over rounds of the slowest rank), P2P bytes per step (and the cache's blocks per
hop, Eq. 7/8), the most bytes handed to `isend` and alive at once (`_common.SentBuffers`, measured
from outside the library), and per rank: busy (forward/backward compute), depth-cache work, time
waiting for messages in warm-up, steady state and cool-down, and the rest (idle: Python, polling,
the optimizer-free remainder), with the bubble (step − busy) / busy against (P−1)/(V·M).

The same model without a pipeline is measured in the same run, one process and one thread (as a
pipeline rank has), over the same micro-batches, by rank 0 between the pipeline's rounds, so the overhead the pipeline adds to Block AttnRes
is a number: (block/standard under PP) − (block/standard without PP) (paper: PP overhead < 4 %),
in step time and in each process's own CPU time (`thread_time`: no waiting, and none of the time
other ranks sharing the cores take from it, which step time includes when ranks outnumber cores).
On a CPU the ranks share the machine's cores (pp=4 on 2 cores runs two ranks per core), so times
compare variants with each other, not with a GPU.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import SentBuffers, device_info, run_ranks  # noqa: E402

VARIANTS = (("standard", True), ("block", True), ("block", False))
PHASES = ("busy", "cache", "wait_warmup", "wait_steady", "wait_cooldown", "idle")


def _model_config(args, dim: int, residual: str):
    from depthscale.config import ModelConfig

    return ModelConfig(
        vocab_size=512,
        dim=dim,
        n_layers=args.layers,
        n_heads=args.heads,
        max_seq_len=args.seq,
        tie_embeddings=False,
        residual=residual,
        attnres_n_blocks=args.blocks,
    )


def _batches(args, m: int) -> tuple[list, list]:
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, 512, (args.micro_batch, args.seq), generator=g) for _ in range(m)]
    labels = [torch.randint(0, 512, (args.micro_batch, args.seq), generator=g) for _ in range(m)]
    return tokens, labels


def _breakdown(s) -> dict[str, float]:
    """Seconds of one rank's step by what it did (StepStats of this revision or an older one)."""
    waits = {p: getattr(s, f"{p}_s", 0.0) for p in ("wait_warmup", "wait_steady", "wait_cooldown")}
    cache = getattr(s, "cache_s", 0.0)
    out = {"busy": s.compute_s, "cache": cache, **waits}
    out["idle"] = max(0.0, s.step_s - sum(out.values()))
    return out


def _worker(rank: int, args, layout: dict, port: int, queue) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(layout["pp"]),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    import torch.distributed as dist

    from depthscale.model.transformer import Transformer
    from depthscale.parallel.mesh import destroy_distributed, init_distributed
    from depthscale.parallel.pipeline.depth_cache import DepthCache
    from depthscale.parallel.pipeline.runtime import PipelineRuntime
    from depthscale.parallel.pipeline.schedules import interleaved_1f1b
    from depthscale.parallel.pipeline.stage import build_stages, split_layers

    init_distributed("cpu")
    pp, v, m, dim = layout["pp"], layout["virtual"], layout["microbatches"], layout["dim"]
    tokens, labels = _batches(args, m)
    runtimes = {}
    for residual, cache in VARIANTS:
        cfg = _model_config(args, dim, residual)
        torch.manual_seed(0)
        model = Transformer(cfg)
        stages = build_stages(model, rank, pp, v)
        dc = DepthCache(cfg, split_layers(args.layers, pp * v), pp, enabled=cache)
        schedule = interleaved_1f1b(pp, v, m)
        if "actions" in inspect.signature(PipelineRuntime).parameters:  # revisions before #13
            schedule = schedule[rank]
        runtimes[(residual, cache)] = (
            PipelineRuntime(stages, schedule, dist.group.WORLD, dc),
            model,
            dc,
        )
    samples = {k: [] for k in runtimes}
    cpu_s = {k: [] for k in runtimes}  # this rank's own CPU time per step: no waits, no peers
    sent_alive = SentBuffers().install()
    peak_alive = dict.fromkeys(runtimes, 0)
    reference = _WithoutPipeline(args, dim, m) if rank == 0 else None
    for r in range(args.rounds + 1):
        if reference is not None:
            reference.round(record=r > 0)
        for key, (rt, model, _) in runtimes.items():
            dist.barrier()
            sent_alive.reset()
            cpu0 = time.thread_time()
            _, stats = rt.step(
                tokens,
                labels,
                (args.micro_batch, args.seq, dim),
                torch.float32,
                torch.device("cpu"),
            )
            cpu = time.thread_time() - cpu0
            model.zero_grad(set_to_none=True)
            peak_alive[key] = max(peak_alive[key], sent_alive.peak)
            if r:  # round 0 is warm-up
                cpu_s[key].append(cpu)
                settle = getattr(stats, "settle", None)
                samples[key].append(settle() if settle else stats)  # CUDA event times, once read
    results = {}
    for key, stats in samples.items():
        results[f"{key[0]}_cache_{key[1]}"] = {
            "step_s": [s.step_s for s in stats],
            "cpu_s": statistics.median(cpu_s[key]),
            "bytes_sent": stats[0].bytes_sent,
            "peak_sent_bytes_alive": peak_alive[key],
            "breakdown_s": {p: statistics.median(_breakdown(s)[p] for s in stats) for p in PHASES},
            "blocks_per_hop": runtimes[key][2].blocks_per_hop(),
        }
    no_pp = reference.result() if reference is not None else None
    queue.put({"rank": rank, "results": results, "without_pp": no_pp})
    destroy_distributed()


class _WithoutPipeline:
    """The same model in one process and thread over the same micro-batches (forward, backward,
    no optimizer: what a pipeline step runs), standard and block. Rank 0 runs one round of it
    after every pipeline round while the other ranks wait at the next barrier, so the reference
    sees the same drift of the machine as the pipeline does."""

    def __init__(self, args, dim: int, m: int) -> None:
        from depthscale.model.transformer import Transformer

        self.m = m
        self.tokens, self.labels = _batches(args, m)
        self.models = {}
        for residual in ("standard", "block"):
            torch.manual_seed(0)
            self.models[residual] = Transformer(_model_config(args, dim, residual))
        self.times = {k: [] for k in self.models}
        self.cpu = {k: [] for k in self.models}

    def round(self, record: bool) -> None:
        from depthscale.model.transformer import cross_entropy

        for name, model in self.models.items():
            t0, c0 = time.perf_counter(), time.thread_time()
            for x, y in zip(self.tokens, self.labels, strict=True):
                (cross_entropy(model(x), y) / self.m).backward()
            model.zero_grad(set_to_none=True)
            if record:
                self.times[name].append(time.perf_counter() - t0)
                self.cpu[name].append(time.thread_time() - c0)

    def result(self) -> dict[str, float]:
        med = {k: statistics.median(t) for k, t in self.times.items()}
        med_cpu = {k: statistics.median(t) for k, t in self.cpu.items()}
        return {
            "standard_step_s": med["standard"],
            "block_step_s": med["block"],
            "block/standard": med["block"] / med["standard"],
            "block/standard_cpu": med_cpu["block"] / med_cpu["standard"],
        }


def _layout_report(args, layout: dict, ranks: list[dict]) -> dict:
    pp, v, m = layout["pp"], layout["virtual"], layout["microbatches"]
    no_pp = ranks[0]["without_pp"]
    out: dict = {"layout": layout, "variants": {}}
    step = {}
    for name in ranks[0]["results"]:
        per_rank = [r["results"][name] for r in ranks]
        slowest = [max(s) for s in zip(*(r["step_s"] for r in per_rank), strict=True)]
        step[name] = statistics.median(slowest)
        bubble = [
            (sum(r["breakdown_s"].values()) - r["breakdown_s"]["busy"]) / r["breakdown_s"]["busy"]
            for r in per_rank
        ]
        out["variants"][name] = {
            "step_s": round(step[name], 4),
            "bytes_per_step": sum(r["bytes_sent"] for r in per_rank),
            "blocks_per_hop": per_rank[0]["blocks_per_hop"],
            "peak_sent_bytes_alive": max(r["peak_sent_bytes_alive"] for r in per_rank),
            "per_rank_s": [{p: round(r["breakdown_s"][p], 4) for p in PHASES} for r in per_rank],
            "bubble_per_rank": [round(b, 3) for b in bubble],
        }
    under_pp = step["block_cache_True"] / step["standard_cache_True"]
    cpu = {name: sum(r["results"][name]["cpu_s"] for r in ranks) for name in step}
    under_pp_cpu = cpu["block_cache_True"] / cpu["standard_cache_True"]
    theory = (pp - 1) / (v * m)
    std_bubble = statistics.mean(out["variants"]["standard_cache_True"]["bubble_per_rank"])
    out["summary"] = {
        "cache_on/off_step": round(step["block_cache_True"] / step["block_cache_False"], 3),
        "cache_on/off_bytes": round(
            out["variants"]["block_cache_True"]["bytes_per_step"]
            / out["variants"]["block_cache_False"]["bytes_per_step"],
            3,
        ),
        "block/standard_under_pp": round(under_pp, 3),
        "block/standard_without_pp": round(no_pp["block/standard"], 3),
        "pp_overhead": round(under_pp - no_pp["block/standard"], 3),
        # the same with each rank's own CPU time (all ranks summed): what the pipeline makes this
        # process do, without waiting and without the time other ranks on the cores take from it
        "block/standard_cpu_under_pp": round(under_pp_cpu, 3),
        "block/standard_cpu_without_pp": round(no_pp["block/standard_cpu"], 3),
        "pp_overhead_cpu": round(under_pp_cpu - no_pp["block/standard_cpu"], 3),
        "bubble_theory": round(theory, 4),
        "bubble_standard_mean": round(std_bubble, 4),
        "bubble_block_cache_mean": round(
            statistics.mean(out["variants"]["block_cache_True"]["bubble_per_rank"]), 4
        ),
        "without_pp_s": {k: round(x, 4) for k, x in no_pp.items() if k.endswith("_step_s")},
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, nargs="+", default=[2])
    ap.add_argument("--virtual", type=int, nargs="+", default=[2])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[8])
    ap.add_argument("--dim", type=int, nargs="+", default=[256])
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    layouts = []
    for pp, v, dim, m in itertools.product(args.pp, args.virtual, args.dim, args.microbatches):
        if args.layers % (pp * v):
            print(
                f"skipping pp={pp} V={v}: {args.layers} layers do not split into {pp * v} chunks",
                file=sys.stderr,
            )
            continue
        layout = {"pp": pp, "virtual": v, "dim": dim, "microbatches": m}
        ranks = run_ranks(_worker, pp, args, layout)
        layouts.append(_layout_report(args, layout, ranks))
        print(f"pp={pp} V={v} d={dim} M={m}: {json.dumps(layouts[-1]['summary'])}", file=sys.stderr)
    report = {
        "benchmark": "pipeline",
        **device_info(),
        "cpu_cores": os.cpu_count(),
        "config": {
            k: v for k, v in vars(args).items() if k not in ("pp", "virtual", "dim", "microbatches")
        },
        "layouts": layouts,
        "paper": "block AttnRes end-to-end overhead under PP < 4 %",
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
