"""HBM traffic of the AttnRes Triton read, modelled on CPU from the kernels' own launch plans.

For each shape the model asks `attnres_triton_config` for the launch the GPU would run
(`read_forward_launch`, `read_backward_launch`: the functions the launcher calls, so the model
cannot drift from it), walks each kernel's grid and loops — which tensor every program reads and
writes, how many times — and counts a byte as HBM traffic the first time it is touched, and again
on a re-read only when the re-read falls outside L2 under the reuse model below. It prints one JSON
object: per shape the modelled bytes per token, the minimum, their ratio and the expected fraction
of HBM bandwidth (minimum / modelled: what a kernel that streams its bytes at full bandwidth would
show as effective bandwidth on the minimum, the figure `scripts/gpu_check.py` measures).

Minimum per token (bf16, e = 2 bytes): forward (m + S)·e·d — read m sources once, write S outputs;
backward (2m + S)·e·d — read m sources and S upstream gradients, write m source gradients. The
issue's (m + 1)·2d and (2m + 1)·2d are the S = 1 case; S outputs (or S upstream gradients) of d
values each are part of any implementation's minimum.

Reuse model (stated, not measured; checked against a GPU by `scripts/gpu_check.py`):
- L2: `L2_BYTES` (50 MB) of an H100 SXM, of which `L2_USABLE` (half: 25 MiB) is counted on for
  reuse — the rest for other traffic, set conflicts, and lines held in both of the L2's two
  partitions (an SM far from a line's home partition may cache a copy near it).
- Forward: a token block's m·n_parts logits items and n_chunks weighted-sum items take adjacent
  tickets (`_read_forward_kernel`). A sum item re-reads source bytes a logits item of its block
  read shortly before; the bytes the whole GPU reads in between (the reuse distance) are at most
  two token blocks' rows (the block's own and the next one's, whose items run alongside) plus one
  logits item's bytes for every resident program. The re-read is an L2 hit when the distance fits
  the usable L2, else HBM traffic.
- Programs resident at once: SMs × programs per SM, from the registers (`--aot` reads them from
  the AOT build of each variant; without it, the hardware's most: 2048 threads per SM) — the more
  programs, the longer the reuse distance, so the default is the conservative one.
- Backward: one launch of ticketed items too (`_read_backward_kernel`): a token block's logits
  items (part × group of sources, part-major: the groups reading one part's upstream rows are
  neighbours, so those rows come from HBM once), then its gradient items (d-chunks), which re-read
  the block's sources and upstream gradients. From the block's first ticket to its last, the
  tickets started are its own items and at most one more per resident program, so the bytes read
  and written in between are at most 1 + ceil(resident / items per block) whole blocks (a block:
  tokens × (2m + S)·d elements, the plan's `block_bytes`) plus the dw lanes; the re-read is an L2
  hit when that fits the usable L2, else HBM traffic. The dw lanes (n_lanes × S_PAD × d fp32) are
  touched by every block, so they stay in L2: written back once, read once by the torch sum.
- fp32 scratch (partial dots, logits, lse, softmax weights) is counted once written (the dirty
  lines reach HBM); its re-read within the launch that wrote it, moments later, is an L2 hit.
  Queries [S, d] fp32 are counted once per launch (amortised over N; re-reads of [S_PAD, chunk]
  by every item hit L2). Chained gradients (a source's later reads' sum, added in place) are
  not modelled: they add m·2d to the bytes and to the minimum alike.

`python benchmarks/attnres_traffic.py [--aot] [--out FILE]` (default N = 16384 tokens, bf16).
`traffic(d, S, m)` is importable (`scripts/gpu_check.py` compares a measured bandwidth with it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from depthscale.kernels import attnres_triton_config as config

SMS = 132
"""H100 SXM multiprocessors."""

L2_BYTES = 50 * 2**20
L2_USABLE = 0.5
"""Share of L2 the reuse model counts on."""

THREADS_PER_SM = 2048
REGISTERS_PER_SM = 65536
ELEMENT = {"bf16": 2, "fp16": 2, "fp32": 4}

DS = (2048, 4096, 8192)
QUERIES = (1, 8, 16, 32)
SOURCES = (2, 4, 8, 16)
TOKENS = 16384

FORWARD_LIMIT = 1.15
BACKWARD_LIMIT = 1.6


def resident_programs(variant: config.Variant, regs: int | None) -> int:
    """Programs of `variant` resident on the whole GPU: by registers where known, else by the
    thread limit alone."""
    threads = variant.num_warps * 32
    per_sm = THREADS_PER_SM // threads
    if regs is not None:
        per_sm = min(per_sm, REGISTERS_PER_SM // (regs * threads))
    return SMS * max(per_sm, 1)


@dataclass
class Traffic:
    """Bytes per token of one read, forward or backward."""

    bytes_per_token: float
    minimum_per_token: float
    detail: dict[str, float]

    @property
    def ratio(self) -> float:
        return self.bytes_per_token / self.minimum_per_token

    def record(self) -> dict:
        return {
            "bytes_per_token": round(self.bytes_per_token, 1),
            "minimum_per_token": self.minimum_per_token,
            "ratio": round(self.ratio, 4),
            "expected_bandwidth_fraction": round(1 / self.ratio, 4),
            "detail": {k: round(v, 1) for k, v in self.detail.items()},
        }


def forward(d: int, S: int, m: int, dtype: str = "bf16", N: int = TOKENS,
            regs: dict[config.Variant, int] | None = None) -> Traffic:  # fmt: skip
    plan = config.read_forward_launch(N, d, m, S, dtype)
    meta, e = plan.variant.meta, ELEMENT[dtype]
    s_pad, block_n = meta["S_PAD"], meta["BLOCK_N"]
    resident = resident_programs(plan.variant, (regs or {}).get(plan.variant))
    block_bytes = block_n * m * d * e
    logits_item_bytes = block_n * min(plan.part, d) * e
    reuse_distance = 2 * block_bytes + resident * logits_item_bytes
    reread_hits = reuse_distance <= L2_BYTES * L2_USABLE
    detail = {
        "sources_first_read": m * d * e,  # every logits item's columns, each source once
        "sources_reread": 0.0 if reread_hits else m * d * e,
        "outputs_written": S * d * e,
        # partial dots and squares: written by the logits items, read back in L2 by the last one
        "scratch_partials_written": plan.n_parts * m * (s_pad + 1) * 4,
        "logits_lse_written": m * s_pad * 4 + S * 4,
        "queries": s_pad * d * 4 / N,
        "sync": (1 + 2 * plan.n_blocks) * 4 / N,
    }
    total = sum(detail.values())
    detail["reuse_distance_bytes"] = reuse_distance
    detail["resident_programs"] = resident
    return Traffic(total, (m + S) * d * e, detail)


def backward(d: int, S: int, m: int, dtype: str = "bf16", N: int = TOKENS,
             regs: dict[config.Variant, int] | None = None) -> Traffic:  # fmt: skip
    plan = config.read_backward_launch(N, d, m, S, dtype)
    e, s_pad = ELEMENT[dtype], plan.variant.meta["S_PAD"]
    resident = resident_programs(plan.variant, (regs or {}).get(plan.variant))
    lane_bytes = plan.n_lanes * s_pad * d * 4
    # tickets started from a block's first logits item to its last gradient item: its own items
    # and at most `resident` more, so at most 1 + ceil(resident / items) whole blocks of bytes
    blocks_spanned = 1 + -(-resident // plan.items_per_block)
    reuse_distance = blocks_spanned * plan.block_bytes + lane_bytes
    reread_hits = reuse_distance <= L2_BYTES * L2_USABLE
    rows = 2 * s_pad + 1  # fp32 per source and token: S_PAD dots / a, S_PAD P / g, Σv² / c
    detail = {
        "sources_read": m * d * e,
        "upstream_read": S * d * e,  # one part's upstream rows: shared by neighbouring items
        "gradients_written": m * d * e,
        # the gradient items' re-read of the block's sources and upstream gradients
        "reread": 0.0 if reread_hits else (m + S) * d * e,
        # partial dots, P and Σv², written by the logits items, read in L2 by the last one
        "scratch_partials_written": plan.n_parts * m * rows * 4,
        # a, g, c: written once, read in L2 by the block's gradient items
        "scratch_weights_written": m * rows * 4,
        "lse_dlse_read": 2 * S * 4,
        "queries": s_pad * d * 4 / N,
        # dw lanes: L2-resident between links, written back once, read once by the torch sum
        "dw_lanes": 2 * lane_bytes / N,
        "sync": (1 + 2 * plan.n_blocks + plan.n_lanes * plan.n_chunks) * 4 / N,
    }
    total = sum(detail.values())
    detail["reuse_distance_bytes"] = reuse_distance
    detail["resident_programs"] = resident
    detail["block_tokens"] = plan.block_n
    detail["dw_lanes_count"] = plan.n_lanes
    return Traffic(total, (2 * m + S) * d * e, detail)


def traffic(d: int, S: int, m: int, dtype: str = "bf16", N: int = TOKENS,
            regs: dict[config.Variant, int] | None = None) -> dict:  # fmt: skip
    """The model at one shape: {"forward": record, "backward": record}."""
    return {
        "forward": forward(d, S, m, dtype, N, regs).record(),
        "backward": backward(d, S, m, dtype, N, regs).record(),
    }


def _aot(dtype: str) -> tuple[dict[config.Variant, int], dict[str, dict]]:
    """Registers and PTX access widths of every variant the modelled shapes launch, sm_90a."""
    from depthscale.kernels import aot

    variants = {}
    for d in DS:
        for S in QUERIES:
            variants[config.read_forward_variant(d, S, dtype)] = None
            for m in SOURCES:
                variants[config.read_backward_launch(TOKENS, d, m, S, dtype).variant] = None
    regs, report = {}, {}
    for v, _, usage in aot.compile_many(list(variants), archs=(90,)):
        if isinstance(usage, str):
            raise RuntimeError(f"{v.describe()}: {usage}")
        regs[v] = usage.regs
        narrow_load, narrow_store, wide_load = usage.data_access_bits()
        report[v.describe()] = {"regs": usage.regs, "spill_bytes": usage.spill_store_bytes,
                                "narrowest_data_load_bits": narrow_load,
                                "narrowest_data_store_bits": narrow_store,
                                "widest_data_load_bits": wide_load}  # fmt: skip
    return regs, report


def model(dtype: str = "bf16", N: int = TOKENS, use_aot: bool = False) -> dict:
    regs, kernels = _aot(dtype) if use_aot else (None, {})
    shapes, worst = [], {"forward": 0.0, "backward": 0.0}
    for d in DS:
        for S in QUERIES:
            for m in SOURCES:
                record = {"d": d, "S": S, "m": m, **traffic(d, S, m, dtype, N, regs)}
                for k in worst:
                    worst[k] = max(worst[k], record[k]["ratio"])
                shapes.append(record)
    return {
        "model": "benchmarks/attnres_traffic.py",
        "dtype": dtype,
        "tokens": N,
        "gpu": {"sms": SMS, "l2_bytes": L2_BYTES, "l2_usable": L2_USABLE},
        "registers_from": "AOT build, sm_90a" if use_aot else "none (hardware maximum occupancy)",
        "worst_ratio": worst,
        "limits": {"forward": FORWARD_LIMIT, "backward": BACKWARD_LIMIT},
        "within_limits": {
            "forward": worst["forward"] <= FORWARD_LIMIT,
            "backward": worst["backward"] <= BACKWARD_LIMIT,
        },
        "kernels": kernels,
        "shapes": shapes,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--aot", action="store_true", help="registers from an AOT build (sm_90a)")
    parser.add_argument("--tokens", type=int, default=TOKENS)
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    result = model(N=args.tokens, use_aot=args.aot)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=Path(__file__).parent).stdout.strip()  # fmt: skip
    result = {"date": datetime.date.today().isoformat(), "commit": commit, **result}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
