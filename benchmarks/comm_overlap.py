"""MegaScale TP/SP communication overlap: step time with and without chunked overlap, side by side.

    python benchmarks/comm_overlap.py [--tp 2 --chunks 4 --dim 256 --layers 4 --seq 256 --batch 4]

Launches itself on `--tp` gloo processes (torch.multiprocessing spawn) and prints ONE JSON object from
rank 0: the median training-step time (forward + backward + replicated-gradient sync) of the same
sequence-parallel model with `chunks=1` (one all-gather before the column-parallel GEMMs, one
reduce-scatter after the row-parallel GEMMs) and with `chunks=--chunks` (collectives fused into the
GEMMs and pipelined piece by piece), measured in interleaved rounds; their ratio; and the collectives
each issues per step (from `tp_comm.count_collectives`, checked against `collectives_per_step`).

On CPU with gloo the overlap cannot show GPU-like gains: gloo runs its collectives on CPU threads that
compete with the GEMMs for the same cores (here two processes already share them), and chunking adds
collectives (k per sublayer instead of 1) whose fixed latency is not hidden by anything. On GPUs the
collectives run on the NICs / NVLink copy engines while SMs compute, which is what the overlap exploits.
This benchmark measures the cost and checks the machinery; it is not evidence of a speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from _common import device_info, free_port, interleaved_times  # noqa: E402


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(args.tp),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(args.threads)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from depthscale.config import ModelConfig
    from depthscale.model.transformer import Transformer
    from depthscale.parallel.loss import TokenLoss
    from depthscale.parallel.mesh import destroy_distributed, init_distributed
    from depthscale.parallel.tensor_parallel import (
        apply_tensor_parallel,
        collectives_per_step,
        tp_sync_replicated_grads,
    )
    from depthscale.parallel.tp_comm import count_collectives

    init_distributed("cpu")
    mesh = init_device_mesh("cpu", (args.tp,), mesh_dim_names=("tp",))
    cfg = ModelConfig(
        vocab_size=args.vocab,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        max_seq_len=args.seq,
        residual=args.residual,
        attnres_n_blocks=max(1, args.layers // 2),
        parallel_block=args.parallel_block,
    )
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]
    variants = {"unchunked": 1, f"chunks_{args.chunks}": args.chunks}
    loss_fn = TokenLoss(vocab_group=mesh.get_group())  # the logits are vocabulary slices
    models, steps, counts = {}, {}, {}
    for name, chunks in variants.items():
        torch.manual_seed(0)
        model = Transformer(cfg)
        apply_tensor_parallel(model, mesh, chunks=chunks)
        models[name] = model

        def step(model=model) -> None:
            loss_fn(model(x), y)[0].backward()
            tp_sync_replicated_grads(model)
            for p in model.parameters():
                p.grad = None

        steps[name] = step
        with count_collectives() as step_counts:
            step()
        counts[name] = dict(step_counts)
        assert counts[name] == collectives_per_step(cfg, chunks), (counts[name], chunks)
    with torch.no_grad():  # both variants compute the same function (on this vocabulary slice)
        a, b = (m(x) for m in models.values())
        max_logit_diff = (a - b).abs().max().item()
    times = interleaved_times(steps, args.rounds)
    if rank == 0:
        names = list(variants)
        result = {
            "benchmark": "comm_overlap",
            **device_info(),
            "backend": dist.get_backend(),
            "config": {k: v for k, v in vars(args).items() if k != "rounds"}
            | {"rounds": args.rounds},
            "step_time_s": times,
            "step_time_ratio": {f"{names[1]}/unchunked": times[names[1]] / times[names[0]]},
            "collectives_per_step": counts,
            "max_logit_diff": max_logit_diff,
            "note": "CPU gloo: collectives share the cores with the GEMMs; no GPU-like overlap gain expected",
        }
        print(json.dumps(result, indent=1))
    destroy_distributed()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--residual", default="block", choices=["standard", "block", "full"])
    ap.add_argument("--parallel-block", action="store_true")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    args = ap.parse_args()
    mp.spawn(_worker, args=(args, free_port()), nprocs=args.tp)


if __name__ == "__main__":
    main()
