"""The LM head and loss under tensor parallelism: vocabulary-parallel vs gathered logits, tp = 2, 4.

    python benchmarks/vocab_parallel.py [--vocab 32768 --dim 256 --seq 512 --batch 2 --tp 2 4]

Spawns `tp` gloo workers per setting and prints ONE JSON object. On every rank the same final hidden
states [B, T/tp, dim] (a sequence shard, as the depth state is under sequence parallelism) go through
the final norm, the LM head and the loss, forward and backward, two ways side by side:

* `vocab_parallel`: what depthscale runs — the head column-parallel over the vocabulary, logits
  [B, T, V/tp] per rank, `TokenLoss` (vocabulary-parallel cross-entropy: 2 all-reduces of B·T floats);
* `gathered`: the logits gathered to the full [B, T, V] on every rank before a plain cross-entropy
  (what depthscale did before, and what a tp layout without a vocabulary-parallel loss pays).

Reported per variant: `logits_bytes_per_rank` (the logits tensor a rank materialises),
`saved_activation_bytes_per_rank` (what autograd keeps for backward between the head and the loss,
measured with saved-tensor hooks: logits or softmax copies), `peak_rss_delta_bytes_per_rank` (Linux
high-water mark over one forward+backward; approximate), `step_s` (median, slowest rank), and the
ratios vocab_parallel / gathered.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.autograd import Function

sys.path.insert(0, str(Path(__file__).parent))
from _common import device_info, peak_rss_delta, run_ranks  # noqa: E402

from depthscale.model.layers import RMSNorm  # noqa: E402
from depthscale.model.transformer import cross_entropy  # noqa: E402
from depthscale.parallel.loss import TokenLoss  # noqa: E402
from depthscale.parallel.tensor_parallel import ColumnParallelLinear, TPContext  # noqa: E402
from depthscale.train.offload import saved_activation_bytes  # noqa: E402


class _GatherVocab(Function):
    """[N, V/tp] slices → [N, V] on every rank; every rank computes the same loss, so backward
    keeps this rank's columns of the (complete) gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        n = grad.shape[-1] // dist.get_world_size(ctx.group)
        r = dist.get_rank(ctx.group)
        return grad[..., r * n : (r + 1) * n].contiguous(), None


def _worker(rank: int, tp: int, args: argparse.Namespace, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=tp)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    group = mesh.get_group()
    torch.manual_seed(0)
    norm = RMSNorm(args.dim)
    head = ColumnParallelLinear(
        torch.nn.Linear(args.dim, args.vocab, bias=False), TPContext(mesh, group, tp, rank, 1)
    )
    params = [norm.weight, head.local_weight()]
    g = torch.Generator().manual_seed(1)
    t = args.seq // tp
    hidden = torch.randn(args.batch, args.seq, args.dim, generator=g)[:, rank * t : (rank + 1) * t]
    labels = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    vocab_loss = TokenLoss(vocab_group=group)
    sizes: dict[str, int] = {}

    def forward(variant: str):
        h = hidden.clone().requires_grad_()
        logits = head(norm(h))
        if variant == "gathered":
            logits = _GatherVocab.apply(logits, group)
            sizes[variant] = logits.numel() * logits.element_size()
            return cross_entropy(logits, labels)
        sizes[variant] = logits.numel() * logits.element_size()
        return vocab_loss(logits, labels)[0]

    variants = ("vocab_parallel", "gathered")
    out: dict = {"rank": rank, "saved": {}, "rss": {}, "times": {v: [] for v in variants}}
    for v in variants:
        out["saved"][v] = saved_activation_bytes(lambda v=v: forward(v), params)
        out["rss"][v] = peak_rss_delta(lambda v=v: forward(v).backward())
        forward(v).backward()  # warm-up
    for _ in range(args.rounds):
        for v in variants:  # interleaved so drift hits both
            dist.barrier()
            t0 = time.perf_counter()
            forward(v).backward()
            out["times"][v].append(time.perf_counter() - t0)
    with torch.no_grad():
        a, b = forward("vocab_parallel").item(), forward("gathered").item()
    out["loss_diff"] = abs(a - b)
    out["logits_bytes"] = dict(sizes)
    queue.put(out)
    dist.barrier()
    dist.destroy_process_group()


def _run(tp: int, args: argparse.Namespace) -> dict:
    ranks = run_ranks(_worker, tp, tp, args)
    variants = ("vocab_parallel", "gathered")
    step = {
        v: statistics.median(max(r["times"][v][i] for r in ranks) for i in range(args.rounds))
        for v in variants
    }
    res = {
        v: {
            "logits_bytes_per_rank": ranks[0]["logits_bytes"][v],
            "saved_activation_bytes_per_rank": max(r["saved"][v] for r in ranks),
            "peak_rss_delta_bytes_per_rank": max(r["rss"][v] or 0 for r in ranks),
            "step_s": round(step[v], 5),
        }
        for v in variants
    }
    ratio = {
        key: round(res["vocab_parallel"][key] / res["gathered"][key], 4)
        for key in ("logits_bytes_per_rank", "saved_activation_bytes_per_rank", "step_s")
        if res["gathered"][key]
    }
    return res | {
        "ratio_vocab_parallel_over_gathered": ratio,
        "max_loss_diff": max(r["loss_diff"] for r in ranks),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    args = ap.parse_args()
    result = {
        "benchmark": "vocab_parallel",
        **device_info(),
        "threads_per_rank": 1,
        "cpu_cores": os.cpu_count(),
        "config": {k: v for k, v in vars(args).items() if k != "tp"},
        "note": (
            "the head and loss only (everything before them is the same in both variants); with "
            "more ranks than cores step_s measures shared cores"
        ),
        "tp": {str(tp): _run(tp, args) for tp in args.tp},
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
