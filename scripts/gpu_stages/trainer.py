"""Stage trainer: the real training loop (`Trainer.fit`, as `depthscale train` runs it) on a 4-layer
slice of configs/llama-1b.toml in bf16, eager, for the standard, block and full residuals; then
where a step's time goes, and whether two runs agree bit for bit.

The slice keeps llama-1b's widths (d 2048, 32 heads, 8 KV heads, FFN 8192, sequence 2048, micro
batch 4) and its block size (4 sublayers a block), with a 32768-token vocabulary over the byte
tokenizer (no BPE training inside the check). Each run trains WARM steps, then TIMED steps: the
clock starts when step WARM + 1 begins, right after a logged step (whose metric read drains the
device), and stops when `fit` returns after a logged step, so it covers exactly the timed steps'
device work, the loop's own host work included. MFU is tokens/s × the model's FLOPs per token over
the trainer's peak (the spec sheet for known GPUs).

- `step_profile` (standard and block): host milliseconds to enqueue one step (`_train_step`,
  with `resilience.nan_replay=false` so that the step reads nothing back) against the device's
  milliseconds for it (CUDA events), and the kernel launches of one step from the profiler, per
  layer. Host ≥ device means the step is launch-bound: the GPU waits for Python.
- `bitwise`: two block runs from the same seed on the same batches: every parameter after the
  last step equal bit for bit (`torch.equal`), or the largest relative difference.

`train` (one `Trainer.fit` with its numbers) serves the llama1b and offload stages too, and
`overrides` (the config) the loss stage.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from gpu_stages.common import LLAMA_1B, Context, goal, profile_kernels, rel_err, sig

RESIDUALS = ("standard", "block", "full")
REAL = {"warm": 5, "timed": 10, "log_every": 5, "compare": 3}
DRY = {"warm": 1, "timed": 1, "log_every": 1, "compare": 2}


def overrides(
    ctx: Context, residual: str, compile_: bool, steps: int, log_every: int, slice_: bool = True
) -> list:
    """The run's config overrides over configs/llama-1b.toml: the 4-layer slice (`slice_`), or
    the whole 16 layers; tiny shapes under --dry-run either way."""
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
    layers = ("--model.n_layers", "4", "--model.attnres_block_size", "4") if slice_ else ()
    return common + [
        *layers,
        *("--model.vocab_size", "32768", "--data.max_bytes", "8000000"),
        *("--train.batch_size", "8", "--train.micro_batch_size", "4"),
    ]


def train(
    ctx: Context,
    residual: str,
    compile_: bool,
    plan: dict,
    extra: tuple[str, ...] = (),
    slice_: bool = True,
    after: Callable[[Any], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One `Trainer.fit` of plan['warm'] + plan['timed'] steps (config `overrides`, then
    `extra`); its numbers, and `after(trainer)`'s, run once `fit` has returned."""
    from depthscale.config import load_config
    from depthscale.model import kernel_dispatch
    from depthscale.observe.metrics import flops_per_token
    from depthscale.train.trainer import Trainer

    warm, timed = plan["warm"], plan["timed"]
    steps, log_every = warm + timed, plan["log_every"]
    args = overrides(ctx, residual, compile_, steps, log_every, slice_) + list(extra)
    cfg = load_config(LLAMA_1B, args)
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
    if after is not None:
        values |= after(trainer)
    del trainer, history
    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()
    return values


def run(ctx: Context) -> None:
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
    short = {"warm": 1, "timed": 1, "log_every": 1}
    no_reads = ("--resilience.nan_replay", "false")
    for residual in ("standard", "block"):
        ctx.measure(f"step_profile {residual}", lambda r=residual: _only(train(
            ctx, r, False, short, no_reads, after=lambda t: step_profile(ctx, t)),
            ("residual", "first_step_s", *PROFILE_KEYS)))  # fmt: skip
    ctx.measure("bitwise", lambda: bitwise(ctx, short))


PROFILE_KEYS = ("host_ms_per_step", "device_ms_per_step", "host_over_device",
                "launches_per_step", "launches_per_layer", "top_kernels")  # fmt: skip


def _only(values: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: values[k] for k in keys if k in values}


def step_profile(ctx: Context, trainer, steps: int = 3) -> dict[str, Any]:
    """Host vs device milliseconds per step and kernel launches per layer (see the docstring)."""
    host, pairs = [], []
    ctx.sync()
    for _ in range(steps):
        if ctx.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        trainer._train_step()
        host.append((time.perf_counter() - t0) * 1e3)
        if ctx.cuda:
            end.record()
            pairs.append((start, end))
    ctx.sync()
    t0 = time.perf_counter()
    device = [s.elapsed_time(e) for s, e in pairs] or [(time.perf_counter() - t0) * 1e3]
    profile = profile_kernels(ctx, trainer._train_step)
    layers = trainer.cfg.model.n_layers
    host_ms, device_ms = statistics.median(host), statistics.median(device)
    return {
        "host_ms_per_step": sig(host_ms),
        "device_ms_per_step": sig(device_ms) if ctx.cuda else None,
        "host_over_device": sig(host_ms / device_ms, 3) if ctx.cuda else None,
        "launches_per_step": profile["launches"],
        "launches_per_layer": sig(profile["launches"] / layers, 3),
        "top_kernels": profile["top_kernels"][:5],
    }


def bitwise(ctx: Context, plan: dict) -> dict[str, Any]:
    """Two block runs, same seed, same batches: parameters equal bit for bit after the last step
    (a difference names the nondeterministic kernel's effect: its largest relative size)."""
    kept: list[torch.Tensor] = []

    def keep(trainer) -> dict:
        kept.append([p.detach().clone() for p in trainer.model.parameters()])
        return {}

    first = train(ctx, "block", False, plan, after=keep)
    second = train(ctx, "block", False, plan, after=keep)
    a, b = kept
    equal = len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    values = {"params": len(a), "equal": equal, "losses": [first["losses"], second["losses"]]}
    if not equal:
        values["max_rel_diff"] = sig(max(rel_err(y, x) for x, y in zip(a, b)), 3)
    goal(values, "bitwise_equal", float(equal), ">=", 1.0)
    return values
