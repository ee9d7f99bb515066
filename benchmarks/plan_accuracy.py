"""`depthscale plan`'s time model against measured training steps on this machine (CPU, gloo).

    python benchmarks/plan_accuracy.py [--dim 256 --layers 4 --seq 256 --batch 8 --steps 3
                                        --rounds 3 --out benchmarks/results/plan_accuracy_cpu.json]

Each pass measures this machine's gloo collectives for jobs of 2 and 4 local ranks
(`parallel.calibrate.measure_links`: latency and bandwidth), then trains every layout
(`Trainer.fit`, the trainer's real loop) and right after each run measures the compute rates for
its rank count (`measure_compute`: GEMM rate by shape, attention, memory bandwidth): this shared
machine's speed drifts by 20 % and more over the minutes a pass takes, and a rate taken minutes
away prices a run at another moment's speed. A layout's step time — the median over rounds and
passes of the slowest rank — is compared with the median over passes of the plan's prediction
for the same model, batch and layout on the passes' median collectives and the compute rates
measured beside that pass's run (framework `depthscale` without communication overlap: on gloo
the collectives run on the cores that compute). Prints JSON: per layout measured and predicted
seconds and their ratio, Spearman's rank correlation, the median absolute error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import device_info, run_ranks  # noqa: E402

from depthscale.config import ModelConfig  # noqa: E402
from depthscale.parallel.calibrate import describe, measure_compute, measure_links  # noqa: E402
from depthscale.plan.estimate import Workload, estimate  # noqa: E402
from depthscale.plan.frameworks import DEPTHSCALE  # noqa: E402
from depthscale.plan.hardware import Cluster  # noqa: E402
from depthscale.plan.layout import Layout  # noqa: E402
from depthscale.shape import ModelShape  # noqa: E402

LAYOUTS: list[dict[str, int | str]] = [
    {},
    {"recompute": "full"},
    {"dp_replicate": 2},
    {"dp_shard": 2},
    {"tp": 2},
    {"tp": 2, "recompute": "full"},
    {"cp": 2},
    {"pp": 2},
    {"pp": 2, "pp_virtual": 2},
    {"pp": 2, "micro_batch_size": 4},
    {"dp_shard": 4},
    {"tp": 2, "dp_shard": 2},
    {"cp": 2, "dp_shard": 2},
    {"pp": 2, "tp": 2},
]
"""Parallel dimensions (`--parallel.*`), and recompute and micro-batch (`--train.*`): layouts
whose step times differ by what the plan models (communication, bubble, recompute), so that the
ranking is a test of the model rather than of the machine's noise between near-equal ones."""
TRAIN_KEYS = ("recompute", "micro_batch_size")
GLOO = dataclasses.replace(
    DEPTHSCALE,
    name="depthscale-gloo",
    tp_overlap=False,
    pp_overlap=False,
    dp_overlap=False,
    cp_overlap=False,
)


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--residual", default="block")
    p.add_argument("--passes", type=int, default=3, help="runs of every layout, order alternating")
    p.add_argument("--out")
    return p.parse_args()


def _worker(rank: int, world: int, args, layout: dict, work: str, port: int, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - the trainer's lines; the JSON is ours
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    from depthscale.config import load_config
    from depthscale.train.trainer import Trainer

    total = args.warmup + args.steps * args.rounds
    run_dir = f"{work}/run-" + "-".join(f"{k}{v}" for k, v in layout.items())
    overrides = [
        *("--data.path", f"{work}/corpus.txt", "--data.seq_len", str(args.seq)),
        *("--model.dim", str(args.dim), "--model.n_layers", str(args.layers)),
        *("--model.n_heads", str(args.heads), "--model.residual", args.residual),
        *("--model.attnres_n_blocks", "2"),
        *("--train.batch_size", str(args.batch), "--train.steps", str(total + 2)),
        *("--train.eval_every", "0", "--checkpoint.every", "0", "--optim.warmup_steps", "2"),
        *("--logging.progress", "false", "--logging.tensorboard", "false"),
        *("--logging.peak_tflops", "1", "--train.run_dir", run_dir),
    ]
    for name, value in layout.items():
        section = "train" if name in TRAIN_KEYS else "parallel"
        overrides += [f"--{section}.{name}", str(value)]
    trainer = Trainer(load_config(None, overrides))
    starts: dict[int, float] = {}
    begin = trainer.telemetry.begin_step

    def begin_step(step: int) -> None:
        starts[step] = time.perf_counter()
        begin(step)

    trainer.telemetry.begin_step = begin_step
    trainer.fit(stop_at=total + 1)
    edges = [starts[args.warmup + 1 + r * args.steps] for r in range(args.rounds + 1)]
    seconds = [(b - a) / args.steps for a, b in zip(edges, edges[1:])]
    cfg = trainer.cfg
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    queue.put(
        {
            "rank": rank,
            "seconds": seconds,
            "vocab": cfg.model.vocab_size,
            "ffn": cfg.model.hidden_dim,
            "micro_batch": args.batch
            // (cfg.parallel.dp_replicate * cfg.parallel.dp_shard * cfg.grad_accum_steps),
            "recompute": cfg.train.recompute,
        }
    )


def _spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for pos, i in enumerate(order):
            r[i] = float(pos)
        return r

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    d2 = sum((a - b) ** 2 for a, b in zip(rx, ry, strict=True))
    return 1 - 6 * d2 / (n * (n * n - 1))


def main() -> None:
    args = _args()
    worlds = sorted({_world(lay) for lay in LAYOUTS})
    calibrations: dict[int, list[dict]] = {n: [] for n in worlds}  # collectives per pass
    rows = []
    with tempfile.TemporaryDirectory() as work:
        os.environ.setdefault("DEPTHSCALE_CACHE", f"{work}/cache")
        Path(work, "corpus.txt").write_text(
            "".join(
                f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(20000)
            )
        )
        runs: dict[int, list] = {i: [] for i in range(len(LAYOUTS))}
        beside: dict[int, list[dict]] = {i: [] for i in range(len(LAYOUTS))}
        order = list(range(len(LAYOUTS)))
        for p in range(args.passes):  # alternate the order: drift hits every layout alike
            for n in worlds:  # every pass: the collectives are the median over the run
                calibrations[n].append(measure_links(n))
            for i in order if p % 2 == 0 else order[::-1]:
                world = _world(LAYOUTS[i])
                runs[i].append(run_ranks(_worker, world, world, args, LAYOUTS[i], work))
                beside[i].append(measure_compute(world, budget_s=0.5))
        links = {n: _median_of(calibrations[n]) for n in worlds}
        for i, layout in enumerate(LAYOUTS):
            world = _world(layout)
            measured = statistics.median(
                max(r["seconds"][k] for r in results)
                for results in runs[i]
                for k in range(args.rounds)
            )
            r0 = runs[i][0][0]
            spec = ModelShape.from_config(
                ModelConfig(
                    vocab_size=r0["vocab"], dim=args.dim, n_layers=args.layers,
                    n_heads=args.heads, residual=args.residual, attnres_n_blocks=2,
                )
            )  # fmt: skip
            lay = Layout(
                tp=layout.get("tp", 1), pp=layout.get("pp", 1), v=layout.get("pp_virtual", 1),
                cp=layout.get("cp", 1), dp_shard=layout.get("dp_shard", 1),
                dp_replicate=layout.get("dp_replicate", 1), micro_batch=r0["micro_batch"],
                recompute=r0["recompute"],
            )  # fmt: skip
            work_ = Workload(spec, args.seq, args.batch, "float32")
            ests = [
                estimate(work_, _cluster(world, rates, links[world]), lay, GLOO, world)
                for rates in beside[i]
            ]
            est = sorted(ests, key=lambda e: e.step_s)[len(ests) // 2]  # the median prediction
            peaks = [round(r["peak_flops"]["float32"] / 1e9, 1) for r in beside[i]]
            rows.append({"layout": layout, "ranks": world, "measured_s": round(measured, 4),
                         "predicted_s": round(est.step_s, 4), "ok": est.ok, "reason": est.reason,
                         "ratio": round(est.step_s / measured, 3), "gflops_beside": peaks,
                         "predicted_parts_s": {k: round(v, 4) for k, v in est.times.items()}})  # fmt: skip
    errors = [abs(r["ratio"] - 1) for r in rows]
    report = {
        **device_info(),
        "config": vars(args),
        "collectives": links,
        "layouts": rows,
        "spearman": round(
            _spearman([r["measured_s"] for r in rows], [r["predicted_s"] for r in rows]), 3
        ),
        "median_abs_error": round(statistics.median(errors), 3),
        "max_abs_error": round(max(errors), 3),
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


def _cluster(nproc: int, rates: dict, links: dict) -> Cluster:
    """The cluster of a `measure_compute` result and the run's median collectives."""
    fields = describe(nproc, rates, links)
    return Cluster(**{k: v for k, v in fields.items() if k != "measured"})


def _median_of(values: list):
    """The element-wise median of equally shaped calibrations (numbers, nested in dicts and
    lists; anything else taken from the first): a shared machine drifts over the minutes a run
    takes, and one calibration at its start would price every layout at that moment's speed."""
    first = values[0]
    if isinstance(first, bool) or not isinstance(first, int | float | dict | list | tuple):
        return first
    if isinstance(first, dict):
        return {k: _median_of([v[k] for v in values]) for k in first}
    if isinstance(first, list | tuple):
        return type(first)(_median_of([v[i] for v in values]) for i in range(len(first)))
    return statistics.median(values)


def _world(layout: dict[str, int]) -> int:
    n = 1
    for key in ("tp", "pp", "cp", "dp_shard", "dp_replicate"):
        n *= int(layout.get(key, 1))
    return n


if __name__ == "__main__":
    main()
