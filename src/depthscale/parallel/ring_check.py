"""Ring attention at cp = 1 against one SDPA call: what the GPU check's ring stage measures.

At cp = 1 the ring has one step and nothing to send, so any time it takes over the single-device
attention is the ring's own overhead: planning, tile cutting, merges, fp32 accumulators. With the
whole-step policy on CUDA's flash op (`attention_dispatch.TilePolicy`) that step is one causal flash
call whose result is copied (not merged) into the output, so the goal is ≤ 1.10× one SDPA call.

`ring_vs_sdpa` runs `RingAttention` exactly as the trainer installs it (`apply_context_parallel`:
declared zigzag layout, default `kv_tile`, the model's dtype, causal) on a world-1 process group
(created for the call and destroyed after it when none exists), against the single-device path
the trainer takes without context parallelism (`layers.sdpa_attention`), forward + backward.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from depthscale.model import attention_tiles
from depthscale.model.layers import sdpa_attention
from depthscale.parallel.context_parallel import RingAttention, positions_for


def _time_ms(fn: Callable[[], object], device: torch.device, warmup: int, reps: int) -> float:
    """Median milliseconds of fn(): CUDA events on a GPU, the host clock elsewhere."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def ring_vs_sdpa(
    device: torch.device | str,
    T: int = 16384,
    B: int = 1,
    H: int = 32,
    Hkv: int = 8,
    d: int = 64,
    window: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    time_ms: Callable[[Callable[[], object]], float] | None = None,
    warmup: int = 2,
    reps: int = 5,
) -> dict[str, Any]:
    """Forward + backward of the trainer's ring attention at cp = 1 and of one SDPA call on the
    same q, k, v [B, H(kv), T, d] (llama-1b's heads by default) and output gradient.

    Returns ring_ms, sdpa_ms, ring_over_sdpa (goal ≤ 1.10 on a GPU), the output's and dQ's error
    relative to SDPA's largest entry (both in `dtype`), the ring's tiles at its one step
    (`tiles`: kernel path of each) and the tile policy. `time_ms(fn)`: the caller's timer (the
    GPU check's), else the median of `reps` runs after `warmup`."""
    device = torch.device(device)
    if dist.is_initialized() and dist.get_world_size() != 1:
        raise ValueError(
            f"ring_vs_sdpa measures the ring at cp = 1: run it in a single process (world size "
            f"{dist.get_world_size()} here)"
        )
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return _compare(device, T, B, H, Hkv, d, window, dtype, time_ms, warmup, reps)
    finally:
        if created:
            dist.destroy_process_group()


def _compare(device, T, B, H, Hkv, d, window, dtype, time_ms, warmup, reps) -> dict[str, Any]:
    g = torch.Generator(device).manual_seed(0)
    q, dy = (torch.randn(B, H, T, d, generator=g, device=device, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(B, Hkv, T, d, generator=g, device=device, dtype=dtype) for _ in range(2))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    ring = RingAttention(dist.group.WORLD, layout="zigzag")  # what apply_context_parallel builds
    pos = positions_for(T, 0, 1, "zigzag").to(device)

    def run(attend) -> tuple[torch.Tensor, torch.Tensor]:
        for t in leaves:
            t.grad = None
        out = attend(*leaves)
        out.backward(dy)
        return out.detach(), leaves[0].grad

    def ring_call(q, k, v):
        return ring(q, k, v, pos, pos, window)

    def sdpa_call(q, k, v):
        return sdpa_attention(q, k, v, None, None, window)

    want_out, want_dq = run(sdpa_call)
    got_out, got_dq = run(ring_call)
    timer = time_ms or (lambda fn: _time_ms(fn, device, warmup, reps))
    ring_ms, sdpa_ms = timer(lambda: run(ring_call)), timer(lambda: run(sdpa_call))
    plan = ring.plan(T, window, device, attention_tiles.policy(q))
    return {
        "T": T,
        "shape": [B, H, Hkv, d],
        "dtype": str(dtype).removeprefix("torch."),
        "policy": "whole" if plan.policy.whole else "bounded",
        "tiles": [attention_tiles.path(q, plan.tile_mask(t)) for t in plan.tiles(0)],
        "ring_ms": ring_ms,
        "sdpa_ms": sdpa_ms,
        "ring_over_sdpa": ring_ms / sdpa_ms,
        "out_rel_err": _rel(got_out, want_out),
        "dq_rel_err": _rel(got_dq, want_dq),
    }


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.float()
    return float((got.float() - want).abs().max() / want.abs().max().clamp(min=1e-30))
