"""Recovery from memory vs from a DCP checkpoint on local disk, side by side, at a state of >= 1 GB.

    python benchmarks/recovery.py [--dim 1024 --layers 8 --out benchmarks/results/recovery_cpu_DATE.json]

`depthscale train` runs supervised as a user runs it (2 ranks, dp_shard 2, one thread each), a
model whose fp32 weights and AdamW moments total >= 1 GB, with a worker SIGKILLed at the start of
step K (`--faults kill@1:K`: K − 1 steps done):

- memory: snapshots every `--snapshot-every` steps (train/snapshot.py: a DCP checkpoint into the
  node keeper's /dev/shm) and DCP checkpoints every `--checkpoint-every` steps; the restart
  restores from the newest snapshot;
- disk: the same run without snapshots (checkpoint.snapshot_every 0); the restart reads the
  newest DCP checkpoint on local disk.

Measured, from the supervisor's restart breakdown (`restart_time` in supervisor/log.jsonl):
fault → first completed step for each (goal: memory <= 0.3 × disk), with its phases; the steps
each loses (the steps done minus the step restored); and a snapshot's cost on the step time:
training's wait per snapshot (`blocking_s` of the `snapshot` records in metrics.jsonl) over the
median step, at the default snapshot interval (goal <= 3 %), with the median step of the two runs
before the fault. `planner_calibration`: the bandwidths `depthscale plan` uses
(`plan.hardware.Cluster`), as this run measured them.

Prints one JSON object; `--out` also writes it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import device_info, print_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _train(run: Path, args: argparse.Namespace, snapshot_every: int) -> dict:
    cmd = [
        sys.executable, "-m", "depthscale.cli", "train", "-c", str(ROOT / "configs" / "tiny.toml"),
        "--model.dim", str(args.dim), "--model.n_layers", str(args.layers),
        "--model.n_heads", "16", "--data.seq_len", "32", "--train.batch_size", "4",
        "--data.max_bytes", "200000", "--optim.warmup_steps", "1", "--train.eval_every", "0",
        "--logging.log_every", "1", "--logging.progress", "false",
        "--logging.tensorboard", "false", "--logging.peak_tflops", "1",
        "--train.steps", str(args.steps), "--train.run_dir", str(run),
        "--checkpoint.every", str(args.checkpoint_every), "--checkpoint.keep", "1",
        "--checkpoint.snapshot_every", str(snapshot_every),
        "--nproc", "2", "--parallel.dp_shard", "2", "--faults", f"kill@1:{args.kill_after}",
    ]  # fmt: skip
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=run.parent, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"train failed ({proc.returncode}): {proc.stderr[-3000:]}")
    log = [json.loads(line) for line in (run / "supervisor" / "log.jsonl").read_text().splitlines()]
    restarts = [e for e in log if e["event"] == "restart_time"]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    tokens = 4 * 32
    steps = {}
    for m in metrics:  # the run before the fault: each step's first record
        if m.get("split") == "train" and m.get("tokens_per_s") and m["step"] not in steps:
            steps[m["step"]] = tokens / m["tokens_per_s"]
    return {
        "wall_s": round(time.perf_counter() - started, 1),
        "restart": restarts[0] if restarts else None,
        "step_s": [steps[s] for s in sorted(steps) if 2 <= s < args.kill_after],
        "saves": [m for m in metrics if m.get("split") in ("snapshot", "checkpoint")],
    }


def summarise(raw: dict, default_every: int) -> dict:
    """The figures of issue #53 from the two runs' records (each run's records stay in `raw`)."""
    cfg, runs = raw["config"], raw["runs"]
    rank_bytes = cfg["state_gb"] * 1e9 / 2  # dp_shard 2: each rank holds half
    out: dict = {}
    for name, run in runs.items():
        restart = run["restart"] or {}
        records = restart.get("restore") or {}
        restored = [r["step"] for r in records.values()]
        out[name] = {
            "fault_to_first_step_s": restart.get("fault_to_first_step_s"),
            "phases_s": restart.get("phases_s"),
            "restored": records,
            "steps_lost": cfg["kill_after"] - 1 - min(restored) if restored else None,
            "median_step_s": statistics.median(run["step_s"]),
        }
    mem, disk = out["memory"], out["disk"]
    ratio = mem["fault_to_first_step_s"] / disk["fault_to_first_step_s"]
    blocking = [s["blocking_s"] for s in runs["memory"]["saves"] if s["split"] == "snapshot"]
    step = disk["median_step_s"]
    wait = statistics.median(blocking)
    # what snapshots cost the step beyond training's wait: their writer processes' CPU (copying,
    # hashing, writing), taken from the same 2 cores; per snapshot, from the median steps
    per_snapshot = (mem["median_step_s"] - step) * cfg["snapshot_every"]
    load = {k: v["phases_s"]["checkpoint_load"] for k, v in out.items()}
    # fixed: what a restart costs besides reading the state and redoing one step
    fixed = {k: v["fault_to_first_step_s"] - load[k] - step for k, v in out.items()}
    return {
        "fault_to_first_step_s": {k: v["fault_to_first_step_s"] for k, v in out.items()},
        "memory_vs_disk": round(ratio, 3),
        "goal_memory_vs_disk": 0.3,
        "met_memory_vs_disk": ratio <= 0.3,
        "checkpoint_load_s": load,
        "steps_lost": {k: v["steps_lost"] for k, v in out.items()},
        "steps_lost_at_intervals": {
            "snapshot_every": cfg["snapshot_every"],
            "checkpoint_every": cfg["checkpoint_every"],
            "default_snapshot_every": default_every,
            "note": "a fault loses the steps since the newest version of the tier that serves "
            "it: at most the interval, on average half",
        },
        "snapshot_blocking_s": {"median": wait, "max": max(blocking)},
        "median_step_s": {k: v["median_step_s"] for k, v in out.items()},
        "step_time_memory_vs_disk": round(mem["median_step_s"] / step, 3),
        "snapshot_cost_at_default_interval": {
            "training_wait_only": round(wait / (default_every * step), 4),
            "with_the_writers_cpu": round(per_snapshot / (default_every * step), 4),
            "note": "the wait is what a GPU step loses (the writers run on host cores GPU "
            "training leaves idle); on this 2-core box the writers' copying, hashing and "
            "writing take the training ranks' cores: the step-time difference of the two "
            "runs, per snapshot",
        },
        "goal_snapshot_cost": 0.03,
        "runs": {k: {kk: vv for kk, vv in v.items() if kk != "restored"} for k, v in out.items()},
        "restored": {k: v["restored"] for k, v in out.items()},
        "planner_calibration": {
            "snapshot_bw": rank_bytes / wait,
            "memory_read_bw": rank_bytes / load["memory"],
            "disk_read_bw": rank_bytes / load["disk"],
            "restart_s": round(statistics.mean(fixed.values()), 2),
            "note": "plan.hardware.Cluster fields as this run measured them, per rank: a "
            "snapshot's wait, a restore's checkpoint_load phase (rank 0's verification of the "
            "version included), the restart besides that phase and one step",
        },
        "records": {k: {"step_s": v["step_s"], "saves": v["saves"]} for k, v in runs.items()},
    }


def _state_bytes(dim: int, layers: int) -> int:
    from depthscale.config import load_config
    from depthscale.shape import ModelShape

    cfg = load_config(str(ROOT / "configs" / "tiny.toml"), [
        "--model.dim", str(dim), "--model.n_layers", str(layers), "--model.n_heads", "16",
        "--model.vocab_size", "320",
    ])  # fmt: skip
    return ModelShape.from_config(cfg.model).params() * 12  # fp32 weights + two AdamW moments


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--snapshot-every", type=int, default=2)
    parser.add_argument("--checkpoint-every", type=int, default=6)
    parser.add_argument("--kill-after", type=int, default=11)
    parser.add_argument("--out")
    parser.add_argument("--raw", help="also write the runs' records here")
    parser.add_argument("--summarise", metavar="RAW", help="derive the figures from --raw's file")
    args = parser.parse_args()
    from depthscale.config.schema import CheckpointConfig

    if args.summarise:
        raw = json.loads(Path(args.summarise).read_text())
        summary = summarise(raw, CheckpointConfig().snapshot_every)
        print_result({k: v for k, v in raw.items() if k != "runs"} | summary, args.out)
        return
    state = _state_bytes(args.dim, args.layers)
    with tempfile.TemporaryDirectory() as tmp:
        runs = {
            "memory": _train(Path(tmp) / "memory", args, args.snapshot_every),
            "disk": _train(Path(tmp) / "disk", args, 0),
        }
    raw = {
        **device_info(),
        "date": datetime.date.today().isoformat(),
        "config": {
            "model": f"dim {args.dim}, {args.layers} layers, seq 32, batch 4, AdamW fp32",
            "layout": "2 ranks, parallel.dp_shard 2, supervised (one host)",
            "state_gb": state / 1e9,
            "snapshot_every": args.snapshot_every,
            "checkpoint_every": args.checkpoint_every,
            "fault": f"SIGKILL rank 1 at the start of step {args.kill_after}",
            "kill_after": args.kill_after,
        },
        "runs": runs,
    }
    if args.raw:  # the records, before anything is derived from them
        Path(args.raw).write_text(json.dumps(raw, indent=1) + "\n")
    summary = summarise(raw, CheckpointConfig().snapshot_every)
    print_result({k: v for k, v in raw.items() if k != "runs"} | summary, args.out)


if __name__ == "__main__":
    main()
