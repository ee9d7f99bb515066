"""Stage llama1b: the whole configs/llama-1b.toml — 16 layers, d 2048, GQA 32/8, FFN 8192, sequence
2048 — compiled as the trainer compiles it (`train.compile`: one graph shared by every standard block; for
AttnRes the sublayers' two graphs, the depth reads eager on the fused kernels), bf16, with
a 32768-token vocabulary over the byte tokenizer; the standard residual first, then block.

Per residual: `first_step_s` (host seconds of step 1: Inductor compiling every distinct block, Triton
compiling its kernels — what `resilience.startup_timeout_s` must cover), tokens/s and MFU over the
timed steps (`trainer.train`), `graph_breaks` with their reasons and `dynamo_stats.unique_graphs`
from torch._dynamo's counters, the peak device memory.

Goals for the first GPU run (docs/gpu.md): standard ≥ 45 % MFU (`mfu`, against the spec sheet's
dense bf16 peak); block's step time ≤ 1.03 × standard's (`block_over_standard`). A residual the
stage's time cannot fit is `skipped` with the seconds it had. Under --dry-run dynamo uses its
`eager` backend on a tiny model (Inductor's C++ code generation for CPU takes minutes on two
cores; what the GPU run measures is Inductor on CUDA), so the counting still runs.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from gpu_stages.common import Context, OutOfBounds, goal, sig
from gpu_stages.trainer import train

ORDER = ("standard", "block")
REAL = {"warm": 4, "timed": 8, "log_every": 4}
DRY = {"warm": 1, "timed": 1, "log_every": 1}
GOAL_MFU, GOAL_RATIO = 0.45, 1.03


def _eager_backend_for_dry_run() -> None:
    """torch.compile(..., backend='eager') wherever the trainer compiles (nn.Module.compile calls
    torch.compile): dynamo traces and counts graph breaks exactly as it does on a GPU."""
    real = torch.compile

    def compile_eager(*args, **kwargs):
        kwargs.setdefault("backend", "eager")
        return real(*args, **kwargs)

    torch.compile = compile_eager


def compiled(ctx: Context, residual: str, plan: dict) -> dict[str, Any]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    values = train(ctx, residual, True, plan, slice_=False)
    breaks = dict(counters["graph_break"])
    values["graph_breaks"] = sum(breaks.values())
    values["graph_break_reasons"] = {k[:200]: v for k, v in list(breaks.items())[:8]}
    values["dynamo_stats"] = dict(counters["stats"])
    if residual == "standard":
        goal(values, "mfu", values.get("mfu"), ">=", GOAL_MFU)
    if values["graph_breaks"]:
        raise OutOfBounds(f"{values['graph_breaks']} graph breaks", values)
    return values


def run(ctx: Context) -> None:
    plan = DRY if ctx.dry_run else REAL
    if ctx.dry_run:
        _eager_backend_for_dry_run()
    rates: dict[str, float] = {}
    last = 0.0
    for residual in ORDER:
        if last and ctx.time_left() < 1.2 * last:
            ctx.emit(residual, status="skipped",
                     error=f"{ctx.time_left():.0f} s left in the stage; the last residual "
                     f"took {last:.0f} s")  # fmt: skip
            continue
        t0 = time.monotonic()
        values = ctx.measure(residual, lambda r=residual: compiled(ctx, r, plan))
        last = time.monotonic() - t0
        if values and "tokens_per_s" in values:
            rates[residual] = values["tokens_per_s"]
    if len(rates) == 2:

        def ratio() -> dict:
            values = {"block_over_standard": sig(rates["standard"] / rates["block"], 3)}
            goal(values, "block_over_standard", values["block_over_standard"], "<=", GOAL_RATIO)
            return values

        ctx.measure("step_time_ratio", ratio)
