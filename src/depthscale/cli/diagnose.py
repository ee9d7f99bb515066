"""`depthscale diagnose`: every diagnostic check on N local ranks; the bad nodes named (exit 1),
or all healthy (exit 0)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from depthscale.cli.output_paths import check_output


def run(args: argparse.Namespace) -> int:
    from depthscale.resilience.diagnose import diagnose
    from depthscale.resilience.verdict import format_table

    ckpt_dir = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    check_output("--run", Path(args.run), directory=True)
    # --checkpoint-dir is not checked here: whether every rank can write there is one of the
    # checks (ckpt_write), which names the ranks and nodes that cannot
    report = diagnose(
        args.nproc,
        Path(args.run),
        ckpt_dir=ckpt_dir,
        size_mb=args.size_mb,
        timeout_s=args.timeout_s,
    )
    print(report.to_json() if args.json else format_table(report), flush=True)
    for node, reasons in report.bad_nodes.items():
        print(f"depthscale: diagnose: node {node} failed: {'; '.join(reasons)}", file=sys.stderr)
    return 0 if report.healthy else 1
