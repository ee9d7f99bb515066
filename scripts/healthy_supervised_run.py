"""A healthy supervised run must never be restarted: false positives cost as much as faults.

    python scripts/healthy_supervised_run.py [--minutes 10 --nproc 4 --out RESULT.json]

Trains the tiny model on `--nproc` local ranks (dp_shard × tp = 2 × 2 for 4) under the supervisor
with every detector on (heartbeats, hang limits, the straggler detector, checkpoints every 25
steps, evaluations) for about `--minutes`, ranks oversubscribing the cores, and checks that the
supervisor logged no fault and no restart. Prints one JSON object (steps trained, faults,
restarts, the largest heartbeat and progress gaps it saw are in its log); exit 1 on any restart.
Not in the test suite: it takes minutes by design.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--out")
    args = parser.parse_args()
    layout = ["--parallel.dp_shard", "2", "--parallel.tp", "2"] if args.nproc == 4 else [
        "--parallel.dp_shard", str(args.nproc)
    ]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="depthscale-healthy-") as tmp:
        run = Path(tmp) / "run"
        # about 12 steps/s on 2 cores at this size; more steps than the time allows, then stop
        steps = int(args.minutes * 60 * 20)
        cmd = [
            sys.executable, "-m", "depthscale.cli", "train", "-c", str(ROOT / "configs/tiny.toml"),
            "--nproc", str(args.nproc), *layout, "--model.dim", "64", "--model.n_layers", "2",
            "--model.n_heads", "4", "--data.seq_len", "64", "--train.batch_size", "8",
            "--train.steps", str(steps), "--train.eval_every", "100", "--train.eval_batches", "2",
            "--checkpoint.every", "25", "--logging.progress", "false",
            "--logging.log_every", "50", "--train.run_dir", str(run),
        ]  # fmt: skip
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=tmp, env=dict(os.environ, PYTHONWARNINGS="ignore"))
        try:
            proc.wait(timeout=args.minutes * 60)
        except subprocess.TimeoutExpired:
            proc.terminate()  # SIGTERM: the supervisor forwards it, the workers save and exit
            proc.wait(timeout=120)
        elapsed = time.monotonic() - start
        log = [json.loads(x) for x in (run / "supervisor" / "log.jsonl").read_text().splitlines()]
        metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    faults = [e["text"] for e in log if e["event"] in ("fault", "gave_up")]
    restarts = [e for e in log if e["event"] == "restart"]
    result = {
        "minutes": round(elapsed / 60, 2),
        "nproc": args.nproc,
        "steps": max((m["step"] for m in metrics), default=0),
        "exit_code": proc.returncode,
        "faults": faults,
        "restarts": len(restarts),
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if not faults and not restarts else 1


if __name__ == "__main__":
    sys.exit(main())
