"""Triton AttnRes kernels against the PyTorch ops and torch.compile'd PyTorch ops.

    python benchmarks/attnres_kernel.py [--dim 2048 --seq 2048 --batch 4 --sources 8 --queries 4
                                         --dtype bf16 --rounds 20]

Prints one JSON object. For phase 1 (`multi_query_read`: S queries over m sources) and phase 2
(`merge_partial`), each of `triton`, `torch` and `compiled` gets the median time of the forward and
of forward + backward, and the achieved bandwidth: the minimum bytes such a pass must move (every
input it needs read once, every output written once; the [S, d] queries and [d] query included) over
its time. Ratios are speed-ups of Triton (time of the other / time of Triton). `max_abs_diff` is a
sanity check of Triton against PyTorch on the same inputs. Needs CUDA: elsewhere it prints
{"skipped": "no CUDA device"} and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import device_info, interleaved_times  # noqa: E402

from depthscale import kernels  # noqa: E402
from depthscale.model.attnres_ops import merge_partial, multi_query_read  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
EPS = 1e-6


def _impls(op, triton_op):
    """name -> op with the same signature; the PyTorch ones pinned to PyTorch on any device."""
    compiled = torch.compile(op)

    def pinned(fn):
        def run(*args):
            with kernels.use_triton(False):
                return fn(*args)

        return run

    return {"triton": triton_op, "torch": pinned(op), "compiled": pinned(compiled)}


def _measure(impls, inputs, needs_grad, upstream, fwd_bytes, bwd_bytes, rounds):
    """Times forward and forward + backward (torch.autograd.grad: no .grad accumulation traffic)."""

    def fwd(fn):
        def run():
            with torch.no_grad():
                fn(*inputs)

        return run

    def fwd_bwd(fn):
        def run():
            outs = fn(*inputs)
            outs = outs if isinstance(outs, tuple) else (outs,)
            torch.autograd.grad(outs, needs_grad, upstream)

        return run

    t_fwd = interleaved_times({k: fwd(f) for k, f in impls.items()}, rounds)
    t_all = interleaved_times({k: fwd_bwd(f) for k, f in impls.items()}, rounds)
    report = {}
    for pass_name, times, n_bytes in (
        ("fwd", t_fwd, fwd_bytes),
        ("fwd_bwd", t_all, fwd_bytes + bwd_bytes),
    ):
        report[pass_name] = {
            "min_bytes": n_bytes,
            "time_s": times,
            "gb_per_s": {k: n_bytes / t / 1e9 for k, t in times.items()},
            "speedup_triton_vs": {k: times[k] / times["triton"] for k in ("torch", "compiled")},
        }
    return report


def bench(args: argparse.Namespace, device: torch.device) -> dict:
    from depthscale.kernels.attnres_triton import triton_merge_partial, triton_multi_query_read

    dtype = DTYPES[args.dtype]
    B, T, d, m, S = args.batch, args.seq, args.dim, args.sources, args.queries
    N, e = B * T, dtype.itemsize
    gen = torch.Generator(device).manual_seed(0)

    def randn(*shape, dt=torch.float32, scale=1.0):
        t = torch.randn(*shape, generator=gen, device=device) * scale
        return t.to(dt).requires_grad_()

    sources, queries = [randn(B, T, d, dt=dtype) for _ in range(m)], randn(S, d, scale=0.5)
    with torch.no_grad(), kernels.use_triton(False):
        ref_out, ref_lse = multi_query_read(sources, queries, EPS)
    got_out, got_lse = triton_multi_query_read(sources, queries, EPS)
    phase1 = _measure(
        _impls(multi_query_read, triton_multi_query_read),
        (sources, queries, EPS),
        [queries, *sources],
        [torch.randn_like(ref_out), torch.randn_like(ref_lse)],
        fwd_bytes=m * N * d * e + S * d * 4 + S * N * (d + 1) * 4,
        bwd_bytes=2 * m * N * d * e + S * N * (d + 2) * 4 + 2 * S * d * 4,  # + saved lse, d_lse
        rounds=args.rounds,
    )
    phase1["max_abs_diff"] = max(
        (got_out - ref_out).abs().max().item(), (got_lse - ref_lse).abs().max().item()
    )

    inter_out, inter_lse = randn(B, T, d), randn(B, T, scale=3.0)
    partial, query = randn(B, T, d, dt=dtype), randn(d, scale=0.5)
    inputs = (inter_out, inter_lse, partial, query, EPS)
    with torch.no_grad(), kernels.use_triton(False):
        ref_h = merge_partial(*inputs)
    phase2 = _measure(
        _impls(merge_partial, triton_merge_partial),
        inputs,
        list(inputs[:4]),
        [torch.randn_like(ref_h)],
        fwd_bytes=N * (d + 1) * 4 + 2 * N * d * e + d * 4,  # o, lse; p, h; w
        bwd_bytes=2 * N * (d + 1) * 4 + 3 * N * d * e + 2 * d * 4,  # o, lse, d_o, d_lse; dh, p, dp
        rounds=args.rounds,
    )
    phase2["max_abs_diff"] = (
        (triton_merge_partial(*inputs).float() - ref_h.float()).abs().max().item()
    )
    return {
        "benchmark": "attnres_kernel",
        **device_info(),
        "config": vars(args),
        "phase1_multi_query_read": phase1,
        "phase2_merge_partial": phase2,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--sources", type=int, default=8, help="m: completed blocks read in phase 1")
    ap.add_argument("--queries", type=int, default=4, help="S: queries per block in phase 1")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return
    print(json.dumps(bench(args, torch.device("cuda")), indent=2))


if __name__ == "__main__":
    main()
