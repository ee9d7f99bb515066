"""What a Mixture-of-Experts FFN costs, side by side in one run (`model/moe.py`).

    python benchmarks/moe.py [--rounds 5 --out benchmarks/results/moe_cpu.json]

1. Training step time (forward + backward, one process) of an MoE model (8 experts, top 2, block
   AttnRes) against a dense model of the same active parameters (its FFN as wide as two experts):
   the MoE's routing, sorting and per-group GEMMs over the dense GEMMs.
2. The experts' GEMMs (forward + backward) as one grouped GEMM (`torch._grouped_mm`, where this
   build has it on this device) against one matmul per expert: the grouped/loop ratio.
3. Expert parallelism on two gloo processes (ep = 2): the all-to-all payload (every call's input,
   the planner's convention) of a training step of one MoE layer, counted at
   `all_to_all_single`, against the planner's (`plan.comm.moe_payload`): equal summed over the
   ep group whatever the routing, and on each rank off by its routing's imbalance.

Prints one JSON object; `--out` also writes it. Absolute times only mean something on a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import device_info, interleaved_times, print_result, run_ranks  # noqa: E402

from depthscale.config import ModelConfig  # noqa: E402
from depthscale.model import moe  # noqa: E402
from depthscale.model.transformer import Transformer  # noqa: E402
from depthscale.shape import ModelShape  # noqa: E402

DIM, LAYERS, EXPERTS, TOP_K, EXPERT_FFN, SEQ, BATCH, VOCAB = 256, 4, 8, 2, 384, 256, 4, 512


def _model(dense: bool) -> Transformer:
    torch.manual_seed(0)
    kw = dict(vocab_size=VOCAB, dim=DIM, n_layers=LAYERS, n_heads=4, max_seq_len=SEQ)
    kw |= dict(residual="block", attnres_n_blocks=2)
    if dense:
        return Transformer(ModelConfig(**kw, ffn_dim=TOP_K * EXPERT_FFN))
    moe_kw = dict(moe_experts=EXPERTS, moe_top_k=TOP_K, moe_ffn_dim=EXPERT_FFN)
    return Transformer(ModelConfig(**kw, **moe_kw))


def step_times(rounds: int) -> dict:
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    models = {"moe": _model(False), "dense_equal_active": _model(True)}

    def step(m):
        def run():
            F.cross_entropy(m(tokens).flatten(0, 1), tokens.flatten()).backward()
            m.zero_grad(set_to_none=True)

        return run

    times = interleaved_times({k: step(m) for k, m in models.items()}, rounds)
    total = models["moe"].num_params()
    return {
        "step_s": {k: round(v, 4) for k, v in times.items()},
        "moe_over_dense": round(times["moe"] / times["dense_equal_active"], 3),
        "moe_params": total,
        "moe_active_params": total - ModelShape.from_config(models["moe"].cfg).idle_params(),
        "dense_params": models["dense_equal_active"].num_params(),
    }


def grouped_vs_loop(rounds: int) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(2)
    counts = torch.bincount(torch.randint(0, EXPERTS, (BATCH * SEQ * TOP_K,), generator=g))
    rows = int(counts.sum())
    x = torch.randn(rows, DIM, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(EXPERTS, DIM, EXPERT_FFN, generator=g) * 0.05).to(device, dtype)
    w.requires_grad_()
    counts = counts.to(device)
    upstream = torch.randn(rows, EXPERT_FFN, generator=g).to(device, dtype)

    def run(path):
        def go():
            torch.autograd.grad(moe.grouped_mm(x, w, counts, path=path), (x, w), upstream)

        return go

    fns = {"loop": run("loop")}
    try:
        run("grouped")()
        fns["grouped"] = run("grouped")
    except (RuntimeError, NotImplementedError) as err:
        unavailable = f"{type(err).__name__}: {str(err).splitlines()[0][:100]}"
    times = interleaved_times(fns, rounds)
    out = {"rows": rows, "experts": EXPERTS, "dtype": str(dtype).removeprefix("torch.")}
    out |= {f"{k}_s": round(v, 5) for k, v in times.items()}
    if "grouped" in times:
        out["grouped_over_loop"] = round(times["grouped"] / times["loop"], 3)
    else:
        out["grouped"] = f"unavailable here ({unavailable})"
    return out


def _a2a_rank(rank: int, port: int, queue) -> None:
    import torch.distributed as dist

    from depthscale.parallel.expert_parallel import AllToAllDispatch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    sent = [0]
    real = dist.all_to_all_single

    def counting(out, inp, out_splits=None, in_splits=None, group=None):
        sent[0] += inp.numel() * inp.element_size()
        return real(out, inp, out_splits, in_splits, group=group)

    dist.all_to_all_single = counting
    torch.manual_seed(0)
    cfg = ModelConfig(dim=DIM, moe_experts=EXPERTS, moe_top_k=TOP_K, moe_ffn_dim=EXPERT_FFN)
    layer = moe.MoE(cfg)
    with torch.no_grad():
        layer.experts.w_gate.data = layer.experts.w_gate.data[rank * 4 : rank * 4 + 4].normal_(
            0, 0.05
        )
        layer.experts.w_up.data = layer.experts.w_up.data[rank * 4 : rank * 4 + 4].normal_(0, 0.05)
        layer.experts.w_down.data = layer.experts.w_down.data[rank * 4 : rank * 4 + 4].normal_(
            0, 0.05
        )
        layer.router.weight.normal_(0, 0.05)
    layer.dispatcher = AllToAllDispatch(dist.group.WORLD, EXPERTS)
    x = torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(rank + 3))
    layer(x.requires_grad_()).sum().backward()
    from depthscale.plan.comm import moe_payload
    from depthscale.plan.layout import Layout

    spec = ModelShape.from_config(cfg)
    planned = moe_payload(spec, Layout(dp_shard=2, ep=2), [], 1, BATCH * SEQ, 4)
    queue.put({"rank": rank, "counted": sent[0], "planned": planned["all_to_all", "dp_shard"]})
    dist.destroy_process_group()


def all_to_all() -> dict:
    ranks = run_ranks(_a2a_rank, 2)
    planned = ranks[0]["planned"]
    return {
        "ep": 2,
        "tokens_per_rank": BATCH * SEQ,
        "counted_bytes": [r["counted"] for r in ranks],
        "planned_bytes_per_rank": planned,
        "counted_over_planned": [round(r["counted"] / planned, 4) for r in ranks],
        "group_counted_over_planned": sum(r["counted"] for r in ranks) / (2 * planned),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out")
    args = p.parse_args()
    result = {
        "device": device_info(),
        "shapes": {
            "dim": DIM,
            "layers": LAYERS,
            "experts": EXPERTS,
            "top_k": TOP_K,
            "expert_ffn": EXPERT_FFN,
            "seq": SEQ,
            "batch": BATCH,
        },  # fmt: skip
        "step": step_times(args.rounds),
        "experts_gemm": grouped_vs_loop(args.rounds),
        "all_to_all": all_to_all(),
    }
    print_result(result, args.out)


if __name__ == "__main__":
    main()
