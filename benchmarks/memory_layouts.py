"""Peak memory per rank of one model on four ranks, layout by layout, through the real trainer.

    python benchmarks/memory_layouts.py [--dim 256 --layers 8 --seq 256 --batch 8 --steps 3]

The question (Attention Residuals, last section): full AttnRes keeps every sublayer output as a depth
source, which makes pipelines expensive (every hop carries them), while ZeRO-3 restricted to a shard
group plus CPU offload trains it without pipelining. This compares, on 4 gloo ranks with the same
model dims and batch:

* `full_hsdp_offload`: full AttnRes, HSDP (dp_replicate=2 × dp_shard=2), `train.offload_params`;
* `full_zero3`:        full AttnRes, ZeRO-3 over all 4 ranks (dp_shard=4), no offload;
* `full_hsdp`:         full AttnRes, HSDP, no offload;
* `block_pp`:          Block AttnRes (4 blocks), pp=4 interleaved (V=2), the cross-stage cache on;
* `block_pp_dp`:       Block AttnRes, pp=2 × dp_shard=2.

Per layout and rank, after `--steps` warm-up steps:

* `state_bytes`: parameters, gradients and optimizer states this rank keeps (local shards, measured
  from the tensors), split into `device` and `host` — with offload they live in host memory and a GPU
  holds only the unit being gathered. On this CPU machine both are the same RAM: the split is where
  FSDP2 keeps them, which is what a GPU run would see.
* `peak_rss_delta_bytes`: growth of the process's resident set high-water mark over one training
  step above its level before the step (Linux VmHWM reset; activations, gathered parameters,
  pipeline buffers, communication buffers) — a measurement, allocator effects included.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import device_info, peak_rss_delta, run_ranks  # noqa: E402

LAYOUTS = {
    "full_hsdp_offload": (
        "full",
        [
            "--parallel.dp_replicate",
            "2",
            "--parallel.dp_shard",
            "2",
            "--train.offload_params",
            "true",
        ],
    ),
    "full_zero3": ("full", ["--parallel.dp_shard", "4"]),
    "full_hsdp": ("full", ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "2"]),
    "block_pp": ("block", ["--parallel.pp", "4", "--parallel.pp_virtual", "2"]),
    "block_pp_dp": ("block", ["--parallel.pp", "2", "--parallel.dp_shard", "2"]),
}


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _worker(rank: int, layout: str, args, corpus: str, run_dir: str, port: int, queue) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE="4",
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    from depthscale.config import load_config
    from depthscale.parallel.mesh import destroy_distributed
    from depthscale.train.trainer import Trainer

    residual, extra = LAYOUTS[layout]
    cfg = load_config(
        None,
        [
            *("--data.path", corpus, "--data.tokenizer", "byte"),
            *("--data.seq_len", str(args.seq), "--model.max_seq_len", str(args.seq)),
            *("--model.dim", str(args.dim), "--model.n_layers", str(args.layers)),
            *(
                "--model.n_heads",
                "8",
                "--model.residual",
                residual,
                "--model.attnres_n_blocks",
                "4",
            ),
            *("--train.batch_size", str(args.batch), "--train.micro_batch_size", "1"),
            *("--train.steps", "100", "--train.eval_every", "0", "--train.device", "cpu"),
            *("--checkpoint.every", "0", "--logging.progress", "false"),
            *("--train.run_dir", run_dir, "--parallel.nproc", "4", *extra),
        ],
    )
    trainer = Trainer(cfg)
    for _ in range(args.steps):
        trainer.train_step()
    peak = peak_rss_delta(trainer.train_step)
    offloaded = cfg.train.offload_params
    params = [_local(p) for p in trainer.model.parameters()]
    grads = [_local(p.grad) for p in trainer.model.parameters() if p.grad is not None]
    states = [
        _local(v)
        for s in trainer.optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    ]
    state = {
        name: sum(t.numel() * t.element_size() for t in ts)
        for name, ts in (("params", params), ("grads", grads), ("optimizer", states))
    }
    total = sum(state.values())
    queue.put(
        {
            "rank": rank,
            "state_bytes": state
            | {"device": 0 if offloaded else total, "host": total if offloaded else 0},
            "peak_rss_delta_bytes": peak,
            "params_on": str(params[0].device),
        }
    )
    destroy_distributed()


def _run(layout: str, args, corpus: str) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        ranks = run_ranks(_worker, 4, layout, args, corpus, run_dir)
    return {
        "state_bytes_per_rank": [r["state_bytes"] for r in ranks],
        "peak_rss_delta_bytes_per_rank": [r["peak_rss_delta_bytes"] for r in ranks],
        "max_device_state_bytes": max(r["state_bytes"]["device"] for r in ranks),
        "max_peak_rss_delta_bytes": max(r["peak_rss_delta_bytes"] or 0 for r in ranks),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2, help="warm-up steps before measuring")
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text(
            "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(4000))
        )
        layouts = {name: _run(name, args, str(corpus)) for name in args.layouts}
    result = {
        "benchmark": "memory_layouts",
        **device_info(),
        "ranks": 4,
        "config": {k: v for k, v in vars(args).items() if k != "layouts"},
        "note": (
            "CPU: 'device' and 'host' are the same RAM here; the split says where FSDP2 keeps the "
            "states, which is what bounds a GPU's memory. peak_rss_delta is one step's growth."
        ),
        "layouts": layouts,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
