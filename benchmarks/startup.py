"""Start-up time and start-up synchronisations at 2, 4 and 8 local gloo processes, pp = 2 and 4.

Each worker starts a tiny-model Trainer (data, mesh, model, no checkpoint) and trains its first step,
inside `count_synchronizations`; its start-up phases come from RUN/startup/ (the supervisor's
reader), measured from the parent's launch. Then, in the same process, torch's own
`init_device_mesh` of the same shape, with both flattened dimensions, is counted: the group
creations every rank enters that the mesh cost before `own_group` and `mesh.flat` (each one a
store barrier over the world under TORCH_DIST_INIT_BARRIER=1, and before torch 2.1). The
start-up before this change also ran two `dist.barrier`s (after the data, after archiving
traces), now waits for one leader. `grow_with_pipelines`: whether, at a fixed pp, more pipelines
ever meant more groups entered by every rank or more world store barriers (it must not).

    python benchmarks/startup.py [--out benchmarks/results/startup_cpu.json]

One run per (processes, pp) (8 processes share 2 cores here: phase times are oversubscribed wall
times).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from _common import device_info, run_ranks

RUNS = [(2, 2), (4, 2), (4, 4), (8, 2), (8, 4)]
"""(processes, pp): the other processes shard data (dp_shard = processes / pp), so the number
of pipelines is dp_shard."""


def _layout(world: int, pp: int) -> dict:
    return {"pp": pp, "dp_shard": world // pp}


def _worker(rank: int, world: int, layout: dict, run_dir: str, corpus: str, port: int, queue):
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCH_DIST_INIT_BARRIER="1",  # torch < 2.1's behaviour: every group creation a barrier
    )
    import torch

    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh

    from depthscale.config import load_config
    from depthscale.parallel.mesh import DIM_NAMES, FLATTENED, ParallelDims, destroy_distributed
    from depthscale.parallel.startup import count_synchronizations
    from depthscale.train.trainer import Trainer

    args = [
        *("--data.path", corpus, "--data.seq_len", "16", "--train.batch_size", "8"),
        *("--model.dim", "32", "--model.n_layers", "4", "--model.n_heads", "4"),
        *("--model.n_kv_heads", "2", "--train.steps", "2", "--optim.warmup_steps", "1"),
        *("--train.eval_every", "0", "--checkpoint.every", "0", "--logging.progress", "false"),
        *("--logging.tensorboard", "false", "--train.run_dir", run_dir),
    ]
    args += [a for name, v in layout.items() for a in (f"--parallel.{name}", str(v))]
    with count_synchronizations() as now:
        Trainer(load_config(None, args)).fit(stop_at=1)
    dims = ParallelDims(**layout)
    with count_synchronizations() as torch_mesh:
        mesh = init_device_mesh(
            "cpu", tuple(getattr(dims, n) for n in DIM_NAMES), mesh_dim_names=DIM_NAMES
        )
        for name, parts in FLATTENED.items():
            mesh[parts]._flatten(name)
    destroy_distributed()
    queue.put({"rank": rank, "counts": now.summary(), "torch_mesh": torch_mesh.summary()})


def measure(world: int, pp: int, tmp: Path) -> dict:
    from depthscale.observe.startup import startup_phases

    corpus = tmp / "corpus.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox {i * 7}\n" for i in range(300)))
    run_dir = tmp / f"run{world}_pp{pp}"
    launched = time.time()
    layout = _layout(world, pp)
    results = run_ranks(_worker, world, world, layout, str(run_dir), str(corpus))
    phases = startup_phases(run_dir, launched_at=launched)
    names = list(phases[0])
    return {
        "layout": layout,
        "pipelines": world // pp,
        "seconds_median_over_ranks": {
            p: round(statistics.median(r[p] for r in phases.values()), 3) for p in names
        },
        "launch_to_first_step_max_s": round(max(r["total"] for r in phases.values()), 3),
        "syncs_per_rank": results[0]["counts"],
        "torch_init_device_mesh_per_rank": results[0]["torch_mesh"],
        "barriers_removed_per_rank": 2,
    }


def _grows(runs: dict[str, dict]) -> bool:
    """Whether, at a fixed pp, more pipelines (more processes) ever meant more groups entered by
    every rank or more world store barriers. (With one pipeline of 2 ranks, the tied-embedding
    pair of first and last stage is the whole world: its members' barrier counts as a world one.)"""
    for pp in {r["layout"]["pp"] for r in runs.values()}:
        same_pp = sorted(
            (r for r in runs.values() if r["layout"]["pp"] == pp), key=lambda r: r["pipelines"]
        )
        counts = [
            (r["syncs_per_rank"]["new_groups_world"], r["syncs_per_rank"]["world_store_barriers"])
            for r in same_pp
        ]
        if any(b[0] > a[0] or b[1] > a[1] for a, b in zip(counts, counts[1:])):
            return True
    return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--max-processes", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("DEPTHSCALE_CACHE", str(Path(tmp) / "cache"))
        runs = {
            f"{n}_pp{pp}": measure(n, pp, Path(tmp)) for n, pp in RUNS if n <= args.max_processes
        }
        world_groups = {k: r["syncs_per_rank"]["new_groups_world"] for k, r in runs.items()}
        world_barriers = {k: r["syncs_per_rank"]["world_store_barriers"] for k, r in runs.items()}
        report = {
            "what": "process launch → first step done, per phase, and start-up synchronisations",
            **device_info(),
            "cpu_cores": os.cpu_count(),
            "runs": runs,
            "world_groups_per_rank": world_groups,
            "world_store_barriers_per_rank": world_barriers,
            "grow_with_pipelines": _grows(runs),
        }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
