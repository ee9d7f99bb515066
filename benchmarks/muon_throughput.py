"""Muon's cost next to AdamW's (#54 item 5): step times in one process and at dp_shard = 4 on gloo,
the redistribution's share of the distributed optimizer step, and the Newton–Schulz work per rank.

    python benchmarks/muon_throughput.py [--dim 256 --layers 4 --world 4 --rounds 7 --out f.json]

Prints ONE JSON object:
- `one_process`: the median optimizer step and training step (forward + backward + step) of the
  same model (same seed, same batch) with AdamW and with Muon, measured in interleaved rounds.
- `dp_shard_<world>`: `--world` gloo processes, FSDP over all of them (`parallelize`), fixed random
  gradients laid out as each parameter: the median optimizer step of each optimizer (rank 0's, and
  the slowest rank's), and, over Muon's timed steps, the seconds spent inside the redistribution's
  all-to-alls and in Newton–Schulz (measured by wrapping them from here). The all-to-all time
  includes waiting for the slowest owner, so it is an upper bound on the wire's share. The
  Newton–Schulz FLOPs each rank ran, counted at the calls, are compared with the planner's
  (`plan.muon_states.muon_step_work`), and the bytes counted by the optimizer (`opt.moved`) with the
  planner's bytes.
- `llama_1b_fsdp_8`: the planner's Newton–Schulz FLOPs per rank for configs/llama-1b.toml at
  dp_shard = 8 (the owner rule the optimizer uses), and their max/mean.

CPU, 1 intra-op thread per process; with `--world` 4 processes on a 2-core box the ranks time-share
cores, so the distributed numbers show the machinery's overheads, not a GPU cluster's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import device_info, interleaved_times, print_result, run_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OPTIMIZERS = ("adamw", "muon")


def _config(args: argparse.Namespace, dp_shard: int = 1):
    from depthscale.config import Config

    cfg = Config()
    m = cfg.model
    m.vocab_size, m.dim, m.n_layers, m.n_heads = args.vocab, args.dim, args.layers, args.heads
    m.max_seq_len, m.residual, m.attnres_n_blocks = args.seq, "block", max(1, args.layers // 2)
    cfg.train.batch_size, cfg.train.micro_batch_size = args.batch, 1  # the plan's micro-batches
    cfg.parallel.dp_shard = dp_shard
    cfg.optim.lr, cfg.optim.weight_decay = 1e-3, 0.1
    return cfg


def _optimizer(model, cfg, name: str):
    from depthscale.train.optim import build_optimizer

    cfg.optim.name = name
    return build_optimizer(model, cfg.optim)


def one_process(args: argparse.Namespace) -> dict:
    """Optimizer step and training step of AdamW and Muon on the same model, interleaved."""
    import torch.nn.functional as F

    from depthscale.model.transformer import Transformer

    cfg = _config(args)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]
    opt_steps, train_steps = {}, {}
    for name in OPTIMIZERS:
        torch.manual_seed(0)
        model = Transformer(cfg.model)
        opt = _optimizer(model, cfg, name)

        def backward(model=model) -> None:
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()

        def train(model=model, opt=opt) -> None:
            opt.zero_grad(set_to_none=True)
            backward(model)
            opt.step()

        backward()  # gradients the optimizer-only timing reuses
        opt_steps[name] = opt.step
        train_steps[name] = train
    opt_t = interleaved_times(opt_steps, args.rounds)
    train_t = interleaved_times(train_steps, args.rounds)
    return {
        "optimizer_step_s": opt_t,
        "optimizer_step_muon_over_adamw": opt_t["muon"] / opt_t["adamw"],
        "train_step_s": train_t,
        "train_step_muon_over_adamw": train_t["muon"] / train_t["adamw"],
    }


def _rank(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.world), LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from torch.distributed.tensor import DTensor, distribute_tensor

    import depthscale.train.muon as muon_mod
    from depthscale.model.transformer import Transformer
    from depthscale.parallel.mesh import ParallelDims, destroy_distributed, init_distributed
    from depthscale.parallel.parallelize import parallelize
    from depthscale.plan.layout import Layout
    from depthscale.plan.muon_states import muon_step_work
    from depthscale.shape import ModelShape
    from depthscale.shape.muon import ns_flops

    init_distributed("cpu")
    dims = ParallelDims(dp_shard=args.world).validate(args.world)
    mesh = dims.build_mesh("cpu")
    cfg = _config(args, dp_shard=args.world)
    acc = {"all_to_all_s": 0.0, "ns_s": 0.0, "ns_flops": 0, "ns_calls": 0}

    real_a2a, real_ns = muon_mod._Redistribution._all_to_all, muon_mod.newton_schulz

    def timed_a2a(self, *a) -> None:
        t0 = time.perf_counter()
        real_a2a(self, *a)
        acc["all_to_all_s"] += time.perf_counter() - t0

    def timed_ns(x, steps=muon_mod.NS_STEPS, *a):
        t0 = time.perf_counter()
        out = real_ns(x, steps, *a)
        acc["ns_s"] += time.perf_counter() - t0
        acc["ns_flops"] += ns_flops(x.shape, steps)
        acc["ns_calls"] += 1
        return out

    muon_mod._Redistribution._all_to_all = timed_a2a
    muon_mod.newton_schulz = timed_ns
    steps, opts = {}, {}
    for name in OPTIMIZERS:
        torch.manual_seed(0)
        model = Transformer(cfg.model)
        parallelize(model, mesh, dims, cfg)
        opt = _optimizer(model, cfg, name)
        gen = torch.Generator().manual_seed(100)
        for p in model.parameters():
            full = torch.randn(p.shape, generator=gen)
            p.grad = (
                distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
                if isinstance(p, DTensor)
                else full
            )
        opt.step()  # first step: states, Muon's routes (their own all-to-alls), not timed
        opts[name] = opt
        steps[name] = opt.step
    muon = opts["muon"]
    for k in acc:
        acc[k] = type(acc[k])(0)
    muon.moved.clear()
    counted = {"muon": 0}

    def muon_step() -> None:
        muon.step()
        counted["muon"] += 1

    times = interleaved_times({"adamw": steps["adamw"], "muon": muon_step}, args.rounds)
    n = counted["muon"]
    lay = Layout(dp_shard=args.world)
    planned = muon_step_work(ModelShape.from_config(cfg.model), lay, 0, 0, rank)
    queue.put(
        {
            "rank": rank,
            "optimizer_step_s": times,
            "all_to_all_s_per_step": acc["all_to_all_s"] / n,
            "ns_s_per_step": acc["ns_s"] / n,
            "ns_calls_per_step": acc["ns_calls"] / n,
            "ns_flops_counted": acc["ns_flops"] // n,
            "ns_flops_planned": planned["ns_flops"],
            "bytes_per_step": {k: v // n for k, v in muon.moved.items()},
            "bytes_planned": {k: planned[k] for k in ("to_owners", "from_owners")},
        }
    )
    destroy_distributed()


def distributed(args: argparse.Namespace) -> dict:
    ranks = run_ranks(_rank, args.world, args)
    r0 = ranks[0]["optimizer_step_s"]
    slowest = {k: max(r["optimizer_step_s"][k] for r in ranks) for k in OPTIMIZERS}
    flops = [r["ns_flops_counted"] for r in ranks]
    a2a = statistics.mean(r["all_to_all_s_per_step"] for r in ranks)
    ns = statistics.mean(r["ns_s_per_step"] for r in ranks)
    step = statistics.mean(r["optimizer_step_s"]["muon"] for r in ranks)
    if flops != [r["ns_flops_planned"] for r in ranks]:
        raise AssertionError(f"counted Newton–Schulz FLOPs {flops} differ from the planner's")
    for r in ranks:
        if r["bytes_per_step"] != r["bytes_planned"]:
            raise AssertionError(f"rank {r['rank']}: moved {r['bytes_per_step']} != planned")
    return {
        "optimizer_step_s_rank0": r0,
        "optimizer_step_s_slowest_rank": slowest,
        "optimizer_step_muon_over_adamw": slowest["muon"] / slowest["adamw"],
        "muon_all_to_all_s_per_step_mean": a2a,
        "muon_newton_schulz_s_per_step_mean": ns,
        "redistribution_share_of_muon_step": a2a / step,
        "newton_schulz_share_of_muon_step": ns / step,
        "ns_calls_per_step": [r["ns_calls_per_step"] for r in ranks],
        "ns_flops_per_rank": flops,
        "ns_flops_max_over_mean": max(flops) / statistics.mean(flops),
        "ns_flops_equal_planner": True,
        "bytes_per_step_rank0": ranks[0]["bytes_per_step"],
        "bytes_equal_planner": True,
    }


def llama_1b(ranks: int = 8) -> dict:
    """The planner's Newton–Schulz FLOPs per rank for llama-1b at dp_shard = `ranks`."""
    from depthscale.config.loading import load_config
    from depthscale.plan.layout import Layout
    from depthscale.plan.muon_states import muon_step_work
    from depthscale.shape import ModelShape

    cfg = load_config(ROOT / "configs" / "llama-1b.toml")
    cfg.resolve_vocab_size(32768)
    spec, lay = ModelShape.from_config(cfg.model), Layout(dp_shard=ranks)
    flops = [muon_step_work(spec, lay, 0, 0, r, ns_bytes=2)["ns_flops"] for r in range(ranks)]
    return {
        "ns_tflop_per_rank": [round(f / 1e12, 3) for f in flops],
        "ns_flops_max_over_mean": max(flops) / statistics.mean(flops),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    result = {
        "benchmark": "muon_throughput",
        **device_info(),
        "config": {k: v for k, v in vars(args).items() if k != "out"}
        | {"residual": "block", "threads_per_process": 1},
        "one_process": one_process(args),
        f"dp_shard_{args.world}_gloo": distributed(args),
        "llama_1b_fsdp_8": llama_1b(),
    }
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print_result(result, args.out)


if __name__ == "__main__":
    main()
