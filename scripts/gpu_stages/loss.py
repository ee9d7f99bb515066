"""Stage loss: the paper's claim at small scale — Block AttnRes trains no worse than the standard
residual for the same tokens.

A ~100M-parameter model (d 768, 12 layers, 12 heads / 4 KV, FFN 2048, a 32768-row tied embedding,
sequence 1024, 32 sequences a step) trains eagerly in bf16 on the same batches from the same seed:
block first, for about half the stage's time (N steps), then standard for exactly N steps —
equal tokens. Both see one learning-rate schedule (warmup, then a constant rate: the run ends
before any decay), so the only difference is the residual.

`loss` of each is the mean training loss over its last `window` steps (the same batches for both:
a paired comparison); `block_minus_standard` their difference. Goal (docs/gpu.md): block ≤
standard. A few minutes of training at this scale separates the two by about the noise of a
window's mean (`standard_window_std` says how much), so a missed goal here is a prompt for a
longer run (`--stage-timeout loss=600`), not a verdict.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import torch

from gpu_stages.common import LLAMA_1B, Context, goal, sig
from gpu_stages.trainer import overrides

MODEL = {"dim": 768, "n_layers": 12, "n_heads": 12, "n_kv_heads": 4, "ffn_dim": 2048,
         "seq": 1024, "batch": 32, "micro": 16}  # fmt: skip
DRY_MAX_STEPS = 4
SCHEDULE_STEPS = 5000
"""`train.steps` for the schedule: far past what the stage runs, so no decay starts."""


def _config(ctx: Context, residual: str):
    from depthscale.config import load_config

    args = overrides(ctx, residual, False, SCHEDULE_STEPS - 1, 10**6)
    args += ["--optim.warmup_steps", "20", "--optim.lr", "1e-3", "--train.eval_every", "0"]
    if not ctx.dry_run:
        m = MODEL
        args += [
            *("--model.dim", str(m["dim"]), "--model.n_layers", str(m["n_layers"])),
            *("--model.n_heads", str(m["n_heads"]), "--model.n_kv_heads", str(m["n_kv_heads"])),
            *("--model.ffn_dim", str(m["ffn_dim"]), "--model.attnres_block_size", "4"),
            *("--data.seq_len", str(m["seq"]), "--data.max_bytes", "40000000"),
            *("--train.batch_size", str(m["batch"]), "--train.micro_batch_size", str(m["micro"])),
        ]  # fmt: skip
    return load_config(LLAMA_1B, args)


def train_for(ctx: Context, residual: str, seconds: float | None, steps: int | None) -> dict:
    """Train `residual` for `steps` steps, or (steps None) as many as `seconds` allow; its losses."""
    from depthscale.train.trainer import Trainer

    trainer = Trainer(_config(ctx, residual))
    losses: list[float] = []
    t0 = time.perf_counter()
    while True:
        if steps is not None and len(losses) >= steps:
            break
        if steps is None and (time.perf_counter() - t0 >= seconds or
                              (ctx.dry_run and len(losses) >= DRY_MAX_STEPS)):  # fmt: skip
            break
        losses.append(float(trainer.train_step()["loss"]))
    took = time.perf_counter() - t0
    values = {
        "params_m": round(trainer.plan.num_params() / 1e6, 1),
        "steps": len(losses),
        "tokens": len(losses) * trainer.tokens_per_step,
        "seconds": round(took, 1),
        "losses": losses,
    }
    del trainer
    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()
    return values


def compare(ctx: Context) -> dict[str, Any]:
    each = max(5.0, (ctx.time_left() - 25) / 2.2)  # standard is the faster: it fits the rest
    block = train_for(ctx, "block", each, None)
    standard = train_for(ctx, "standard", None, block["steps"])
    n = block["steps"]
    window = max(2, n // 5)
    mean = {r: statistics.fmean(v["losses"][-window:]) for r, v in
            (("block", block), ("standard", standard))}  # fmt: skip
    values = {
        "params_m": standard["params_m"],
        "tokens_each": standard["tokens"],
        "steps_each": n,
        "window": window,
        "seconds": {"block": block["seconds"], "standard": standard["seconds"]},
        "loss": {r: sig(v, 5) for r, v in mean.items()},
        "block_minus_standard": sig(mean["block"] - mean["standard"], 3),
        "standard_window_std": sig(statistics.pstdev(standard["losses"][-window:]), 3),
        "first_losses": {"block": block["losses"][:3], "standard": standard["losses"][:3]},
    }
    goal(values, "block_loss_minus_standard", values["block_minus_standard"], "<=", 0.0)
    return values


def run(ctx: Context) -> None:
    ctx.measure("equal_tokens", lambda: compare(ctx))
