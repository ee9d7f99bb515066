"""Single-process attention, forward + backward: full causal SDPA against a causal sliding window,
computed blockwise (`model/window_attention.py`: on CPU in fp32 the banded kernel, one variant per
block size; the same blocks on torch's fused flash kernel, the bf16 path, as `window_flash_tiles`)
and with the dense [T, T] window mask it replaces.

    python benchmarks/attention.py [--seq 4096 --window 512 --heads 8 --kv-heads 2 --head-dim 64
                                    --blocks 32 16 64 --rounds 5 --threads 1]

Interleaved rounds (drift hits every variant alike); prints one JSON object: median seconds per
variant, each over full causal (the goal: a window of 512 at T = 4096 costs ≤ 0.3× of it), and the
largest difference of the blockwise outputs and gradients from the dense-mask reference, relative
to the largest entry.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _common import device_info, interleaved_times  # noqa: E402

from depthscale.kernels import use_cpu_kernels  # noqa: E402
from depthscale.model.layers import attention_mask  # noqa: E402
from depthscale.model.window_attention import TILE_BLOCK, window_attention  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--blocks", type=int, nargs="+", default=[32, 16, 64])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, T, d = args.batch, args.heads, args.kv_heads, args.seq, args.head_dim
    q = torch.randn(B, H, T, d, generator=g).to(device)
    k, v = (torch.randn(B, Hkv, T, d, generator=g).to(device) for _ in range(2))
    do = torch.randn(B, H, T, d, generator=g).to(device)
    mask = attention_mask(
        torch.arange(T, device=device), torch.arange(T, device=device), args.window
    )

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(do)
        return [out.detach(), *(t.grad for t in leaves)]

    variants = {
        "full_causal": lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True
        ),
        "window_dense_mask": lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=True
        ),
    }
    for b in args.blocks:
        variants[f"window_blockwise_{b}"] = lambda q, k, v, b=b: window_attention(
            q, k, v, args.window, b
        )

    def tiles(q, k, v):  # torch's fused flash kernel per block (the bf16 path), its own block
        with use_cpu_kernels(False):
            return window_attention(q, k, v, args.window)

    if device.type == "cpu":
        variants[f"window_flash_tiles_{TILE_BLOCK}"] = tiles
    seconds = interleaved_times(
        {name: lambda fn=fn: run(fn) for name, fn in variants.items()}, args.rounds
    )
    reference = run(variants["window_dense_mask"])
    errors = {}
    for name in variants:
        if name.startswith(("window_blockwise", "window_flash_tiles")):
            got = run(variants[name])
            errors[name] = {
                part: float((a - r).abs().max() / r.abs().max())
                for part, a, r in zip(("out", "dq", "dk", "dv"), got, reference, strict=True)
            }
    full = seconds["full_causal"]
    print(
        json.dumps(
            {
                "benchmark": "attention",
                **device_info(),
                "config": vars(args),
                "seconds": {k: round(s, 4) for k, s in seconds.items()},
                "over_full_causal": {k: round(s / full, 3) for k, s in seconds.items()},
                "max_rel_diff_vs_dense_mask": errors,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
