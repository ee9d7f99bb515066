"""Stage offload: activation offload (`train.offload_activations`) under torch's CUDA sanitizer.

Offload copies saved activations to pinned host memory on a side stream and brings them back on
another ahead of use; a missing wait between those streams and the compute stream is a data race
that gives wrong gradients only sometimes. TORCH_CUDA_SANITIZER=1 (set by the driver for this
stage's process, before torch is imported) makes torch check every kernel's reads and writes
against the streams' synchronization and raise on a race, so a race fails the measurement that
ran into it, with the sanitizer's report in the log.

- sanitizer: that it is on (a check that silently ran without it proves nothing);
- offload_vs_plain: one forward + backward of a small block-AttnRes model with and without
  offload, same weights and tokens: gradients must agree (the copies are exact; bound 1e-4
  relative, against order-1 garbage from a race), and the device memory peak should drop; the
  pinned host memory (`train/pinned_pool.py`) about what was offloaded (each slab's tail
  beyond), and not growing on a second step (its slabs reused);
- trainer_offload: three steps of the real trainer with offload on: finite losses, bytes moved.

CPU has no streams to race on and torch's sanitizer asserts there (it asks for the current CUDA
stream), so the dry run runs the offload logic without it and reports the sanitizer skipped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

import torch

from gpu_stages.common import Context, OutOfBounds, Skipped, rel_err, sig
from gpu_stages.trainer import train

REAL = {"dim": 1024, "n_layers": 2, "n_heads": 16, "n_kv_heads": 4, "ffn_dim": 4096,
        "vocab": 8192, "seq": 1024, "batch": 4}  # fmt: skip
DRY = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128,
       "vocab": 256, "seq": 32, "batch": 2}  # fmt: skip
GRAD_RTOL = 1e-4


def run(ctx: Context) -> None:
    shapes = DRY if ctx.dry_run else REAL
    ctx.measure("sanitizer", lambda: sanitizer(ctx))
    ctx.measure("offload_vs_plain", lambda: offload_vs_plain(ctx, shapes))
    ctx.measure("trainer_offload", lambda: trainer_offload(ctx, shapes))


def sanitizer(ctx: Context) -> dict[str, Any]:
    if not ctx.cuda:
        raise Skipped("no CUDA device: torch's CUDA sanitizer checks CUDA streams")
    from torch.cuda import _sanitizer

    enabled = bool(getattr(_sanitizer.cuda_sanitizer, "enabled", False))
    if not enabled:
        raise OutOfBounds("TORCH_CUDA_SANITIZER is not in force in this process", {})
    return {"enabled": enabled}


def offload_vs_plain(ctx: Context, s: dict) -> dict[str, Any]:
    from depthscale.config import ModelConfig
    from depthscale.model.transformer import Transformer, cross_entropy
    from depthscale.train.offload import OffloadStats, offload_activations

    cfg = ModelConfig(
        vocab_size=s["vocab"], dim=s["dim"], n_layers=s["n_layers"], n_heads=s["n_heads"],
        n_kv_heads=s["n_kv_heads"], ffn_dim=s["ffn_dim"], max_seq_len=s["seq"],
        residual="block", attnres_block_size=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Transformer(cfg).to(ctx.device)
    gen = torch.Generator(ctx.device).manual_seed(1)
    tokens = torch.randint(0, s["vocab"], (s["batch"], s["seq"] + 1), generator=gen,
                           device=ctx.device)  # fmt: skip
    x, y = tokens[:, :-1], tokens[:, 1:]
    params = list(model.parameters())

    def step(stats: OffloadStats | None) -> tuple[list[torch.Tensor], float, float | None]:
        model.zero_grad(set_to_none=True)
        ctx.sync()
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        hooks = offload_activations(stats) if stats is not None else contextlib.nullcontext()
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16), hooks:
            loss = cross_entropy(model(x), y)
        loss.backward()
        ctx.sync()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if ctx.cuda else None
        return [p.grad.detach().clone() for p in params], loss.item(), peak

    from depthscale.train import offload
    from depthscale.train.pinned_pool import SLAB_BYTES

    def pinned() -> int:
        return sum(pool.pinned_bytes for pool in offload._pools.values())

    ref_grads, ref_loss, ref_peak = step(None)
    stats = OffloadStats()
    grads, loss, peak = step(stats)
    pinned_once = pinned()
    step(OffloadStats())  # a second step takes its host copies from the same pinned slabs
    err = max(rel_err(g, r) for g, r in zip(grads, ref_grads))
    values = {
        "offloaded_mib": sig(stats.bytes / 2**20),
        "pinned_mib": sig(pinned_once / 2**20),
        "pinned_mib_after_second_step": sig(pinned() / 2**20),
        "loss": sig(loss, 6),
        "loss_plain": sig(ref_loss, 6),
        "grad_rel_err_max": sig(err, 3),
        "stats": dataclasses.asdict(stats),
        "peak_mib": sig(peak) if peak is not None else None,
        "peak_mib_plain": sig(ref_peak) if ref_peak is not None else None,
    }
    if not stats.tensors:
        raise OutOfBounds("offload moved no tensor", values)
    if not err <= GRAD_RTOL:
        raise OutOfBounds(f"gradients with offload differ by {err:.2e} > {GRAD_RTOL:.0e}", values)
    if pinned() != pinned_once:
        raise OutOfBounds("pinned host memory grew on the second step: slabs not reused", values)
    slabs = sum(len(pool.slabs) for pool in offload._pools.values())
    if pinned_once > stats.bytes + slabs * SLAB_BYTES:
        raise OutOfBounds("more host memory pinned than offloaded plus a slab's tail each", values)
    return values


def trainer_offload(ctx: Context, s: dict) -> dict[str, Any]:
    plan = {"warm": 1, "timed": 2, "log_every": 1}
    extra = (
        *("--train.offload_activations", "true", "--model.n_layers", str(s["n_layers"])),
        *("--model.dim", str(s["dim"]), "--model.n_heads", str(s["n_heads"])),
        *("--model.n_kv_heads", str(s["n_kv_heads"]), "--model.ffn_dim", str(s["ffn_dim"])),
        *("--model.attnres_block_size", "2", "--data.seq_len", str(s["seq"])),
        *("--train.batch_size", str(s["batch"]), "--train.micro_batch_size", str(s["batch"])),
    )
    values = train(ctx, "block", False, plan, extra)
    if not all(isinstance(v, float) and math.isfinite(v) for v in values["losses"]):
        raise OutOfBounds(f"non-finite losses with offload: {values['losses']}", values)
    if not values.get("offloaded_mb"):
        raise OutOfBounds("the trainer offloaded nothing", values)
    return values
