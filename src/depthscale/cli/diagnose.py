"""`depthscale diagnose`: every diagnostic check on N local ranks; the bad nodes named (exit 1),
or all healthy (exit 0)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from depthscale.cli.output_paths import check_output
from depthscale.errors import ConfigError


def run(args: argparse.Namespace) -> int:
    from depthscale.resilience.diagnose import diagnose
    from depthscale.resilience.verdict import format_table

    ckpt_dir = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    check_output("--run", Path(args.run), directory=True)
    _refuse_checkpoints_dir(Path(args.run))
    # --checkpoint-dir is not checked here: whether every rank can write there is one of the
    # checks (ckpt_write), which names the ranks and nodes that cannot
    report = diagnose(
        args.nproc,
        Path(args.run),
        ckpt_dir=ckpt_dir,
        size_mb=args.size_mb,
        timeout_s=args.timeout_s,
    )
    tiers = _recovery_tiers(Path(args.run))
    if args.json:
        print(json.dumps({**json.loads(report.to_json()), "recovery_tiers": tiers}, indent=1))
    else:
        print(format_table(report), flush=True)
    for node, reasons in report.bad_nodes.items():
        print(f"depthscale: diagnose: node {node} failed: {'; '.join(reasons)}", file=sys.stderr)
    for tier in tiers:
        for line in tier["failed"]:
            print(f"depthscale: diagnose: recovery tier {tier['tier']}: {line}", file=sys.stderr)
    if not args.json:
        said = (f"{t['tier']} {t['verified'] or 'none verified'}" for t in tiers if t["versions"])
        print(f"recovery tiers (what a restart would restore): {', '.join(said) or 'none saved'}")
    return 0 if report.healthy else 1


def _refuse_checkpoints_dir(run: Path) -> None:
    """--run naming a run's checkpoints directory (RUN/checkpoints) would read as a run with no
    recovery tiers ("none saved") and gain checkpoints/ and diagnostics/ folders beside the
    step_N ones: refused before any work, naming the run directory meant."""
    from depthscale.train.manifest import list_checkpoints

    steps = list_checkpoints(run)
    if steps and not (run / "checkpoints").exists():
        raise ConfigError(
            f"--run {str(run)!r} holds checkpoints ({steps[-1].name}): it is a run's checkpoints "
            f"directory; allowed: the run directory ({str(run.parent)!r})"
        )


def _recovery_tiers(run: Path) -> list[dict]:
    """Each recovery tier of the run verified as a restart would (`train/snapshot.py`), against
    the run's own model when its config.toml is there."""
    from depthscale.config.loading import load_config
    from depthscale.train.snapshot import recovery_tiers

    model = None
    with contextlib.suppress(ConfigError):  # a run whose config no longer loads: files only
        model = load_config(run / "config.toml").model if (run / "config.toml").is_file() else None
    return recovery_tiers(run, model)
