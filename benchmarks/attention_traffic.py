"""Attention with its scores in memory (Megatron's unfused `CoreAttention`) on this CPU, timed
across hidden sizes and micro-batches, against the planner's charge (`plan/kernels.py`): the two
batched GEMMs at the measured GEMM rate plus the scores' passes — bytes per score element derived
from the kernels — at the measured memory bandwidth. Beside it the charge the estimate had (12
bytes per element forward, 24 backward, extrapolated from one measured 22B layer).

    python benchmarks/attention_traffic.py [--seq 512 --head-dim 32 --rounds 5
                                            --out benchmarks/results/attention_traffic_cpu.json]

fp32 (this CPU's compute dtype; the charge scales with the element size), dropout 0.1 as the
published GPT runs. Prints one JSON object: per (hidden, micro-batch) the measured and predicted
seconds of forward + backward and their ratio, the share of the prediction that is traffic, and
the median absolute error of both charges. Absolute times only mean something on a GPU; here the
point is whether the traffic term follows the measured curve as h and the micro-batch change.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import device_info, interleaved_times, print_result  # noqa: E402

from depthscale.parallel.calibrate import describe, measure_compute  # noqa: E402
from depthscale.plan.hardware import Cluster  # noqa: E402
from depthscale.plan.kernels import UnfusedAttention  # noqa: E402

HIDDEN = (64, 128, 256, 512)
MICRO_BATCHES = (1, 2, 4, 8)
DROPOUT = 0.1
OLD_BYTES = (12.0, 24.0)
"""The estimate's former charge per score element, forward and backward (any dtype)."""


def _step(q, k, v, grad, dropout: float):
    def run():
        for t in (q, k, v):
            t.grad = None
        probs = torch.softmax(torch.bmm(q, k.transpose(1, 2)), dim=-1)
        if dropout:
            probs = torch.native_dropout(probs, dropout, True)[0]
        torch.bmm(probs, v).backward(grad)

    return run


def _bmm_only(q, k, v, grad):
    """The same GEMMs (forward and backward) with nothing between them: what the scores' passes
    add is the difference."""

    def run():
        for t in (q, k, v):
            t.grad = None
        torch.bmm(torch.bmm(q, k.transpose(1, 2)), v).backward(grad)

    return run


def _predict(c: Cluster, mb: int, heads: int, seq: int, head_dim: int, per_score: tuple) -> dict:
    flops = 4 * mb * heads * seq * seq * head_dim  # QKᵀ and PV, forward
    bmm = flops / c.gemm_flops("float32", min(seq, head_dim))
    scores = mb * heads * seq * seq
    traffic = scores * sum(per_score) / c.hbm_bw
    return {"seconds": 3 * bmm + traffic, "traffic_share": traffic / (3 * bmm + traffic)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    fields = describe(1, measure_compute(1), {})
    cluster = Cluster(**{k: v for k, v in fields.items() if k != "measured"})
    charge = UnfusedAttention(4, True)
    derived = (charge.forward_bytes, charge.backward_bytes)
    rows = []
    for h in HIDDEN:
        heads = h // args.head_dim
        for mb in MICRO_BATCHES:
            g = torch.Generator().manual_seed(0)
            shape = (mb * heads, args.seq, args.head_dim)
            q, k, v = (torch.randn(shape, generator=g).requires_grad_() for _ in range(3))
            grad = torch.randn(shape, generator=g)
            times = interleaved_times(
                {
                    "dropout": _step(q, k, v, grad, DROPOUT),
                    "no_dropout": _step(q, k, v, grad, 0.0),
                    "gemms": _bmm_only(q, k, v, grad),
                },
                args.rounds,
            )
            measured = times["dropout"]
            new = _predict(cluster, mb, heads, args.seq, args.head_dim, derived)
            old = _predict(cluster, mb, heads, args.seq, args.head_dim, OLD_BYTES)
            scores = mb * heads * args.seq * args.seq
            # the scores' passes alone: measured bytes/s of softmax (and dropout), forward and back
            passes = {
                "dropout": (times["dropout"] - times["gemms"], sum(derived)),
                "no_dropout": (
                    times["no_dropout"] - times["gemms"],
                    sum(
                        (
                            UnfusedAttention(4, False).forward_bytes,
                            UnfusedAttention(4, False).backward_bytes,
                        )
                    ),
                ),
            }
            rows.append({
                "hidden": h, "micro_batch": mb, "measured_s": measured,
                "predicted_s": new["seconds"], "ratio": new["seconds"] / measured,
                "traffic_share": new["traffic_share"],
                "old_predicted_s": old["seconds"], "old_ratio": old["seconds"] / measured,
                "score_passes_bytes_per_s": {
                    k: b * scores / max(t, 1e-9) for k, (t, b) in passes.items()
                },
            })  # fmt: skip
    result = {
        **device_info(),
        "seq": args.seq,
        "head_dim": args.head_dim,
        "bytes_per_score": {"derived": derived, "old": OLD_BYTES},
        "rates": {"hbm_bw": cluster.hbm_bw, "peak_flops": cluster.peak("float32")},
        "rows": rows,
        "median_abs_error": statistics.median(abs(r["ratio"] - 1) for r in rows),
        "old_median_abs_error": statistics.median(abs(r["old_ratio"] - 1) for r in rows),
        "score_passes_over_calibrated_bw": {
            k: [r["score_passes_bytes_per_s"][k] / cluster.hbm_bw for r in rows]
            for k in ("dropout", "no_dropout")
        },
    }
    print_result(result, args.out)


if __name__ == "__main__":
    main()
