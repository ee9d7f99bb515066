"""Stages trainer and compiled: the real training loop (`Trainer.fit`, as `depthscale train` runs
it) on a 4-layer slice of configs/llama-1b.toml in bf16, for the standard, block and full
residuals.

The slice keeps llama-1b's widths (d 2048, 32 heads, 8 KV heads, FFN 8192, sequence 2048, micro
batch 4) and its block size (4 sublayers a block), with a 32768-token vocabulary over the byte
tokenizer (no BPE training inside the check). Each run trains WARM steps, then TIMED steps: the
clock starts when step WARM + 1 begins, right after a logged step (whose metric read drains the
device), and stops when `fit` returns after a logged step, so it covers exactly the timed steps'
device work, the loop's own host work included. MFU is tokens/s × the model's FLOPs per token over
the trainer's peak (the spec sheet for known GPUs).

`compiled` runs each residual eagerly for a few steps, then compiled (`train.compile`, blocks
compiled as the trainer does): first-step seconds (host time, compile included), graph breaks and
graphs from torch._dynamo's counters, and the first steps' losses against eager (same seed, same
batches: they agree to bf16 rounding). Under --dry-run dynamo uses its `eager` backend: Inductor's
C++ code generation for CPU takes minutes on two cores, and what the GPU run measures is Inductor
on CUDA.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

from gpu_stages.common import LLAMA_1B, Context, OutOfBounds, sig

RESIDUALS = ("standard", "block", "full")
COMPILED_ORDER = ("block", "standard", "full")
"""The project's default residual first: a run cut short by its time still measured it."""
REAL = {"warm": 5, "timed": 10, "log_every": 5, "compare": 3}
DRY = {"warm": 1, "timed": 1, "log_every": 1, "compare": 2}
LOSS_RTOL = 5e-3
"""Compiled vs eager loss, relative, over the first steps: bf16 rounding of differently fused
reductions moves the loss by ~1e-3 of itself; a broken graph moves it by far more."""


def overrides(ctx: Context, residual: str, compile_: bool, steps: int, log_every: int) -> list:
    name = f"{ctx.stage}_{residual}" + ("_compiled" if compile_ else "")
    common = [
        *("--model.residual", residual, "--train.compile", str(compile_).lower()),
        *("--train.steps", str(steps + 1), "--train.eval_every", "0"),
        *("--train.run_dir", str(ctx.work / "runs" / name), "--train.name", name),
        *("--train.device", ctx.device.type, "--optim.warmup_steps", "1"),
        *("--checkpoint.every", "0", "--checkpoint.resume", "none"),
        *("--logging.progress", "false", "--logging.tensorboard", "false"),
        *("--logging.log_every", str(log_every)),
        *("--data.tokenizer", "byte", "--data.cache_dir", str(ctx.work / "data_cache")),
    ]
    if ctx.dry_run:
        return common + [
            *("--model.n_layers", "2", "--model.dim", "64", "--model.n_heads", "4"),
            *("--model.n_kv_heads", "2", "--model.ffn_dim", "128"),
            *("--model.attnres_block_size", "2", "--model.vocab_size", "0"),
            *("--data.seq_len", "32", "--data.max_bytes", "100000"),
            *("--train.batch_size", "2", "--train.micro_batch_size", "2"),
            *("--logging.peak_tflops", "1"),  # no CPU matmul measurement at start
        ]
    return common + [
        *("--model.n_layers", "4", "--model.attnres_block_size", "4"),
        *("--model.vocab_size", "32768", "--data.max_bytes", "8000000"),
        *("--train.batch_size", "8", "--train.micro_batch_size", "4"),
    ]


def train(
    ctx: Context, residual: str, compile_: bool, plan: dict, extra: tuple[str, ...] = ()
) -> dict[str, Any]:
    """One `Trainer.fit` of plan['warm'] + plan['timed'] steps (config `overrides`, then
    `extra`); its numbers."""
    from depthscale.config import load_config
    from depthscale.model import kernel_dispatch
    from depthscale.observe.metrics import flops_per_token
    from depthscale.train.trainer import Trainer

    warm, timed = plan["warm"], plan["timed"]
    steps, log_every = warm + timed, plan["log_every"]
    cfg = load_config(LLAMA_1B, overrides(ctx, residual, compile_, steps, log_every) + list(extra))
    getattr(kernel_dispatch, "reset_kernel_paths", lambda: None)()
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    build_s = time.perf_counter() - t0
    starts: list[float] = []
    begin = trainer.telemetry.begin_step

    def begin_step(step: int) -> None:
        starts.append(time.perf_counter())
        begin(step)

    trainer.telemetry.begin_step = begin_step
    history = trainer.fit(stop_at=warm + timed)
    end = time.perf_counter()
    tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
    tokens_per_s = timed * tokens_per_step / (end - starts[warm])
    fpt = flops_per_token(cfg.model, cfg.data.seq_len)
    peak = trainer.throughput.peak_flops
    values = {
        "residual": residual,
        "compiled": compile_,
        "params_m": round(trainer.plan.num_params() / 1e6, 1),
        "tokens_per_step": tokens_per_step,
        "build_s": round(build_s, 2),
        "first_step_s": round(starts[1] - starts[0], 2),
        "step_ms": sig((end - starts[warm]) / timed * 1e3),
        "tokens_per_s": sig(tokens_per_s),
        "mfu": sig(tokens_per_s * fpt / peak, 3) if peak > 0 else None,
        "peak_tflops": sig(peak / 1e12),
        "peak_source": getattr(trainer, "peak_source", None),
        "trainer_mfu_last_window": history[-1].get("mfu"),
        "losses": [sig(float(h["loss"]), 6) for h in history],
        "kernel_paths": kernel_dispatch.kernel_paths(),
        "tf32_after_init": {
            "matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
        },
    }
    if "offloaded_mb" in history[-1]:
        values["offloaded_mb"] = sig(float(history[-1]["offloaded_mb"]))
    if ctx.cuda:
        values["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    del trainer, history
    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()
    return values


def run_eager(ctx: Context) -> None:
    plan = DRY if ctx.dry_run else REAL
    rates = {}
    for residual in RESIDUALS:
        values = ctx.measure(residual, lambda r=residual: train(ctx, r, False, plan))
        if values:
            rates[residual] = values["tokens_per_s"]
    if "standard" in rates:
        ctx.measure("step_time_ratios", lambda: {
            f"{r}_over_standard": sig(rates["standard"] / rates[r], 3)
            for r in rates if r != "standard"
        })  # fmt: skip


def _eager_backend_for_dry_run() -> None:
    """torch.compile(..., backend='eager') wherever the trainer compiles (nn.Module.compile calls
    torch.compile): dynamo traces and counts graph breaks exactly as it does on a GPU."""
    real = torch.compile

    def compile_eager(*args, **kwargs):
        kwargs.setdefault("backend", "eager")
        return real(*args, **kwargs)

    torch.compile = compile_eager


def compiled_case(ctx: Context, residual: str, plan: dict) -> dict[str, Any]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    eager_plan = {"warm": 1, "timed": plan["compare"] - 1, "log_every": 1}
    eager = train(ctx, residual, False, eager_plan)
    torch._dynamo.reset()
    counters.clear()
    values = train(ctx, residual, True, plan)
    breaks = dict(counters["graph_break"])
    values["graph_breaks"] = sum(breaks.values())
    values["graph_break_reasons"] = {k[:200]: v for k, v in list(breaks.items())[:8]}
    values["dynamo_stats"] = dict(counters["stats"])
    k = plan["compare"]
    compiled_losses, eager_losses = values["losses"][:k], eager["losses"][:k]
    diffs = [abs(a - b) / abs(b) for a, b in zip(compiled_losses, eager_losses)]
    values["eager_losses"] = eager_losses
    values["loss_rel_diff_max"] = sig(max(diffs), 3)
    if not max(diffs) <= LOSS_RTOL:
        raise OutOfBounds(
            f"compiled loss differs from eager by {max(diffs):.2e} (relative) > {LOSS_RTOL:.0e}",
            values,
        )
    return values


def run_compiled(ctx: Context) -> None:
    plan = DRY if ctx.dry_run else REAL
    if ctx.dry_run:
        _eager_backend_for_dry_run()
    residuals = ("block",) if ctx.dry_run else COMPILED_ORDER
    last = 0.0
    for residual in residuals:
        if last and ctx.time_left() < 1.3 * last:
            ctx.emit(residual, status="skipped",
                     error=f"{ctx.time_left():.0f} s left in the stage; the last residual "
                     f"took {last:.0f} s")  # fmt: skip
            continue
        t0 = time.monotonic()
        ctx.measure(residual, lambda r=residual: compiled_case(ctx, r, plan))
        last = time.monotonic() - t0
