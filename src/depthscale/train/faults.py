"""Fault injection for drills and tests: `DEPTHSCALE_INJECT_FAULT=RANK:STEP` makes that rank raise
at the start of that step, while its peers go on into the step's collectives: the case a
one-rank bug, a bad disk or a bad GPU produces, which must end the whole job at once."""

from __future__ import annotations

import os

ENV = "DEPTHSCALE_INJECT_FAULT"


class InjectedFault(RuntimeError):
    """Raised on purpose; never caught by depthscale."""


def maybe_inject_fault(rank: int, step: int) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    try:
        at_rank, at_step = (int(part) for part in spec.split(":"))
    except ValueError:
        raise InjectedFault(f"{ENV}={spec!r} must look like RANK:STEP") from None
    if (rank, step) == (at_rank, at_step):
        raise InjectedFault(f"injected fault on rank {rank} at step {step} ({ENV}={spec})")
