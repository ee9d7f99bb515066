"""Count what a block of code hands to torch.distributed: payload bytes per (operation, group).

The planner predicts each rank's bytes per step as (operation, group label) → bytes
(`plan.comm.rank_payload`); this counts the same quantity at the calls themselves, so the two can
be compared exactly (`tests/dist/test_plan_comm.py`, `benchmarks/cp_styles.py`). Every collective
and `batch_isend_irecv` is wrapped for the duration of the block and restored after; the payload
of a call is the tensor whose size the planner counts: a gather's output, a scatter's or an
all-to-all's input, an all-reduce's tensor, each P2P op's tensor.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator

import torch.distributed as dist

PAYLOADS = {
    "all_gather_single": ("all_gather", "output", 0),
    "all_gather_into_tensor": ("all_gather", "output_tensor", 0),
    "reduce_scatter_single": ("reduce_scatter", "input", 1),
    "reduce_scatter_tensor": ("reduce_scatter", "input", 1),
    "all_reduce": ("all_reduce", "tensor", 0),
    "all_to_all_single": ("all_to_all", "input", 1),
}
"""torch.distributed function → (the planner's operation, the payload's keyword, its position)."""


@contextlib.contextmanager
def counting_payloads(label: Callable[[object], str]) -> Iterator[Counter]:
    """Yield a Counter that fills, inside the block, with payload bytes per (operation,
    `label(group)`); `label` gets the call's group (None: the world)."""
    log: Counter = Counter()
    names = [n for n in [*PAYLOADS, "batch_isend_irecv"] if hasattr(dist, n)]
    saved = {n: getattr(dist, n) for n in names}

    def collective(name: str, fn: Callable) -> Callable:
        op, key, position = PAYLOADS[name]

        def run(*args, **kwargs):
            t = kwargs.get(key, args[position] if len(args) > position else None)
            log[op, label(kwargs.get("group"))] += t.numel() * t.element_size()
            return fn(*args, **kwargs)

        return run

    def batch(fn: Callable) -> Callable:
        def run(ops):
            for op in ops:
                kind = "send" if op.op is dist.isend else "recv"
                log[kind, label(op.group)] += op.tensor.numel() * op.tensor.element_size()
            return fn(ops)

        return run

    for name, fn in saved.items():
        setattr(dist, name, batch(fn) if name == "batch_isend_irecv" else collective(name, fn))
    try:
        yield log
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
