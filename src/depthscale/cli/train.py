"""`depthscale train`: every launch rule checked in this process, then one of three ways to run
(supervised, a plain local launch of workers, or this process training on its own)."""

from __future__ import annotations

import argparse

from depthscale.errors import ConfigError
from depthscale.parallel.launcher import is_worker


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    cfg = _checked_config(args, overrides)  # bad input fails here, before any process starts
    if args.print_config:
        from depthscale.config import to_toml

        print(to_toml(cfg), end="")
        return 0
    p = cfg.parallel
    passthrough = [*(["-c", args.config] if args.config else []), *overrides]
    if (p.nproc > 1 or p.nnodes > 1) and not is_worker():
        if cfg.resilience.supervise != "false":
            from depthscale.resilience.supervisor import supervise

            return supervise(cfg, passthrough)
        from depthscale.parallel.launcher import launch

        return launch(cfg.parallel.nproc, passthrough)
    if cfg.resilience.supervise == "true" and not is_worker():
        from depthscale.resilience.supervisor import supervise

        return supervise(cfg, passthrough)
    from depthscale.parallel.mesh import destroy_distributed
    from depthscale.train.trainer import Trainer

    trainer = Trainer(cfg)
    trainer.fit()
    # Only on success: a collective in an error path would wait for a peer that already left.
    destroy_distributed()
    return 128 + trainer.stopped_by if trainer.stopped_by is not None else 0


def _checked_config(args: argparse.Namespace, overrides: list[str]):
    """The config, with every rule the launch and the workers would enforce checked in this
    process: `train` refuses before any work, and `--print-config` prints only what would run."""
    from depthscale.config import load_config
    from depthscale.resilience.faults import check_ranks, parse_faults

    cfg = load_config(args.config, overrides)
    check_ranks(parse_faults(cfg.resilience.faults), cfg.world_size)
    if cfg.eval.tasks:  # every question checked before any work (the workers read them again)
        from pathlib import Path

        from depthscale.evaluation.multiple_choice import read_task

        for task in cfg.eval.tasks:
            read_task(Path(task.path), task.label, task.limit)
    p = cfg.parallel
    if (p.nproc > 1 or p.nnodes > 1) and not is_worker():
        _check_launch(cfg)
    elif cfg.world_size > 1 and not is_worker():
        raise ConfigError(
            f"parallel layout needs {cfg.world_size} processes; add --nproc {cfg.world_size} "
            "(or start the workers with torchrun)"
        )
    return cfg


def _check_launch(cfg) -> None:
    """The processes launched match the layout, and every rule a worker would enforce holds."""
    from depthscale.parallel.parallelize import check_layout

    p = cfg.parallel
    if cfg.world_size != p.nproc * p.nnodes:
        launched = (
            f"--nproc is {p.nproc}"
            if p.nnodes == 1
            else f"--nproc × parallel.nnodes is {p.nproc} × {p.nnodes}"
        )
        raise ConfigError(
            f"parallel layout pp×dp_replicate×dp_shard×cp×tp = {cfg.world_size} "
            f"processes, but {launched}; allowed: equal numbers"
        )
    if p.nnodes > 1 and cfg.resilience.supervise == "false":
        raise ConfigError(
            "parallel.nnodes > 1 runs one supervisor per node; with "
            "resilience.supervise=false start the workers with torchrun instead "
            "(docs/fault-tolerance.md, Multi-node)"
        )
    check_layout(cfg)
