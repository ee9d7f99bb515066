"""One rank of a diagnostics run: `python -m depthscale.resilience.diagnostics_worker WORK_DIR
--size-mb X [--ckpt-dir D] --timeout-s T`, started by `diagnose.diagnose` with torchrun's
environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT; the store is hosted by the supervisor).

Every rank writes `WORK_DIR/progress/rank{r}.json` (its node and the check it is in) as it goes, so
that a supervisor whose run hangs can name the silent rank; rank 0 gathers the rows and writes
`WORK_DIR/rows.json`. An error is handed to the supervisor through the launcher's error directory.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

PROGRESS_DIR, ROWS_FILE = "progress", "rows.json"
JOINED = "joined"
"""Progress of a rank that has joined the process group, before its first check."""


def write_json(path: Path, value: object) -> None:
    """Atomically: a reader never sees half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    tmp.rename(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="diagnostics_worker")
    parser.add_argument("work_dir", type=Path)
    parser.add_argument("--size-mb", type=float, required=True)
    parser.add_argument("--ckpt-dir", type=Path)
    parser.add_argument("--timeout-s", type=float, required=True)
    args = parser.parse_args(argv)

    from depthscale.parallel.launcher import BUG, PEER_LOST, peer_lost, record_worker_error
    from depthscale.parallel.mesh import dist_env
    from depthscale.resilience.diagnostics import node_id

    rank, node = dist_env().rank, node_id()
    progress_dir = args.work_dir / PROGRESS_DIR

    def progress(check: str) -> None:
        record = {"rank": rank, "node": node, "check": check, "time": time.time()}
        write_json(progress_dir / f"rank{rank}.json", record)

    progress("starting")
    try:
        return _run(args, rank, node, progress)
    except Exception as err:
        kind = PEER_LOST if peer_lost(err) else BUG
        message = f"rank {rank} ({node}) failed:\n{traceback.format_exc().rstrip()}"
        if not record_worker_error(rank, kind, message):
            print(message, file=sys.stderr)
        return 1


def _run(args: argparse.Namespace, rank: int, node: str, progress) -> int:
    import torch
    import torch.distributed as dist

    from depthscale.parallel.mesh import destroy_distributed, init_distributed
    from depthscale.resilience.diagnostics import run_checks

    device = "cuda" if torch.cuda.is_available() else "cpu"
    env = init_distributed(device, args.timeout_s)
    if env.world_size == 1:  # init_distributed makes no group for one process; the checks need one
        dist.init_process_group(
            "nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1
        )
    progress(JOINED)
    row = run_checks(args.ckpt_dir, args.size_mb, node, on_check=progress)
    rows = [None] * env.world_size if rank == 0 else None
    dist.gather_object(row, rows, dst=0)
    if rank == 0:
        write_json(args.work_dir / ROWS_FILE, rows)
    progress("done")
    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
