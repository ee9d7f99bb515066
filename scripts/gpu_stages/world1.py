"""Stage world1: what a one-rank process group can show on one GPU — NCCL as the trainer makes it
(bound to the device, so communicators are made eagerly and subgroups split from the world), and
ring attention at cp = 1 through the real ring.

- `ring_cp1`: `parallel/ring_check.ring_vs_sdpa` — `RingAttention` as the trainer installs it
  (zigzag layout, its default tile policy) on one rank at T_loc = 16384 tokens, llama-1b's heads
  (32 / 8 KV, head size 64), bf16, forward + backward, against the single-device SDPA path on the
  same tensors: `ring_over_sdpa`, goal ≤ 1.10 (docs/gpu.md) — what the ring's planning, tiling
  and merges cost when nothing travels; the tiles' kernel paths; output and dQ errors.
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

from gpu_stages.common import Context, OutOfBounds, goal, sig, time_ms

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
    """`parallel/ring_check.ring_vs_sdpa` on this one-rank group, timed by the check's timer."""
    from depthscale.parallel.ring_check import ring_vs_sdpa

    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    r = ring_vs_sdpa(
        ctx.device,
        T=s["T"],
        B=s["B"],
        H=s["H"],
        Hkv=s["Hkv"],
        d=s["d"],
        dtype=dtype,
        time_ms=lambda fn: time_ms(ctx, fn, s["warmup"], s["reps"]),
    )
    values = {"T_loc": r["T"], "shape": r["shape"], "dtype": r["dtype"], "policy": r["policy"],
              "tiles": r["tiles"], "ring_fwd_bwd_ms": sig(r["ring_ms"]),
              "sdpa_fwd_bwd_ms": sig(r["sdpa_ms"]), "ring_over_sdpa": sig(r["ring_over_sdpa"], 3),
              "rel_err": sig(r["out_rel_err"], 3), "dq_rel_err": sig(r["dq_rel_err"], 3)}  # fmt: skip
    goal(values, "ring_over_sdpa", values["ring_over_sdpa"], "<=", GOAL_RING)
    worst = max(r["out_rel_err"], r["dq_rel_err"])
    if not worst <= 2e-2:
        raise OutOfBounds(f"ring differs from SDPA by {worst:.2e} (of its largest) > 2e-2", values)
    return values
