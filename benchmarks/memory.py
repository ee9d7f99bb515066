"""Peak memory per rank at initialisation and in the first training step, per layout.

For dp_shard ∈ {1, 2, 4} × cp ∈ {1, 2} (dp_shard · cp ≤ 4), every rank (gloo, CPU, launched like
torchrun) builds the model the way the trainer does — on the meta device, then `parallelize`
splits/shards it and materialises only this rank's shards — and reports:

- `init_peak`: how far the peak RSS rose above the RSS just before the build (process group, mesh
  and imports already in place), next to what the rank must hold: its own parameter shards plus, at
  most, the one full parameter `reset_parameters` draws before keeping its slice. The check is
  `init_peak ≤ 1.2 × (own shard + largest parameter)`.
- `state`: parameters + gradients + optimizer states of this rank after one AdamW step, counted
  from the tensors (local shards), and `step_peak`, the RSS growth during that step.
- For dp_shard = 4 also the old path (the whole model materialised on every rank, then sharded),
  so the init saving is visible side by side.

On CPU there is no allocator statistic, so peaks are RSS (`/proc/self/status` VmHWM, reset through
`/proc/self/clear_refs`). Freed tensors must leave the RSS for that to mean anything: the ranks run
with `MALLOC_MMAP_THRESHOLD_=65536` (tensors above 64 KiB are mmapped and returned to the OS when
freed), and the trainer's `keep_host_memory` is not used. The model is sized so that its weights
(≈ 60 MB in fp32) dwarf the RSS noise of a few MB.

    python benchmarks/memory.py            # prints JSON; results/memory_cpu.json holds a run
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import peak_rss_delta, run_ranks  # noqa: E402

DIM, LAYERS, HEADS, VOCAB, SEQ, BATCH = 512, 4, 8, 16384, 64, 4
LAYOUTS = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)]


def _config(dp_shard: int, cp: int):
    from depthscale.config import Config

    cfg = Config()
    m = cfg.model
    m.dim, m.n_layers, m.n_heads, m.vocab_size, m.max_seq_len = DIM, LAYERS, HEADS, VOCAB, SEQ
    m.tie_embeddings = False  # the embedding and the head: the two largest parameters
    m.residual, m.attnres_n_blocks = "block", 2
    cfg.parallel.dp_shard, cfg.parallel.cp = dp_shard, cp
    cfg.train.batch_size, cfg.train.micro_batch_size = BATCH * dp_shard, BATCH
    return cfg


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def _rank(rank: int, world: int, dp_shard: int, cp: int, old_path: bool, port: int, queue) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch

    torch.set_num_threads(1)
    from depthscale.model.transformer import Transformer
    from depthscale.parallel.mesh import ParallelDims, init_distributed
    from depthscale.parallel.parallelize import parallelize
    from depthscale.train.optim import build_optimizer

    cfg = _config(dp_shard, cp)
    dims = ParallelDims(dp_shard=dp_shard, cp=cp)
    if world > 1:
        init_distributed("cpu")
    mesh = dims.build_mesh("cpu") if world > 1 else None
    built: dict = {}

    def build(cfg=cfg) -> None:
        torch.manual_seed(0)
        if old_path:
            model = Transformer(cfg.model)
        else:
            with torch.device("meta"):
                model = Transformer(cfg.model)
        built["plan"] = parallelize(model, mesh, dims, cfg, device=torch.device("cpu"))
        built["model"] = model

    # warm-up on a small model of the same shape of code: what a first build also pays (lazy
    # imports of FSDP/DTensor modules, their Python objects) is not the model's memory
    small = _config(dp_shard, cp)
    small.model.dim, small.model.vocab_size = 64, 256
    build(small)
    built.clear()
    init_peak = peak_rss_delta(build)
    model, plan = built["model"], built["plan"]
    own = _local_bytes(model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    optimizer = build_optimizer(model, cfg.optim)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))

    def step() -> None:
        plan.forward_backward(model, tokens[:, :-1], tokens[:, 1:])
        plan.reduce_gradients()
        plan.clip_gradients(1.0)
        optimizer.step()

    step_peak = peak_rss_delta(step)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    moments = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    queue.put(
        {
            "rank": rank,
            "init_peak": init_peak,
            "own_shard": own,
            "largest_param": largest,
            "init_ratio": init_peak / (own + largest),
            "state": own + _local_bytes(grads) + _local_bytes(moments),
            "step_peak": step_peak,
        }
    )
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


def main() -> None:
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned ranks
    rows = []
    runs = [(d, c, False) for d, c in LAYOUTS] + [(4, 1, True)]
    for dp_shard, cp, old in runs:
        ranks = run_ranks(_rank, dp_shard * cp, dp_shard * cp, dp_shard, cp, old)
        rows.append(
            {
                "dp_shard": dp_shard,
                "cp": cp,
                "path": "materialised, then sharded (old)" if old else "meta, sharded init",
                "init_peak_mb": max(r["init_peak"] for r in ranks) / 1e6,
                "own_shard_mb": max(r["own_shard"] for r in ranks) / 1e6,
                "largest_param_mb": ranks[0]["largest_param"] / 1e6,
                "init_ratio": max(r["init_ratio"] for r in ranks),
                "state_mb": max(r["state"] for r in ranks) / 1e6,
                "step_peak_mb": max(r["step_peak"] for r in ranks) / 1e6,
            }
        )
    base = rows[0]["state_mb"]
    for row in rows:
        row["state_vs_one_rank"] = row["state_mb"] / base
        row["ideal"] = 1 / (row["dp_shard"] * row["cp"])
        if row["path"].startswith("meta"):
            row["init_check"] = "pass" if row["init_ratio"] <= 1.2 else "FAIL"
    out = {
        "benchmark": "memory",
        "model": {"dim": DIM, "n_layers": LAYERS, "vocab": VOCAB, "residual": "block"},
        "batch_per_rank": BATCH,
        "seq_len": SEQ,
        "measure": "peak RSS growth (VmHWM), MALLOC_MMAP_THRESHOLD_=65536; state from tensors",
        "rows": rows,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
