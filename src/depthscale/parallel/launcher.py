"""`depthscale train --nproc N`: start N local workers through torchrun's own machinery.

Equivalent to `torchrun --standalone --nproc-per-node N -m depthscale.train ARGS`. The standalone
rendezvous picks a free port, so concurrent jobs on one host never collide on 29500.
"""

from __future__ import annotations

import os

from torch.distributed.run import get_args_parser, run


def is_worker() -> bool:
    """True inside a process started by torchrun (or another launcher that sets the rank)."""
    return "LOCAL_RANK" in os.environ or "RANK" in os.environ


def launch(nproc: int, train_args: list[str], max_restarts: int = 0) -> None:
    """Run `python -m depthscale.train TRAIN_ARGS` on `nproc` local workers; raises if any fails."""
    argv = [
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "--module",
        "depthscale.train",
        *train_args,
    ]
    run(get_args_parser().parse_args(argv))
