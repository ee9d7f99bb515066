"""Stage calibrate: the efficiencies `depthscale plan` assumes for this GPU, measured, written as a
cluster description the planner reads (`depthscale plan --cluster cluster.json`).

- gemm_curve: bf16 GEMMs [8192 × x] · [x × 8192] for x from 64 to 4096 (the smallest dimension
  decides how full the machine gets), each as a fraction of the preset's dense bf16 peak;
- attention_efficiency: SDPA's fused causal attention (the flash kernel) at B = 2, H = 32,
  T = 4096, d = 128, forward, charged as the planner charges it (4·B·T²·H·d / 2 FLOPs);
- memory_efficiency: an elementwise pass over 1 GiB (read + write) against the preset's HBM
  bandwidth.

The rest (links, node size, memory) is the preset's: one GPU measures no fabric. The description
(one line, and `cluster.json` beside gpu_check.jsonl) names what it measured, so `plan` prints
those as measured and the rest as assumed. Commit it under benchmarks/results/ with the device and
the date (docs/gpu.md). Under --dry-run: CPU fp32, tiny shapes, the h100 preset's numbers beside
(the file then describes nothing real and says so in its name).
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.nn.functional as F

from gpu_stages.common import Context, sig, time_ms

REAL = {"wide": 8192, "sides": (64, 128, 256, 512, 1024, 2048, 4096),
        "attention": (2, 32, 4096, 128), "elements": 2**29, "warmup": 3, "reps": 10}  # fmt: skip
DRY = {"wide": 256, "sides": (16, 32, 64), "attention": (1, 2, 128, 16), "elements": 2**20,
       "warmup": 1, "reps": 2}  # fmt: skip


def run(ctx: Context) -> None:
    ctx.measure("cluster", lambda: cluster(ctx))


def _preset(ctx: Context):
    from depthscale.plan.hardware import PRESETS

    name = torch.cuda.get_device_name().lower() if ctx.cuda else "h100"
    for key in ("h200", "h100", "a100"):
        if key in name:
            return key, PRESETS[key]
    return None, None


def cluster(ctx: Context) -> dict[str, Any]:
    s = DRY if ctx.dry_run else REAL
    key, preset = _preset(ctx)
    if preset is None:
        raise RuntimeError(f"no preset for {torch.cuda.get_device_name()}: nothing to calibrate")
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    peak = preset.peak("bfloat16")
    gen = torch.Generator(ctx.device).manual_seed(0)
    curve = []
    wide = s["wide"]
    for x in s["sides"]:
        a = torch.randn(wide, x, generator=gen, device=ctx.device).to(dtype)
        b = torch.randn(x, wide, generator=gen, device=ctx.device).to(dtype)
        ms = time_ms(ctx, lambda a=a, b=b: a @ b, s["warmup"], s["reps"])
        curve.append((x, sig(2 * wide * wide * x / (ms / 1e3) / peak, 3)))
    B, H, T, d = s["attention"]
    q = torch.randn(B, H, T, d, generator=gen, device=ctx.device).to(dtype)
    ms = time_ms(ctx, lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True),
                 s["warmup"], s["reps"])  # fmt: skip
    attention = 4 * B * T * T * H * d * 0.5 / (ms / 1e3) / peak
    x = torch.empty(s["elements"], dtype=dtype, device=ctx.device).fill_(1.0)
    out = torch.empty_like(x)
    ms = time_ms(ctx, lambda: torch.mul(x, 2.0, out=out), s["warmup"], s["reps"])
    memory = 2 * x.numel() * x.element_size() / (ms / 1e3) / preset.hbm_bw
    device = torch.cuda.get_device_name() if ctx.cuda else "cpu (dry run: not a GPU)"
    description = {
        "name": f"{key}-measured" if ctx.cuda else "dry-run",
        "device": device,
        "peak_flops": preset.peak_flops,
        "hbm_bytes": torch.cuda.mem_get_info()[1] if ctx.cuda else preset.hbm_bytes,
        "hbm_bw": preset.hbm_bw,
        "gpus_per_node": preset.gpus_per_node,
        "intra_bw": preset.intra_bw,
        "inter_bw": preset.inter_bw,
        "gemm_efficiency": 1.0,  # the curve holds the fractions of peak
        "gemm_curve": curve,
        "attention_efficiency": sig(min(attention, 1.0), 3),
        "memory_efficiency": sig(min(memory, 1.0), 3),
        "comm_efficiency": preset.comm_efficiency,
        "measured": ["gemm_efficiency", "attention_efficiency", "memory_efficiency"],
    }
    (ctx.jsonl.parent / "cluster.json").write_text(json.dumps(description, indent=1) + "\n")
    return description
