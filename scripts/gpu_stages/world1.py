"""Stage world1: what a one-rank process group can show on one GPU — NCCL as the trainer makes it
(bound to the device, so communicators are made eagerly and subgroups split from the world), and
ring attention at cp = 1 through the real ring.

- `ring_cp1`: `RingAttention` (the callable context parallelism installs in every layer, with the
  trainer's settings: zigzag layout, its default tile) on one rank at T_loc = 16384 tokens,
  llama-1b's heads (32 / 8 KV, head size 64), bf16, forward + backward, against one SDPA call
  (flash, causal, GQA) on the same tensors: `ring_over_sdpa`, goal ≤ 1.10 (docs/gpu.md) — what
  the ring's planning, tiling and merges cost when nothing travels; `rel_err` of its output.
- `split_group`: `startup.own_group` as the mesh makes groups — one `split_group` from the bound
  world communicator on NCCL (a `new_group` on gloo) — and an all-reduce on it.
- `p2p_self_loop`: `p2p.post` of a send to itself and the matching receive (one
  `batch_isend_irecv` group, as the ring and the pipeline post), the received buffer equal to the
  sent one. gloo cannot send to its own rank: the dry run's stand-in for `batch_isend_irecv`
  loops the sends back in posting order, so `post` and `Batch` still run.
- `flight_recorder`: `observe.flight_recorder.snapshot()` — on NCCL the real `_dump_nccl_trace`,
  unpickled and reduced as `depthscale trace hang` reads it — naming the groups used above with
  their collectives enqueued, started and completed.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from gpu_stages.common import Context, OutOfBounds, goal, rel_err, sig, time_ms

REAL = {"B": 1, "H": 32, "Hkv": 8, "T": 16384, "d": 64, "warmup": 2, "reps": 5}
DRY = {"B": 1, "H": 4, "Hkv": 2, "T": 256, "d": 16, "warmup": 1, "reps": 2}
GOAL_RING = 1.10


def run(ctx: Context) -> None:
    from depthscale.observe import flight_recorder

    backend = "nccl" if ctx.cuda else "gloo"
    if ctx.cuda:
        flight_recorder.configure_nccl(ctx.work / "world1_run")  # before the first NCCL group
        flight_recorder.make_dump_dir()
    store = dist.FileStore(str(ctx.work / "world1_store"), 1)
    device_id = torch.device("cuda", 0) if ctx.cuda else None
    dist.init_process_group(backend, store=store, rank=0, world_size=1, device_id=device_id)
    try:
        ctx.measure("split_group", lambda: split_group(ctx))
        ctx.measure("p2p_self_loop", lambda: p2p_self_loop(ctx))
        ctx.measure("flight_recorder", lambda: recorder(ctx))
        ctx.measure("ring_cp1", lambda: ring_cp1(ctx, DRY if ctx.dry_run else REAL))
    finally:
        dist.destroy_process_group()


def split_group(ctx: Context) -> dict[str, Any]:
    from depthscale.parallel import startup

    with startup.count_synchronizations() as counts:
        group = startup.own_group([[0]], "gpu_check_world1")
    x = torch.full((4,), 3.0, device=ctx.device)
    dist.all_reduce(x, group=group)
    ctx.sync()
    values = {"splits_from_world": startup.splits_from_world(), **counts.summary(),
              "all_reduce": x[0].item()}  # fmt: skip
    if ctx.cuda and values["splits"] != 1:
        raise OutOfBounds("NCCL bound to the device made the group without split_group", values)
    if values["all_reduce"] != 3.0:
        raise OutOfBounds("an all-reduce over one rank changed its input", values)
    return values


@contextlib.contextmanager
def _loopback():
    """gloo has no send to its own rank: `batch_isend_irecv` copies each send to the receive of
    the same position, as NCCL pairs them (the dry run's stand-in)."""
    real = dist.batch_isend_irecv

    def loop(ops):
        sends = [op.tensor for op in ops if op.op is dist.isend]
        recvs = [op.tensor for op in ops if op.op is dist.irecv]
        for s, r in zip(sends, recvs):
            r.copy_(s)

        class Done:
            def wait(self):
                return True

            def is_completed(self):
                return True

        return [Done() for _ in ops]

    dist.batch_isend_irecv = loop
    try:
        yield
    finally:
        dist.batch_isend_irecv = real


def p2p_self_loop(ctx: Context) -> dict[str, Any]:
    from depthscale.parallel import p2p

    sent = torch.randn(3, 1024, device=ctx.device)
    traffic = p2p.Traffic()
    with contextlib.nullcontext() if ctx.cuda else _loopback():
        batch = p2p.post(dist.group.WORLD, [p2p.Send(sent, 0, "loop")],
                         [p2p.Recv(tuple(sent.shape), sent.dtype, 0, "loop")], ctx.device,
                         traffic)  # fmt: skip
        got = batch.recv("loop")
        batch.wait()
    ctx.sync()
    values = {"equal": torch.equal(got, sent), "bytes_sent": traffic.bytes_sent,
              "messages": traffic.messages, "loopback_stand_in": not ctx.cuda}  # fmt: skip
    if not values["equal"]:
        raise OutOfBounds("the message received differs from the one sent", values)
    return values


def recorder(ctx: Context) -> dict[str, Any]:
    from depthscale.observe import flight_recorder

    snap = flight_recorder.snapshot()
    if snap is None or "error" in snap:
        raise OutOfBounds("no flight recorder dump could be read", {"snapshot": snap})
    groups = snap["groups"]
    values = {"dump": flight_recorder.NCCL_DUMP if ctx.cuda else flight_recorder.GLOO_DUMP,
              "groups": groups, "in_flight": snap["in_flight"][:8]}  # fmt: skip
    if not any(g.get("enqueued", 0) >= 1 for g in groups.values()):
        raise OutOfBounds("the dump names no group with a collective enqueued", values)
    if ctx.cuda and not all(g.get("backend") == "nccl" for g in groups.values()):
        raise OutOfBounds("the NCCL dump's groups are not read as NCCL's", values)
    return values


def ring_cp1(ctx: Context, s: dict) -> dict[str, Any]:
    from depthscale.parallel.context_parallel import RingAttention, RingStats
    from depthscale.parallel.sequence_layout import positions_for

    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    gen = torch.Generator(ctx.device).manual_seed(11)

    def leaf(heads: int) -> torch.Tensor:
        t = torch.randn(s["B"], heads, s["T"], s["d"], generator=gen, device=ctx.device)
        return t.to(dtype).requires_grad_()

    q, k, v = leaf(s["H"]), leaf(s["Hkv"]), leaf(s["Hkv"])
    up = torch.randn(q.shape, generator=gen, device=ctx.device).to(dtype)
    ring = RingAttention(dist.group.WORLD, RingStats(), "zigzag")
    pos = positions_for(s["T"], 0, 1, "zigzag").to(ctx.device)

    def by_ring():
        return ring(q, k, v, pos, pos, 0)

    def by_sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def fwd_bwd(fn):
        return lambda: torch.autograd.grad(fn(), (q, k, v), up)

    err = rel_err(by_ring().float(), by_sdpa().float())
    ring_ms = time_ms(ctx, fwd_bwd(by_ring), s["warmup"], s["reps"])
    sdpa_ms = time_ms(ctx, fwd_bwd(by_sdpa), s["warmup"], s["reps"])
    values = {"T_loc": s["T"], "heads": [s["H"], s["Hkv"]], "dtype": str(dtype),
              "ring_fwd_bwd_ms": sig(ring_ms), "sdpa_fwd_bwd_ms": sig(sdpa_ms),
              "ring_over_sdpa": sig(ring_ms / sdpa_ms, 3), "rel_err": sig(err, 3),
              "kv_tile": ring.kv_tile}  # fmt: skip
    goal(values, "ring_over_sdpa", values["ring_over_sdpa"], "<=", GOAL_RING)
    if not err <= 2e-2:
        raise OutOfBounds(f"ring output differs from SDPA by {err:.2e} > 2e-2", values)
    return values
