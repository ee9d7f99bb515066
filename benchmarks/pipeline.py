"""Pipeline parallelism with Block AttnRes vs the standard residual, side by side in one run.

    python benchmarks/pipeline.py [--pp 2 4 --virtual 1 2 --dim 256 512 --microbatches 8 16
                                   --layers 8 --seq 128 --rounds 5]

For every layout of the grid (pp × virtual × dim × microbatches) it spawns `pp` gloo workers, each
with one thread, and runs three variants in interleaved rounds, in ABBA order (so drift and order
hit all alike): the standard residual, Block AttnRes with the cross-stage cache, Block AttnRes
without it. Per variant: step time (median over rounds of the slowest rank), P2P bytes per step
(and the cache's blocks per hop, Eq. 7/8), the most bytes handed to `isend` and alive at once
(`_common.SentBuffers`, measured from outside the library), and per rank: busy (forward/backward
compute), depth-cache work, time waiting for messages in warm-up, steady state and cool-down, and
the rest (idle: Python, polling, the optimizer-free remainder), with the bubble (step − busy) /
busy against (P−1)/(V·M).

torch's own schedule (`ScheduleInterleaved1F1B`; `Schedule1F1B` at V = 1) runs the same standard
stage modules in the same rounds, so the bubble this machine gives a pipeline that is not ours is
measured beside ours (its loss is checked equal to ours: the same work).

The same model without a pipeline is measured in the same rounds, one process and one thread per
rank (as a pipeline rank has), over the same micro-batches, by every rank at once (so under the
same load as the pipeline), so the overhead the pipeline adds to Block AttnRes is a number:
(block/standard under PP) − (block/standard without PP) (paper: PP overhead < 4 %), in step time
and in each process's own CPU time (`thread_time`: no waiting, and none of the time other ranks
sharing the cores take from it, which step time includes when ranks outnumber cores). On a CPU the
ranks share the machine's cores (pp=4 on 2 cores runs two ranks per core), so times compare
variants with each other, not with a GPU.
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
    torch_schedule = _TorchSchedule(args, rank, layout)
    samples = {k: [] for k in runtimes}
    cpu_s = {k: [] for k in runtimes}  # this rank's own CPU time per step: no waits, no peers
    sent_alive = SentBuffers().install()
    peak_alive = dict.fromkeys(runtimes, 0)
    losses = {}
    reference = _WithoutPipeline(args, dim, m)
    for r in range(args.rounds + 1):
        dist.barrier()
        reference.round(record=r > 0, reverse=r % 2 == 1)
        order = list(runtimes) if r % 2 == 0 else list(reversed(runtimes))  # ABBA: no order bias
        for key in order:
            rt, model, _ = runtimes[key]
            dist.barrier()
            sent_alive.reset()
            cpu0 = time.thread_time()
            loss, stats = rt.step(
                tokens,
                labels,
                (args.micro_batch, args.seq, dim),
                torch.float32,
                torch.device("cpu"),
            )
            cpu = time.thread_time() - cpu0
            model.zero_grad(set_to_none=True)
            losses[key] = None if loss is None else float(loss.detach())
            peak_alive[key] = max(peak_alive[key], sent_alive.peak)
            if r:  # round 0 is warm-up
                cpu_s[key].append(cpu)
                settle = getattr(stats, "settle", None)
                samples[key].append(settle() if settle else stats)  # CUDA event times, once read
        dist.barrier()
        torch_schedule.step(tokens, labels, record=r > 0)
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
    no_pp = reference.result()
    queue.put(
        {
            "rank": rank,
            "results": results,
            "without_pp": no_pp,
            "torch_step_s": torch_schedule.times,
            "torch_loss": torch_schedule.loss,
            "loss": losses[("standard", True)],
        }
    )
    destroy_distributed()


class _TorchSchedule:
    """The standard-residual model on the same stage modules, run by torch's own pipelining
    (`ScheduleInterleaved1F1B`, or `Schedule1F1B` at V = 1) over the same micro-batches: what the
    bubble looks like on this machine under a schedule that is not ours."""

    def __init__(self, args, rank: int, layout: dict) -> None:
        from torch.distributed import pipelining

        from depthscale.model.transformer import Transformer, cross_entropy
        from depthscale.parallel.pipeline.stage import build_stages

        pp, v, m = layout["pp"], layout["virtual"], layout["microbatches"]
        torch.manual_seed(0)
        self.model = Transformer(_model_config(args, layout["dim"], "standard"))
        chunks = [
            pipelining.PipelineStage(_TorchChunk(s), s.spec.stage, pp * v, torch.device("cpu"))
            for s in build_stages(self.model, rank, pp, v)
        ]
        self.first = chunks[0].is_first
        self.last = chunks[-1].is_last
        if v == 1:
            self.schedule = pipelining.Schedule1F1B(chunks[0], m, loss_fn=cross_entropy)
        else:
            self.schedule = pipelining.ScheduleInterleaved1F1B(chunks, m, loss_fn=cross_entropy)
        self.times: list[float] = []
        self.loss: float | None = None  # the last stage's: the same as ours, or not the same work

    def step(self, tokens: list, labels: list, record: bool) -> None:
        inputs = (torch.cat(tokens),) if self.first else ()
        losses: list = []
        target = {"target": torch.cat(labels), "losses": losses} if self.last else {}
        t0 = time.perf_counter()
        self.schedule.step(*inputs, **target)
        if record:
            self.times.append(time.perf_counter() - t0)
        if losses:
            self.loss = float(torch.stack(losses).mean().detach())
        self.model.zero_grad(set_to_none=True)


class _TorchChunk(torch.nn.Module):
    """One of our stages with tensors in and out, as torch's `PipelineStage` takes it: tokens or
    the hidden state in, the hidden state or the logits (last stage) out."""

    def __init__(self, stage) -> None:
        from depthscale.model.residual import DepthState

        super().__init__()
        self.stage = stage
        self.state_of = lambda hidden: DepthState([], hidden)

    def forward(self, x):
        stage, model = self.stage, self.stage.model
        state = stage(x if stage.spec.is_first else self.state_of(x))
        return model.head(state) if stage.spec.is_last else state.partial


class _WithoutPipeline:
    """The same model in one process and thread over the same micro-batches (forward, backward,
    no optimizer: what a pipeline step runs), standard and block. Every rank runs one round of it
    between the pipeline's rounds, all at once, so the reference runs under the load the pipeline
    runs under (as many busy processes on the cores) and sees the same drift of the machine; the
    order of the two alternates from round to round."""

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

    def round(self, record: bool, reverse: bool) -> None:
        from depthscale.model.transformer import cross_entropy

        for name in sorted(self.models, reverse=reverse):
            model = self.models[name]
            t0, c0 = time.perf_counter(), time.thread_time()
            for x, y in zip(self.tokens, self.labels, strict=True):
                (cross_entropy(model(x), y) / self.m).backward()
            model.zero_grad(set_to_none=True)
            if record:
                self.times[name].append(time.perf_counter() - t0)
                self.cpu[name].append(time.thread_time() - c0)

    def result(self) -> dict[str, float]:
        return {
            f"{name}_{what}": statistics.median(samples[name])
            for name in self.models
            for what, samples in (("step_s", self.times), ("cpu_s", self.cpu))
        }


def _layout_report(args, layout: dict, ranks: list[dict]) -> dict:
    pp, v, m = layout["pp"], layout["virtual"], layout["microbatches"]
    # without PP: every rank's reference, summed (each ran under the pipeline's load)
    no_pp = {k: sum(r["without_pp"][k] for r in ranks) for k in ranks[0]["without_pp"]}
    no_pp["block/standard"] = no_pp["block_step_s"] / no_pp["standard_step_s"]
    no_pp["block/standard_cpu"] = no_pp["block_cpu_s"] / no_pp["standard_cpu_s"]
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
        "without_pp_s_all_ranks": {
            k: round(x, 4) for k, x in no_pp.items() if k.endswith("_step_s")
        },
    }
    out["summary"].update(_torch_summary(ranks, out["variants"]["standard_cache_True"], step))
    return out


def _torch_summary(ranks: list[dict], ours: dict, step: dict) -> dict:
    """torch's schedule on the same standard stages, against ours: its step (slowest rank, median)
    over ours, and its bubble per rank, taken over our busy time on that rank (the same stage
    modules do the same compute under either schedule)."""
    slowest = [max(s) for s in zip(*(r["torch_step_s"] for r in ranks), strict=True)]
    busy = [r["busy"] for r in ours["per_rank_s"]]
    bubble = [
        statistics.median(r["torch_step_s"]) / b - 1 for r, b in zip(ranks, busy, strict=True)
    ]
    loss = [(r["loss"], r["torch_loss"]) for r in ranks if r["torch_loss"] is not None]
    return {
        "torch_schedule_step/ours": round(
            statistics.median(slowest) / step["standard_cache_True"], 3
        ),
        "bubble_torch_schedule_mean": round(statistics.mean(bubble), 4),
        "torch_schedule_loss_diff": abs(loss[0][0] - loss[0][1]) if loss else None,
    }


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
        why = None
        if pp < 2 or v < 1 or m < 1:
            why = "a pipeline needs pp ≥ 2, V ≥ 1 and M ≥ 1"
        elif args.layers % (pp * v):
            why = f"{args.layers} layers do not split into {pp * v} chunks"
        elif v > 1 and m % pp:
            why = f"interleaved 1F1B needs microbatches ({m}) divisible by pp ({pp})"
        elif dim % args.heads:
            why = f"dim {dim} is not a multiple of {args.heads} heads"
        if why:
            print(f"skipping pp={pp} V={v} d={dim} M={m}: {why}", file=sys.stderr)
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
