"""Tokens per second of the trainer's own loop (`Trainer.fit`: data, step, metrics, logging), in
one process or a layout of local gloo ranks.

    python benchmarks/trainer_step.py [--nproc 1 --layout dp_shard=2 --dim 128 --layers 4
                                       --seq 128 --batch 8 --steps 20 --rounds 5]

`train_throughput.py` times the model's step against Hugging Face's; this one times what the
trainer adds around it (the NaN guard, metric reads, straggler rows, prefetching), so that two
revisions can be compared with `compare_revisions.py -- benchmarks/trainer_step.py`. One `fit`;
after `--warmup` untimed steps, a round is `--steps` steps, timed from the start of its first
step to the start of the next round's (all the loop does in between); tokens/s is the median over
rounds of the slowest rank's. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import device_info, run_ranks  # noqa: E402


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--layout", nargs="*", default=[], help="parallel fields, e.g. dp_shard=2")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--residual", default="block")
    return p.parse_args()


def _worker(rank: int, world: int, args, work: str, port: int, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - the trainer's lines; the JSON is the parent's
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    from depthscale.config import load_config
    from depthscale.train.trainer import Trainer

    total = args.warmup + args.steps * args.rounds
    overrides = [
        *("--data.path", f"{work}/corpus.txt", "--data.seq_len", str(args.seq)),
        *("--model.dim", str(args.dim), "--model.n_layers", str(args.layers)),
        *("--model.n_heads", "4", "--model.residual", args.residual),
        *("--train.batch_size", str(args.batch), "--train.steps", str(total + 2)),
        *("--train.eval_every", "0", "--checkpoint.every", "0", "--optim.warmup_steps", "2"),
        *("--logging.progress", "false", "--logging.tensorboard", "false"),
        *("--logging.peak_tflops", "1", "--train.run_dir", f"{work}/run"),
    ]
    for field in args.layout:
        name, value = field.split("=")
        overrides += [f"--parallel.{name}", value]
    trainer = Trainer(load_config(None, overrides))
    starts: dict[int, float] = {}  # when each step began: the loop's whole time between them
    begin = trainer.telemetry.begin_step

    def begin_step(step: int) -> None:
        starts[step] = time.perf_counter()
        begin(step)

    trainer.telemetry.begin_step = begin_step
    trainer.fit(stop_at=total + 1)  # one fit (older revisions cannot resume a finished fit)
    edges = [starts[args.warmup + 1 + r * args.steps] for r in range(args.rounds + 1)]
    seconds = [b - a for a, b in zip(edges, edges[1:])]
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    queue.put({"rank": rank, "seconds": seconds})


def main() -> None:
    args = _args()
    with tempfile.TemporaryDirectory() as work:
        os.environ.setdefault("DEPTHSCALE_CACHE", f"{work}/cache")
        Path(work, "corpus.txt").write_text(
            "".join(
                f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(20000)
            )
        )
        results = run_ranks(_worker, args.nproc, args.nproc, args, work)
    per_round = [max(r["seconds"][i] for r in results) for i in range(args.rounds)]
    tokens = args.batch * args.seq * args.steps
    report = {
        **device_info(),
        "config": {k: v for k, v in vars(args).items()},
        "tokens_per_s": round(statistics.median(tokens / s for s in per_round), 1),
        "tokens_per_s_min": round(min(tokens / s for s in per_round), 1),
        "tokens_per_s_max": round(max(tokens / s for s in per_round), 1),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
