"""Peak host memory per rank at initialisation and in the first training step, per layout.

    python benchmarks/memory.py [--out benchmarks/results/memory_cpu.json]

What (issue #15): for dp_shard ∈ {1, 2, 4} × cp ∈ {1, 2} with dp_shard·cp ≤ 4, every rank (gloo,
CPU, launched like torchrun: `_common.run_ranks`) does what `Trainer.__init__` and
`Trainer.train_step` do — `init_layout`, the model built on the meta device, `parallelize` (pipeline
split, CP, FSDP2 over `dp_shard × cp`, then `materialize`: `to_empty` + `reset_parameters`, one full
parameter drawn at a time and this rank's slice kept), `build_optimizer`, then one step
(`forward_backward`, `reduce_gradients`, `clip_gradients`, `optimizer.step`) — and reports:

- `init_peak`: how far the process's peak RSS rose, during the meta build + `parallelize`, above
  the RSS just before it (process group, mesh and batch already in place; code is not model
  memory, so the modules `parallelize` imports lazily are imported first, and a tiny
  `Transformer` is built on meta first because the first one imports torch._dynamo and triton:
  ≈ 100 MB, reported as `lazy_imports`; first-use costs of FSDP/DTensor are counted). Next to it,
  from the tensors: `own_shard` (Σ local shard numel × element size, `DTensor.to_local()`) and
  `largest_param` (the largest parameter's full shape: what `reset_parameters` draws before
  keeping its slice). The check is
  `init_ratio = init_peak / (own_shard + largest_param) ≤ 1.2`. `init_retained` is the RSS growth
  still there after the build (≈ own_shard if nothing transient leaks).
- `model_state`: this rank's parameters at init; after the step parameters + gradients + optimizer
  states (local shards, from the tensors; gradients counted before the `zero_grad` the trainer does
  next). The check: `state / state(1, 1)` against the ideal 1 / (dp_shard · cp), within 5 %.
- `step_peak`: the RSS high-water growth during that first step (gradients and optimizer states
  being created, gathered FSDP units, activations, gloo buffers).
- For dp_shard = 4 also the old path (the whole model built on every rank, then `parallelize`
  shards it), so the init saving shows side by side.

Why RSS: on CPU there is no allocator statistic like `torch.cuda.max_memory_allocated`, so peaks are
the kernel's: `/proc/self/status` VmHWM after resetting it to the current RSS through
`/proc/self/clear_refs` (`_common.peak_rss_delta`). For that to track tensors, freed tensors must
leave the RSS: the ranks run with `MALLOC_MMAP_THRESHOLD_=65536` (glibc then mmaps every allocation
above 64 KiB and unmaps it on free; by default the threshold grows adaptively up to 32 MiB and freed
blocks below it stay in the heap), and the trainer's `train.keep_host_memory` (which keeps freed
memory on purpose) is not used. Tensors below 64 KiB (norm gains, AttnRes queries) come from the
heap and are part of the noise. The batch is random tokens (the data pipeline is not what is
measured). The model is sized so that its weights (≈ 170 MB fp32, an untied 16k × 512 embedding and
head the largest parameters) dwarf that noise of a few MB; one layout runs in a few seconds.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import _rss_kib, device_info, peak_rss_delta, run_ranks  # noqa: E402

DIM, LAYERS, HEADS, VOCAB, SEQ, BATCH = 512, 8, 8, 16384, 64, 4
"""BATCH: sequences per data-parallel rank (cp ranks share theirs, each holding a sequence shard)."""
LAYOUTS = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)]
OLD_PATH_LAYOUTS = [(4, 1)]
MMAP_THRESHOLD = 65536
INIT_BOUND = 1.2
STATE_TOLERANCE = 0.05
RESULTS = Path(__file__).resolve().parent / "results" / "memory_cpu.json"


def _overrides(dp_shard: int, cp: int, dim: int = DIM, vocab: int = VOCAB) -> list[str]:
    return [
        *("--model.dim", str(dim), "--model.n_layers", str(LAYERS)),
        *("--model.n_heads", str(HEADS), "--model.vocab_size", str(vocab)),
        *("--model.max_seq_len", str(SEQ), "--data.seq_len", str(SEQ)),
        *("--model.tie_embeddings", "false"),  # embedding and head: the two largest parameters
        *("--model.residual", "block", "--model.attnres_n_blocks", "4"),
        *("--train.device", "cpu", "--train.dtype", "float32"),
        *("--train.keep_host_memory", "false"),  # (the trainer's; not applied here anyway)
        *("--train.batch_size", str(BATCH * dp_shard), "--train.micro_batch_size", str(BATCH)),
        *("--parallel.dp_shard", str(dp_shard), "--parallel.cp", str(cp)),
        *("--parallel.nproc", str(dp_shard * cp)),
    ]


def _bytes(tensors) -> int:
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
    # what parallelize() imports lazily: module code is loaded before the measurement
    import depthscale.parallel.context_parallel
    import depthscale.parallel.data_parallel  # noqa: F401
    from depthscale.config import load_config
    from depthscale.model.transformer import Transformer
    from depthscale.parallel.parallelize import init_layout, parallelize
    from depthscale.train.optim import build_optimizer
    from depthscale.train.setup import seed_everything

    cfg = load_config(None, _overrides(dp_shard, cp))
    layout = init_layout(cfg, torch.device("cpu"))
    seed_everything(cfg.train.seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    built: dict = {}

    def build() -> None:  # Trainer.__init__'s two lines (old path: a real model first)
        if old_path:
            model = Transformer(cfg.model)
        else:
            with torch.device("meta"):
                model = Transformer(cfg.model)
        built["plan"] = parallelize(model, layout.mesh, layout.dims, cfg, device=layout.device)
        built["model"] = model

    # one-time process cost, not model memory: the first Transformer() imports torch._dynamo and
    # triton lazily (~100 MB of module objects and library pages), so a tiny one is built first
    lazy = _rss_kib("VmRSS")
    with torch.device("meta"):
        Transformer(load_config(None, _overrides(dp_shard, cp, dim=64, vocab=256)).model)
    lazy = (_rss_kib("VmRSS") - lazy) * 1024
    gc.collect()
    before = _rss_kib("VmRSS")
    init_peak = peak_rss_delta(build)
    init_retained = (_rss_kib("VmRSS") - before) * 1024
    model, plan = built["model"], built["plan"]
    params = list(model.parameters())
    own = _bytes(params)
    largest = max(p.numel() * p.element_size() for p in params)
    optimizer = build_optimizer(model, cfg.optim)

    def step() -> None:  # Trainer.train_step, without the logging reductions
        plan.forward_backward(model, tokens[:, :-1], tokens[:, 1:])
        plan.reduce_gradients()
        plan.clip_gradients(cfg.train.grad_clip)
        optimizer.step()

    step_peak = peak_rss_delta(step)
    grads = _bytes(p.grad for p in params if p.grad is not None)
    moments = _bytes(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    queue.put(
        {
            "rank": rank,
            "init_peak": init_peak,
            "init_retained": init_retained,
            "lazy_imports": lazy,
            "own_shard": own,
            "largest_param": largest,
            "init_ratio": init_peak / (own + largest),
            "state": {"params": own, "grads": grads, "optimizer": moments},
            "step_peak": step_peak,
        }
    )
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


def _mb(n: float) -> float:
    return round(n / 1e6, 3)


def _row(dp_shard: int, cp: int, old: bool, ranks: list[dict]) -> dict:
    state = [sum(r["state"].values()) for r in ranks]
    return {
        "dp_shard": dp_shard,
        "cp": cp,
        "path": "old: materialised, then sharded" if old else "meta, sharded init",
        "largest_param_mb": _mb(ranks[0]["largest_param"]),
        "per_rank": {
            "init_peak_mb": [_mb(r["init_peak"]) for r in ranks],
            "init_retained_mb": [_mb(r["init_retained"]) for r in ranks],
            "lazy_imports_mb": [_mb(r["lazy_imports"]) for r in ranks],
            "own_shard_mb": [_mb(r["own_shard"]) for r in ranks],
            "init_ratio": [round(r["init_ratio"], 4) for r in ranks],
            "step_peak_mb": [_mb(r["step_peak"]) for r in ranks],
            "model_state_bytes_init": [r["own_shard"] for r in ranks],
            "model_state_bytes_after_step": [
                {**r["state"], "total": t} for r, t in zip(ranks, state)
            ],
        },
        "init_peak_mb": max(_mb(r["init_peak"]) for r in ranks),
        "init_ratio": round(max(r["init_ratio"] for r in ranks), 4),
        "step_peak_mb": max(_mb(r["step_peak"]) for r in ranks),
        "model_state_mb_after_step": _mb(max(state)),
        "_state": max(state),
        "_init_state": max(r["own_shard"] for r in ranks),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS, help="where to save the JSON too")
    args = ap.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)  # inherited by the spawned ranks
    runs = [(d, c, False) for d, c in LAYOUTS] + [(d, c, True) for d, c in OLD_PATH_LAYOUTS]
    rows = []
    for dp_shard, cp, old in runs:
        ranks = run_ranks(_rank, dp_shard * cp, dp_shard * cp, dp_shard, cp, old)
        rows.append(_row(dp_shard, cp, old, ranks))
    base_state, base_init = rows[0]["_state"], rows[0]["_init_state"]
    checks = []
    for row in rows:
        n = row["dp_shard"] * row["cp"]
        row["ideal_state_ratio"] = round(1 / n, 4)
        row["state_ratio"] = round(row.pop("_state") / base_state, 4)
        row["init_state_ratio"] = round(row.pop("_init_state") / base_init, 4)
        if row["path"].startswith("old"):
            new = next(r for r in rows if (r["dp_shard"], r["cp"]) == (row["dp_shard"], row["cp"]))
            row["init_peak_new_over_old"] = round(new["init_peak_mb"] / row["init_peak_mb"], 4)
            continue
        row["init_check"] = "pass" if row["init_ratio"] <= INIT_BOUND else "FAIL"
        within = abs(row["state_ratio"] * n - 1) <= STATE_TOLERANCE
        row["state_check"] = "pass" if within else "FAIL"
        checks += [row["init_check"], row["state_check"]]
    out = {
        "benchmark": "memory",
        **device_info(),
        "config": {
            "model": {
                "dim": DIM,
                "n_layers": LAYERS,
                "n_heads": HEADS,
                "vocab_size": VOCAB,
                "tie_embeddings": False,
                "residual": "block",
                "attnres_n_blocks": 4,
                "dtype": "float32",
            },
            "params_mb": rows[0]["per_rank"]["own_shard_mb"][0],
            "seq_len": SEQ,
            "batch_per_dp_rank": BATCH,
            "optimizer": "adamw",
            "backend": "gloo, one thread per rank",
        },
        "measure": (
            f"peak RSS growth (VmHWM reset via /proc/self/clear_refs), MALLOC_MMAP_THRESHOLD_="
            f"{MMAP_THRESHOLD}, keep_host_memory off; own shard, largest parameter and model "
            "state from the tensors (DTensor.to_local)"
        ),
        "checks": {
            "init": f"init_peak <= {INIT_BOUND} x (own_shard + largest_param), worst rank",
            "state": (
                f"state_ratio = worst rank's params+grads+optimizer / the (1,1) layout's, within "
                f"{STATE_TOLERANCE:.0%} of 1/(dp_shard*cp)"
            ),
            "all_pass": all(c == "pass" for c in checks),
        },
        "rows": rows,
    }
    text = json.dumps(out, indent=1)
    print(text)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
