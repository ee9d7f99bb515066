"""Ring attention (context parallelism) at a fixed total sequence length, cp = 1, 2, 4 in turn.

    python benchmarks/ring_attention.py [--seq 2048 --dim 512 --heads 8 --kv-heads 2 --rounds 5]

Spawns `cp` gloo workers per setting (one thread each) and prints ONE JSON object with, per cp:

* `activation_bytes_per_rank`: bytes autograd saves for backward in one attention layer's forward
  (projections + RoPE + ring attention) on each rank's shard — what must stay alive until backward;
  `sdpa_activation_bytes` is the single-process SDPA layer at cp=1 for comparison.
  `peak_rss_delta_bytes_per_rank`: the process's peak RSS growth over one forward+backward
  (Linux /proc high-water mark reset via clear_refs; approximate — allocator reuse hides some).
* `step_s`: one attention layer forward+backward (causal), slowest rank, median over rounds, for
  `zigzag` and `contiguous` side by side; `busy_s_per_rank`: ring time minus time blocked in waits
  (shows the causal imbalance of contiguous sharding); `blocks_computed_per_rank`.
* `peak_sent_kv_blocks_alive`: the most bytes handed to `isend` and still alive at once during
  one forward+backward (zigzag), in local K/V blocks (`_common.SentBuffers`, measured from outside
  the library so any revision compares); `peak_sent_bytes_alive_per_rank` in bytes.
* `plan_s_per_step`: CPU time one training step spends planning the ring for `--layers` attention
  layers (forward and backward share a call's plan): planned per call (all-gather of positions +
  tiles, what `ring_attention` does) vs with the sharding declared (`RingAttention(layout=...)`,
  what the trainer uses: planned once per shape and reused) — first step and steady state.
* `comm`: time blocked in `wait()` as a share of ring time (`exposed_fraction`), and the share of
  communication hidden behind compute, `hidden_fraction = 1 - blocked / comm_alone`, where
  `comm_alone` is the same ring run with the block math replaced by no-ops (pure transfer time).
  Blocked time also counts waiting for a slower peer, so the more direct measure is
  `added_by_comm_s`: the slowest rank's ring time (median over rounds) minus the same with nothing
  moved (`no_comm_ring_s_slowest`: every group "receives" zeros of the right shape at once, the
  compute is the same; the two alternate round by round, in ABBA order), and
  `hidden_vs_no_comm = 1 − added_by_comm / comm_alone` (slowest rank).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from _common import SentBuffers, device_info, peak_rss_delta, run_ranks  # noqa: E402

from depthscale.config import ModelConfig  # noqa: E402
from depthscale.model import attention_tiles  # noqa: E402
from depthscale.model.layers import Attention, rope_tables, sdpa_attention  # noqa: E402
from depthscale.parallel import context_parallel as cp_mod  # noqa: E402
from depthscale.parallel import cp_comm  # noqa: E402
from depthscale.parallel.ring_schedule import RingPlan, Span  # noqa: E402
from depthscale.train.offload import saved_activation_bytes  # noqa: E402

_STAND_INS: dict = {}


class _LocalBatch:
    """A posted group that moves nothing: its receives are ready at once, stand-ins of the right
    shape made once per shape (random normal, like the K/V the ring carries: zeros would change
    the kernels' arithmetic), which the ring only reads; its sends are dropped."""

    def __init__(self, recvs) -> None:
        self.bufs = {r.label: _stand_in(tuple(r.shape), r.dtype) for r in recvs}

    def recv(self, label: str):
        return self.bufs.pop(label)

    def wait_sends(self, peer=None) -> None:
        pass


def _stand_in(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    if (shape, dtype) not in _STAND_INS:
        g = torch.Generator().manual_seed(len(_STAND_INS))
        _STAND_INS[shape, dtype] = torch.randn(shape, generator=g).to(dtype)
    return _STAND_INS[shape, dtype]


def _local_post(self, sends, recvs, device):
    return _LocalBatch(recvs) if sends or recvs else None


def _noop_tile(q, k, v, mask, scale):
    return torch.zeros_like(q), torch.zeros(q.shape[:-1])


def _noop_tile_backward(do, q, k, v, out, lse, mask, scale):
    return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


def _worker(rank: int, cp: int, args: argparse.Namespace, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=cp)
    cfg = ModelConfig(
        dim=args.dim,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        max_seq_len=args.seq,
        vocab_size=64,
    )
    torch.manual_seed(0)
    attn = Attention(cfg)
    params = list(attn.parameters())
    x_full = torch.randn(args.batch, args.seq, args.dim, generator=torch.Generator().manual_seed(1))
    cos_t, sin_t = rope_tables(cfg.head_dim, args.seq, cfg.rope_theta)
    stats = cp_mod.RingStats()
    group = dist.group.WORLD
    # what the trainer installs: the sharding declared, one plan per shape for the run
    rings = {m: cp_mod.RingAttention(group, stats, layout=m) for m in ("zigzag", "contiguous")}

    def inputs(mode):
        x = cp_mod.shard_sequence(x_full, rank, cp, 1, mode).requires_grad_()
        pos = cp_mod.positions_for(args.seq, rank, cp, mode)
        return x, cos_t[pos], sin_t[pos], pos

    def step(mode):
        x, cos, sin, pos = inputs("contiguous" if mode == "sdpa" else mode)  # cp = 1: the same
        attn.attention_fn = sdpa_attention if mode == "sdpa" else rings[mode]
        attn(x, cos, sin, None if mode == "sdpa" else pos).sum().backward()

    out: dict = {"rank": rank}
    x, cos, sin, pos = inputs("zigzag")
    sent = SentBuffers().install()
    step("zigzag")
    out["peak_sent_bytes_alive"] = sent.peak
    hkv, local = cfg.n_kv_heads, args.seq // cp
    out["kv_block_bytes"] = 2 * args.batch * hkv * local * cfg.head_dim * 4  # K and V, fp32
    out["peak_rss_delta"] = peak_rss_delta(lambda: step("zigzag"))
    out["activation_bytes"] = saved_activation_bytes(lambda: attn(x, cos, sin, pos), params)
    if cp == 1:
        attn.attention_fn = sdpa_attention
        out["sdpa_activation_bytes"] = saved_activation_bytes(
            lambda: attn(x, cos, sin, None), params
        )

    modes = ("zigzag", "contiguous") + (("sdpa",) if cp == 1 else ())
    for mode in modes:  # warm-up
        step(mode)
    times = {m: [] for m in modes}
    ring = {m: [0.0, 0.0] for m in modes}  # ring_s, wait_s
    blocks = {}
    for _ in range(args.rounds):
        for mode in modes:  # interleaved so drift hits both
            dist.barrier()
            stats.reset()
            t0 = time.perf_counter()
            step(mode)
            times[mode].append(time.perf_counter() - t0)
            stats.settle()  # CUDA event times, once read
            if mode == "sdpa":
                continue
            ring[mode][0] += stats.ring_s
            ring[mode][1] += stats.wait_s
            blocks[mode] = stats.blocks_computed // 2  # per forward (backward computes the same)
    out["step_s"] = {m: times[m] for m in modes}
    modes = ("zigzag", "contiguous")
    out["ring_s"] = {m: ring[m][0] / args.rounds for m in modes}
    out["wait_s"] = {m: ring[m][1] / args.rounds for m in modes}
    out["blocks"] = blocks

    # the same message pattern with the block math removed: pure communication time
    real = attention_tiles.forward, attention_tiles.backward
    attention_tiles.forward, attention_tiles.backward = _noop_tile, _noop_tile_backward
    comm_alone = {m: 0.0 for m in modes}
    for _ in range(args.rounds):
        for mode in modes:
            dist.barrier()
            stats.reset()
            step(mode)
            comm_alone[mode] += stats.settle().ring_s / args.rounds
    attention_tiles.forward, attention_tiles.backward = real
    out["comm_alone_s"] = comm_alone

    # the same compute with nothing moved (received blocks are zeros), alternating with the real
    # ring round by round: the slowest rank's difference is the time communication adds
    posting = cp_comm.Ring.post
    with_comm = {m: [] for m in modes}
    no_comm = {m: [] for m in modes}
    cp_comm.Ring.post = _local_post
    for mode in modes:  # warm-up: makes the stand-ins
        step(mode)
    for r in range(args.rounds):
        for mode in modes:
            for local in (False, True) if r % 2 == 0 else (True, False):
                cp_comm.Ring.post = _local_post if local else posting
                dist.barrier()
                stats.reset()
                step(mode)
                (no_comm if local else with_comm)[mode].append(stats.settle().ring_s)
    cp_comm.Ring.post = posting
    out["no_comm_ring_s"] = no_comm
    out["with_comm_ring_s"] = with_comm
    out["plan_s"] = _plan_times(args, group, rank, cp)
    queue.put(out)
    dist.barrier()
    dist.destroy_process_group()


def _plan_times(args: argparse.Namespace, group, rank: int, cp: int) -> dict:
    """Seconds per step of ring planning for `args.layers` layers, zigzag, median over rounds."""
    span, local, cpu = Span.of(0, True, None), args.seq // cp, torch.device("cpu")
    pos = cp_mod.positions_for(args.seq, rank, cp, "zigzag")

    def use(plan: RingPlan) -> None:  # what a call touches: every step's tiles and selection
        for step in range(cp):
            plan.tiles(step)
            if plan.sends(step):
                plan.forward_selection(step)

    def per_call() -> None:
        for _ in range(args.layers):
            use(RingPlan.build(pos, span, 512, group))

    declared_ring = cp_mod.RingAttention(group, layout="zigzag")

    def declared() -> None:
        for _ in range(args.layers):
            use(declared_ring.plan(local, 0, cpu))

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    first = timed(declared)
    return {
        "per_call": statistics.median(timed(per_call) for _ in range(args.rounds)),
        "declared_first_step": first,
        "declared_steady": statistics.median(timed(declared) for _ in range(args.rounds)),
    }


def _summary(cp: int, ranks: list[dict], rounds: int) -> dict:
    modes = ("zigzag", "contiguous")
    # a step is as slow as its slowest rank: max over ranks per round, then the median
    step = {
        m: statistics.median(max(r["step_s"][m][i] for r in ranks) for i in range(rounds))
        for m in modes
    }
    comm = {}
    for m in modes:
        ring_s = sum(r["ring_s"][m] for r in ranks)
        wait_s = sum(r["wait_s"][m] for r in ranks)
        alone = sum(r["comm_alone_s"][m] for r in ranks)
        comm[m] = {
            "ring_s_per_rank": [round(r["ring_s"][m], 4) for r in ranks],
            "blocked_s_per_rank": [round(r["wait_s"][m], 4) for r in ranks],
            "comm_alone_s_per_rank": [round(r["comm_alone_s"][m], 4) for r in ranks],
            "exposed_fraction": round(wait_s / ring_s, 3) if ring_s else 0.0,
            "hidden_fraction": round(max(0.0, 1 - wait_s / alone), 3) if cp > 1 and alone else None,
        }
        if cp > 1:  # slowest rank per round, with and without the messages, medians
            real = statistics.median(
                max(r["with_comm_ring_s"][m][i] for r in ranks) for i in range(rounds)
            )
            local = statistics.median(
                max(r["no_comm_ring_s"][m][i] for r in ranks) for i in range(rounds)
            )
            slowest_alone = max(r["comm_alone_s"][m] for r in ranks)
            comm[m]["ring_s_slowest"] = round(real, 4)
            comm[m]["no_comm_ring_s_slowest"] = round(local, 4)
            comm[m]["added_by_comm_s"] = round(real - local, 4)
            comm[m]["hidden_vs_no_comm"] = round(
                min(1.0, max(0.0, 1 - (real - local) / slowest_alone)), 3
            )
    out = {
        "peak_sent_bytes_alive_per_rank": [r["peak_sent_bytes_alive"] for r in ranks],
        "peak_sent_kv_blocks_alive": round(
            max(r["peak_sent_bytes_alive"] / r["kv_block_bytes"] for r in ranks), 3
        ),
        "activation_bytes_per_rank": [r["activation_bytes"] for r in ranks],
        "peak_rss_delta_bytes_per_rank": [r["peak_rss_delta"] for r in ranks],
        "step_s": {m: round(step[m], 4) for m in modes},
        "zigzag_speedup_over_contiguous": round(step["contiguous"] / step["zigzag"], 3),
        "busy_s_per_rank": {
            m: [round(r["ring_s"][m] - r["wait_s"][m], 4) for r in ranks] for m in modes
        },
        "blocks_computed_per_rank": {m: [r["blocks"][m] for r in ranks] for m in modes},
        "comm": comm,
        "plan_s_per_step": {
            key: round(max(r["plan_s"][key] for r in ranks), 6)
            for key in ("per_call", "declared_first_step", "declared_steady")
        },
    }
    plan = out["plan_s_per_step"]
    out["plan_time_ratio_declared_over_per_call"] = round(
        plan["declared_steady"] / plan["per_call"], 4
    )
    if cp == 1:
        out["sdpa_activation_bytes"] = ranks[0]["sdpa_activation_bytes"]
        sdpa = statistics.median(ranks[0]["step_s"]["sdpa"])
        out["sdpa_step_s"] = round(sdpa, 4)
        # the same layer with single-process SDPA: what the ring must not be much slower than
        out["ring_over_sdpa"] = {m: round(step[m] / sdpa, 3) for m in modes}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=2048, help="total sequence length (all ranks)")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--layers", type=int, default=16, help="attention layers per step (planning)")
    args = ap.parse_args()
    for cp in args.cp:
        if cp < 1 or args.seq % (2 * cp):
            ap.error(
                f"--seq {args.seq} must split into 2·cp zigzag chunks for every --cp "
                f"(cp={cp}: a multiple of {2 * max(cp, 1)})"
            )
    if args.heads % args.kv_heads or args.dim % args.heads:
        ap.error("--dim must be a multiple of --heads, and --heads of --kv-heads")
    result = {
        "benchmark": "ring_attention",
        **device_info(),
        "threads_per_rank": 1,
        "cpu_cores": os.cpu_count(),
        "config": {k: v for k, v in vars(args).items() if k != "cp"},
        "note": (
            "blocked time counts every wait, including waiting for a slower neighbour (causal "
            "imbalance), so hidden_fraction is a lower bound and reads 0 for contiguous; with more "
            "ranks than cores the ranks time-share cores, so step_s shows work balance, not speed-up"
        ),
        "cp": {},
    }
    for cp in args.cp:
        result["cp"][str(cp)] = _summary(cp, run_ranks(_worker, cp, cp, args), args.rounds)
    if "1" in result["cp"]:  # the work each rank is left with, against the whole ring at cp = 1
        one = result["cp"]["1"]["busy_s_per_rank"]["zigzag"][0]
        result["zigzag_busiest_rank_over_cp1"] = {
            cp: round(max(r["busy_s_per_rank"]["zigzag"]) / one, 3)
            for cp, r in result["cp"].items()
            if cp != "1"
        }
    text = json.dumps(result, indent=1)
    # keep per-rank lists on one line each
    print(
        re.sub(r"\[\s+([^\[\]{}]*?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)
    )


if __name__ == "__main__":
    main()
