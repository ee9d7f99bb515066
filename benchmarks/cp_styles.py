"""Ring vs Ulysses vs hybrid context parallelism (`parallel.cp_ulysses`): one training step's time
and the bytes each style moves, at cp = 2 and 4 on gloo, same model and row throughout.

    python benchmarks/cp_styles.py [--seq 4096 --layers 2 --dim 128 --heads 8 --kv-heads 2
                                    --rounds 5 --out FILE]

Styles: cp = 2 ring (u = 1) and Ulysses (u = 2); cp = 4 ring, Ulysses (u = 4) and hybrid (u = 2,
2 Ulysses groups × a ring of 2). Per cp, `cp` gloo workers (one thread each) build one model per
style on one mesh (same seed, same weights) and time the step (forward, backward, the gradient
reduction: `forward_backward` + `reduce_gradients` of the trainer's plan) round by round, styles
interleaved so load on the machine hits every style alike; `step_ms` is the slowest rank's median.
Informational on CPU: a 2-core box runs all ranks on the same cores, so time measures compute and
gloo copying, not a network.

Bytes: one step per style with every `torch.distributed` collective and P2P call counted at the
call (payload bytes per operation: all_to_all, send, recv, all_gather, reduce_scatter, ...) on
every rank, beside the planner's `plan.comm.rank_payload` for the same layout and rank;
`bytes_equal` says they match exactly on every rank. `planner_choice` per cp is `plan.comm.cp_choice`:
each style's wire bytes of the fullest cp rank and the style `depthscale plan` would take. `cp_attention_bytes_per_step` is the
attention part (all-to-all + send, summed over ranks; what differs between styles; FSDP's
gathers and reductions over the cp ranks are the same for all styles), counted and planned;
`cp_wire_bytes_fullest_rank` the same bytes as `cp_choice` weighs them (send + the all-to-all's
(u-1)/u, the busiest rank).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from _common import device_info, print_result, run_ranks  # noqa: E402

from depthscale.parallel.comm_count import counting_payloads  # noqa: E402
from depthscale.plan.comm import cp_choice, rank_payload  # noqa: E402
from depthscale.plan.layout import Layout  # noqa: E402
from depthscale.shape import ModelShape  # noqa: E402

STYLES = {2: {"ring": 1, "ulysses": 2}, 4: {"ring": 1, "ulysses": 4, "hybrid": 2}}
VOCAB = 256


# torch.distributed call -> (operation, argument holding the payload, its position)
def _config(args: argparse.Namespace, cp: int, u: int):
    from depthscale.config import Config

    cfg = Config()
    m = cfg.model
    m.vocab_size, m.dim, m.n_layers, m.n_heads, m.n_kv_heads = (
        VOCAB, args.dim, args.layers, args.heads, args.kv_heads)  # fmt: skip
    m.ffn_dim, m.max_seq_len, m.residual = 2 * args.dim, args.seq, "standard"
    cfg.data.seq_len = args.seq
    cfg.train.batch_size = cfg.train.micro_batch_size = 1
    cfg.parallel.cp, cfg.parallel.cp_ulysses = cp, u
    return cfg.validate()


def _worker(rank: int, cp: int, args: argparse.Namespace, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(cp), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(cp))  # fmt: skip
    torch.set_num_threads(1)
    from depthscale.model.transformer import Transformer
    from depthscale.parallel.mesh import ParallelDims, init_distributed
    from depthscale.parallel.parallelize import parallelize

    init_distributed("cpu")
    dims = ParallelDims(cp=cp).validate(cp)
    mesh = dims.build_mesh("cpu")
    cp_rank = mesh.get_local_rank("cp")
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (1, args.seq + 1), generator=gen)
    styles = {}
    for name, u in STYLES[cp].items():
        cfg = _config(args, cp, u)
        torch.manual_seed(0)
        with torch.device("meta"):
            model = Transformer(cfg.model)
        plan = parallelize(model, mesh, dims, cfg, device=torch.device("cpu"))

        def step(model=model, plan=plan):
            plan.forward_backward(model, tokens[:, :-1], tokens[:, 1:])
            plan.reduce_gradients()
            for p in model.parameters():
                p.grad = None

        step()  # set-up and warm-up
        with counting_payloads(lambda group: "cp") as log:
            step()
        lay = Layout(cp=cp, ulysses=u)
        planned = rank_payload(ModelShape.from_config(cfg.model), lay, args.seq, 1, False,
                               0, cp_rank, cp_rank, 4)  # fmt: skip
        styles[name] = {
            "step": step,
            "counted": {f"{op}/{g}": n for (op, g), n in sorted(log.items())},
            "planned": {f"{op}/{g}": n for (op, g), n in sorted(planned.items()) if n},
        }
    times: dict[str, list[float]] = {name: [] for name in styles}
    for _ in range(args.rounds):
        for name, s in styles.items():  # interleaved: drift hits every style alike
            dist.barrier()
            t0 = time.perf_counter()
            s["step"]()
            times[name].append(time.perf_counter() - t0)
    out = {"rank": rank}
    for name, s in styles.items():
        out[name] = {"times": times[name], "counted": s["counted"], "planned": s["planned"]}
    dist.barrier()
    dist.destroy_process_group()
    queue.put(out)


def _attention(per_op: dict) -> int:
    return sum(n for k, n in per_op.items() if k.split("/")[0] in ("all_to_all", "send"))


def _wire(per_op: dict, u: int) -> float:
    """Bytes on the wire (what `cp_choice` ranks styles by): what the rank sends, and all but its
    own share of what it hands to all-to-alls."""
    return per_op.get("send/cp", 0) + per_op.get("all_to_all/cp", 0) * (u - 1) / u


def _summary(ranks: list[dict], cp: int) -> dict:
    out = {}
    for name, u in STYLES[cp].items():
        rows = [r[name] for r in ranks]
        slowest = [max(ts) for ts in zip(*(r["times"] for r in rows))]
        out[name] = {
            "cp_ulysses": u,
            "step_ms": round(1e3 * statistics.median(slowest), 1),
            "step_ms_rounds": [round(1e3 * t, 1) for t in slowest],
            "cp_attention_bytes_per_step": {
                "counted": sum(_attention(r["counted"]) for r in rows),
                "planned": sum(_attention(r["planned"]) for r in rows),
            },
            "cp_wire_bytes_fullest_rank": {
                "counted": max(_wire(r["counted"], u) for r in rows),
                "planned": max(_wire(r["planned"], u) for r in rows),
            },
            "bytes_per_step_rank0": {"counted": rows[0]["counted"], "planned": rows[0]["planned"]},
            "bytes_equal": all(r["counted"] == r["planned"] for r in rows),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    result = {
        "benchmark": "cp_styles",
        **device_info(),
        "threads_per_rank": 1,
        "shape": {
            "seq": args.seq,
            "batch": 1,
            "layers": args.layers,
            "dim": args.dim,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "vocab": VOCAB,
            "dtype": "float32",
            "residual": "standard",
            "causal": True,
        },
        "rounds": args.rounds,
        "step": "forward + backward + gradient reduction (FSDP over cp), slowest rank, median",
        "cp": {str(cp): _summary(run_ranks(_worker, cp, cp, args), cp) for cp in STYLES},
    }
    spec = ModelShape.from_config(_config(args, 2, 1).model)
    result["planner_choice"] = {  # what `depthscale plan` would take for each layout
        str(cp): cp_choice(spec, Layout(cp=cp), args.seq, 1, False) for cp in STYLES
    }
    result["all_bytes_equal"] = all(s["bytes_equal"] for c in result["cp"].values()
                                    for s in c.values())  # fmt: skip
    print_result(result, args.out)


if __name__ == "__main__":
    main()
