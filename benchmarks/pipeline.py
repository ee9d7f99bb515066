"""Pipeline parallelism with Block AttnRes vs the standard residual, side by side in one run.

    python benchmarks/pipeline.py [--pp 2 --virtual 2 --microbatches 8 --dim 256 --layers 8 --seq 128]

Spawns `pp` gloo workers and prints one JSON object: P2P bytes per step with and without the
cross-stage cache (and the paper's Eq. 7/8 block counts), the measured bubble ratio (idle / compute,
per rank) against the theoretical (P−1)/(V·M), the most bytes handed to `isend` and still alive
at once on a rank (`peak_sent_bytes_alive`, measured from outside the library: `_common.SentBuffers`),
and the step time of block AttnRes relative to the
standard residual under the same layout (paper: < 4 % with PP). On CPU the ranks share cores, so
times are relative only.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import socket
import statistics
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from _common import SentBuffers, device_info  # noqa: E402


def _worker(rank: int, args, port: int, out) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(args.pp), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    import torch.distributed as dist

    from depthscale.config import ModelConfig
    from depthscale.model.transformer import Transformer
    from depthscale.parallel.mesh import destroy_distributed, init_distributed
    from depthscale.parallel.pipeline.depth_cache import DepthCache
    from depthscale.parallel.pipeline.runtime import PipelineRuntime
    from depthscale.parallel.pipeline.schedules import interleaved_1f1b
    from depthscale.parallel.pipeline.stage import build_stages, split_layers

    init_distributed("cpu")
    g = torch.Generator().manual_seed(0)
    m, mb = args.microbatches, args.micro_batch
    tokens = [torch.randint(0, 512, (mb, args.seq), generator=g) for _ in range(m)]
    labels = [torch.randint(0, 512, (mb, args.seq), generator=g) for _ in range(m)]
    results = {}
    variants = [("standard", True), ("block", True), ("block", False)]
    runtimes = {}
    for residual, cache in variants:
        cfg = ModelConfig(
            vocab_size=512,
            dim=args.dim,
            n_layers=args.layers,
            n_heads=args.heads,
            max_seq_len=args.seq,
            tie_embeddings=False,
            residual=residual,
            attnres_n_blocks=args.blocks,
        )
        torch.manual_seed(0)
        model = Transformer(cfg)
        stages = build_stages(model, rank, args.pp, args.virtual)
        dc = DepthCache(
            cfg, split_layers(args.layers, args.pp * args.virtual), args.pp, enabled=cache
        )
        schedule = interleaved_1f1b(args.pp, args.virtual, m)
        if "actions" in inspect.signature(PipelineRuntime).parameters:  # revisions before #13
            schedule = schedule[rank]
        runtimes[(residual, cache)] = (
            PipelineRuntime(stages, schedule, dist.group.WORLD, dc),
            model,
            dc,
        )
    samples = {k: [] for k in runtimes}
    sent_alive = SentBuffers().install()
    peak_alive = dict.fromkeys(runtimes, 0)
    for r in range(args.rounds + 1):
        for key, (rt, model, _) in runtimes.items():
            dist.barrier()
            sent_alive.reset()
            loss, stats = rt.step(
                tokens, labels, (mb, args.seq, args.dim), torch.float32, torch.device("cpu")
            )
            model.zero_grad(set_to_none=True)
            peak_alive[key] = max(peak_alive[key], sent_alive.peak)
            if r:  # round 0 is warm-up
                samples[key].append(stats.settle())  # CUDA event times, once read
    for key, stats in samples.items():
        step = torch.tensor([statistics.median(s.step_s for s in stats)])
        dist.all_reduce(step, op=dist.ReduceOp.MAX)
        sent = torch.tensor([float(stats[0].bytes_sent)])
        dist.all_reduce(sent)
        bubble = torch.tensor([statistics.median(s.bubble_ratio for s in stats)])
        dist.all_reduce(bubble)
        alive = torch.tensor([float(peak_alive[key])])
        dist.all_reduce(alive, op=dist.ReduceOp.MAX)
        results[f"{key[0]}_cache_{key[1]}"] = {
            "step_s": step.item(),
            "bytes_per_step": int(sent.item()),
            "peak_sent_bytes_alive": int(alive.item()),
            "bubble_ratio_mean_over_ranks": bubble.item() / args.pp,
            "blocks_per_hop": runtimes[key][2].blocks_per_hop(),
        }
    if rank == 0:
        out.put(results)
    destroy_distributed()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--virtual", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args, port, out)) for r in range(args.pp)]
    for p in procs:
        p.start()
    results = out.get(timeout=1800)
    for p in procs:
        p.join()
    p_, v, m = args.pp, args.virtual, args.microbatches
    report = {
        "benchmark": "pipeline",
        **device_info(),
        "config": vars(args),
        "results": results,
        "bytes_ratio_cache_on/off (block)": results["block_cache_True"]["bytes_per_step"]
        / results["block_cache_False"]["bytes_per_step"],
        "bubble_theory_(P-1)/(V*M)": (p_ - 1) / (v * m),
        "step_time_ratio_block/standard": results["block_cache_True"]["step_s"]
        / results["standard_cache_True"]["step_s"],
        "paper": "block AttnRes end-to-end overhead under PP < 4 %",
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
