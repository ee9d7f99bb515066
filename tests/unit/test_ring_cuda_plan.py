"""Ring attention on the CUDA path without a GPU: the device is faked (`attention_tiles.backend`
says 'cuda' with every fused kernel, `attention_tiles.aten` holds stand-ins for SDPA's flash,
flash-window and memory-efficient ops that record each call), so the CUDA tile policy's plans and
kernel calls run with CPU tensors.

* Call counts at T_loc = 16K, cp = 8 (the shapes of the issue: 128K tokens): on CUDA each ring step
  is one kernel call forward (one backward) and at most one merge — zigzag and contiguous causal,
  and a contiguous sliding window (its diagonal and halo on flash's window arguments) — where the
  bounded 512-key tiles gave 16-64 calls and merges a step. The stand-ins return outputs of the
  right shape without computing; the ring's own step code (`ring_steps`) runs, over each rank's
  real held payload shape.
* Exactness at small T, cp = 4: every rank's steps (`ring_steps` over the plan's tiles, the held
  payloads as the ring would pass them) against fp64 attention on the full sequence — zigzag and
  contiguous, windows (on the window op and, for zigzag, the bias fallback), GQA, bidirectional with
  padding, packed documents. The stand-ins compute in fp64 from fp32 inputs (the half-precision
  check is lifted for the test), so any difference beyond fp32 rounding is a planning error:
  tolerance `fp32_sum_bound` of attention's reduction chain, as tests/dist/test_context_parallel.py.
* `ring_check.ring_vs_sdpa`: the real `RingAttention` at cp = 1, as the trainer installs it, on the
  faked CUDA path: one causal flash call, equal to SDPA.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from depthscale.model import attention_dispatch as dispatch
from depthscale.model import attention_tiles
from depthscale.model.documents import Documents
from depthscale.model.layers import attention_mask
from depthscale.parallel import ring_steps
from depthscale.parallel.ring_check import ring_vs_sdpa
from depthscale.parallel.ring_documents import step_tiles
from depthscale.parallel.ring_schedule import RingPlan, Span
from depthscale.parallel.sequence_layout import positions_for
from tolerances import check, fp32_sum_bound, scaled_err

ALL = dispatch.Capabilities(flash=True, efficient=True, flash_window=True, flex=True)
CPU = torch.device("cpu")


def _band(Tq: int, Tk: int, left, right) -> torch.Tensor:
    """Flash's local mask for a square tile: row i sees keys i − left … i + right (None or −1:
    unbounded)."""
    assert Tq == Tk, "band tiles reach the kernel square"
    offset = torch.arange(Tq)[:, None] - torch.arange(Tk)
    seen = torch.ones(Tq, Tk, dtype=torch.bool)
    if left is not None and left >= 0:
        seen &= offset <= left
    if right is not None and right >= 0:
        seen &= offset >= -right
    return seen


class FakeFusedOps:
    """SDPA's CUDA flash and memory-efficient ops and flash's window op on CPU tensors: each call
    is recorded (`calls`) and checked against the kernel's contract (no dropout, causal and band
    tiles square, the efficient op without GQA); with `compute`, the result in fp64 rounded to
    the inputs' dtype, else zeros of the right shapes (for counting at 16K)."""

    def __init__(self, compute: bool) -> None:
        self.compute, self.calls = compute, []

    def __getattr__(self, name):
        return getattr(torch.ops.aten, name)

    def _fwd(self, q, k, v, mask, scale):
        if not self.compute:
            return torch.zeros_like(q), q.new_zeros(q.shape[:3], dtype=torch.float32)
        out, lse = attention_tiles.reference_forward(
            q.double(), k.double(), v.double(), mask, scale
        )
        return out.to(q.dtype), lse.float()

    def _bwd(self, do, q, k, v, out, lse, mask, scale):
        if not self.compute:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        args = (t.double() for t in (do, q, k, v, out, lse))
        return tuple(g.to(q.dtype) for g in attention_tiles.reference_backward(*args, mask, scale))

    def _causal(self, causal: bool, q, k):
        return _band(q.shape[2], k.shape[2], None, 0) if causal and self.compute else None

    def _scaled_dot_product_flash_attention(self, q, k, v, dropout, causal, debug, *, scale):
        self.calls.append("flash")
        assert dropout == 0.0 and not debug and (not causal or q.shape[2] == k.shape[2])
        mask = self._causal(causal, q, k)
        return (
            *self._fwd(q, k, v, mask, scale),
            None,
            None,
            q.shape[2],
            k.shape[2],
            None,
            None,
            None,
        )

    def _scaled_dot_product_flash_attention_backward(
        self, do, q, k, v, out, lse, cq, ck, mq, mk, dropout, causal, seed, offset, *, scale
    ):
        self.calls.append("flash_backward")
        assert lse.is_contiguous() and dropout == 0.0 and (not causal or mq == mk)
        mask = self._causal(causal, q, k)
        return self._bwd(do, q, k, v, out, lse, mask, scale)

    def _flash_attention_forward(
        self, q, k, v, cq, ck, mq, mk, dropout, causal, debug, *, scale, window_size_left,
        window_size_right,
    ):  # fmt: skip
        self.calls.append("flash_window")
        assert cq is None and dropout == 0.0 and not causal and not debug
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # the op's [B, T, H, d]
        assert mq == mk, "band tiles reach the kernel square"
        mask = _band(mq, mk, window_size_left, window_size_right) if self.compute else None
        out, lse = self._fwd(q, k, v, mask, scale)
        return out.transpose(1, 2), lse, None, None, None

    def _flash_attention_backward(
        self, do, q, k, v, out, lse, cq, ck, mq, mk, dropout, causal, seed, offset, *, scale,
        window_size_left, window_size_right,
    ):  # fmt: skip
        self.calls.append("flash_window_backward")
        assert lse.is_contiguous() and dropout == 0.0 and not causal
        assert all(t.stride(-1) == 1 for t in (do, q, k, v, out)) and mq == mk
        mask = _band(mq, mk, window_size_left, window_size_right) if self.compute else None
        args = (t.transpose(1, 2) for t in (do, q, k, v, out))
        return tuple(g.transpose(1, 2) for g in self._bwd(*args, lse, mask, scale))

    def _scaled_dot_product_efficient_attention(
        self, q, k, v, bias, compute_lse, dropout, causal, *, scale
    ):
        self.calls.append("efficient")
        assert q.shape[1] == k.shape[1] and compute_lse and not causal
        out, lse = self._fwd(q, k, v, None if bias is None else bias == 0, scale)
        M = q.shape[2]
        padded = lse.new_zeros(*lse.shape[:2], math.ceil(M / 32) * 32)
        padded[..., :M] = lse
        return out, padded, None, None

    def _scaled_dot_product_efficient_attention_backward(
        self, do, q, k, v, bias, out, lse, seed, offset, dropout, grad_mask, causal, *, scale
    ):
        self.calls.append("efficient_backward")
        M = q.shape[2]
        mask = None if bias is None else bias == 0
        return (*self._bwd(do, q, k, v, out, lse[..., :M], mask, scale), None)


class MergeCounter:
    def __init__(self) -> None:
        self.count, self.real = 0, ring_steps.merge

    def __call__(self, *args) -> None:
        self.count += 1
        self.real(*args)


@pytest.fixture
def fake_cuda(monkeypatch):
    """The CUDA path on CPU tensors: (ops, merges). fp32 counts as half precision for the fused
    kernels (the stand-ins compute in fp64 anyway), so exactness is checked at fp32 rounding."""
    monkeypatch.setattr(attention_tiles, "backend", lambda device: ("cuda", ALL))
    monkeypatch.setattr(dispatch, "HALF", (*dispatch.HALF, torch.float32))
    ops, merges = FakeFusedOps(compute=True), MergeCounter()
    monkeypatch.setattr(attention_tiles, "aten", ops)
    monkeypatch.setattr(ring_steps, "merge", merges)
    return ops, merges


def _ring_rank(plan, q, k, v, dy, documents, kv_blocks, dkv_blocks):
    """One rank's forward and backward steps as `_RingAttention` runs them, the held payloads
    taken from `kv_blocks` instead of received; each step's dK/dV added into `dkv_blocks` (where
    the travelling buffer would take them home). Returns (out, dq, per-step (calls, merges))."""
    ops, merges = attention_tiles.aten, ring_steps.merge
    B, H, T, d = q.shape
    Hkv, scale = k.shape[1], d**-0.5
    dtype = attention_tiles.tile_dtype(q)
    qg = q.unflatten(1, (Hkv, H // Hkv)).to(dtype)
    out = torch.zeros(qg.shape, dtype=torch.float32)
    lse = torch.full(qg.shape[:-1], float("-inf"))
    per_step = []
    for step in range(plan.size):
        if not plan.holds(step):
            continue
        j = plan.owner(step)
        held = kv_blocks[j].index_select(3, plan.payload(j, step))
        tiles = step_tiles(plan, step, documents)
        calls, merged = len(ops.calls), merges.count
        ring_steps.forward_step(tiles, held, qg, out, lse, scale, fresh=step == 0)
        per_step.append((len(ops.calls) - calls, merges.count - merged))
    y = out.flatten(1, 2).to(q.dtype)
    saved = (qg, dy.unflatten(1, (Hkv, H // Hkv)).to(dtype), out.to(dtype), lse)
    dq = torch.zeros(qg.shape, dtype=torch.float32)
    for step in range(plan.size):
        if not plan.holds(step):
            continue
        j = plan.owner(step)
        held = kv_blocks[j].index_select(3, plan.payload(j, step))
        base = plan.payload(j, 0 if step == 0 else 1)
        dkv = torch.zeros(*held.shape[:3], base.numel(), d)
        ring_steps.backward_step(step_tiles(plan, step, documents), held, saved, dq, dkv, scale)
        dkv_blocks[j].index_add_(3, base, dkv)
    return y, dq.flatten(1, 2), per_step


# ------------------------------------------------------------------ call counts at T_loc = 16K


def _positions(layout: str, cp: int = 8, T_loc: int = 16384) -> list[torch.Tensor]:
    return [positions_for(cp * T_loc, r, cp, layout) for r in range(cp)]


def _counts(layout: str, window: int, policy):
    """Per (rank, step): (forward kernel calls, merges); per rank: (backward calls, steps)."""
    pos = _positions(layout)
    cp, T_loc = len(pos), pos[0].numel()
    B, H, Hkv, d = 1, 1, 1, 8
    q = torch.zeros(B, H, T_loc, d, dtype=torch.bfloat16)
    k = torch.zeros(B, Hkv, T_loc, d, dtype=torch.bfloat16)
    blocks = [torch.zeros(2, B, Hkv, T_loc, d, dtype=torch.bfloat16) for _ in range(cp)]
    grads = [torch.zeros(2, B, Hkv, T_loc, d) for _ in range(cp)]
    ops = attention_tiles.aten
    steps, backward = [], []
    first = RingPlan.of(pos, 0, Span.of(window, True, None), 512, CPU, policy)
    for rank in range(cp):  # what is sent is the same on every rank: planned once
        plan = dataclasses.replace(first, rank=rank, _tiles={}, _selections={})
        before = len(ops.calls)
        _, _, per_step = _ring_rank(plan, q, k, k, q, None, blocks, grads)
        fwd = sum(c for c, _ in per_step)
        steps += per_step
        backward.append((len(ops.calls) - before - fwd, len(per_step)))
    return steps, backward


@pytest.mark.parametrize(
    ("layout", "window"), [("zigzag", 0), ("contiguous", 0), ("contiguous", 4096)]
)
def test_on_cuda_each_ring_step_is_one_call_and_at_most_one_merge(monkeypatch, layout, window):
    """cp = 8, T_loc = 16K, bf16, the CUDA path: every step one forward call and one backward
    call, at most one merge (none at the first step: copied), on flash (causal, unmasked) or its
    window op; the bounded 512-key tiles (the policy before, now the reference's) cut the diagonal block into 32 or more
    (its plan: one call and one merge a tile; planned for one step of one rank, no compute)."""
    monkeypatch.setattr(attention_tiles, "backend", lambda device: ("cuda", ALL))
    ops, merges = FakeFusedOps(compute=False), MergeCounter()
    monkeypatch.setattr(attention_tiles, "aten", ops)
    monkeypatch.setattr(ring_steps, "merge", merges)
    policy = attention_tiles.policy(torch.zeros(1, 2, 8, 8, dtype=torch.bfloat16))
    assert policy == dispatch.TilePolicy(whole=True, window=True)
    steps, backward = _counts(layout, window, policy)
    assert steps and all(calls == 1 for calls, _ in steps), steps
    assert all(merged <= 1 for _, merged in steps), steps
    assert all(calls == n for calls, n in backward), backward
    kinds = set(ops.calls)
    assert kinds <= {"flash", "flash_backward", "flash_window", "flash_window_backward"}, kinds
    assert ("flash_window" in kinds) == (window > 0)
    span = Span.of(window, True, None)
    bounded = RingPlan.of(_positions(layout), 7, span, 512, CPU, dispatch.TilePolicy())
    assert len(bounded.tiles(0)) >= 32  # the diagonal block: two per 512 keys


# ------------------------------------------------------------------ exactness at small T, cp = 4

CASES = [  # (layout, T, window, H, Hkv, causal, documents)
    ("zigzag", 64, 0, 4, 2, True, False),
    ("contiguous", 64, 0, 4, 4, True, False),
    ("contiguous", 64, 7, 4, 2, True, False),  # diagonal and halo on the window op
    ("contiguous", 64, 40, 4, 2, True, False),  # window over several blocks: bias fallback
    ("zigzag", 64, 5, 4, 2, True, False),  # zigzag tails: bias fallback
    ("zigzag", 60, 0, 4, 2, False, False),  # bidirectional, padded to 64
    ("contiguous", 62, 9, 4, 2, False, False),
    ("zigzag", 64, 0, 4, 2, True, True),  # packed documents
    ("contiguous", 64, 6, 4, 2, True, True),
]


@pytest.mark.parametrize(("layout", "T", "window", "H", "Hkv", "causal", "docs"), CASES)
def test_the_cuda_plan_is_exact(fake_cuda, layout, T, window, H, Hkv, causal, docs):
    ops, _ = fake_cuda
    cp, B, d = 4, 2, 8
    n_chunks = 2 * cp if layout == "zigzag" else cp
    Tp = T + (-T % n_chunks)
    g = torch.Generator().manual_seed(T + window)
    q, dy = (torch.randn(B, H, Tp, d, generator=g) for _ in range(2))
    k, v = (torch.randn(B, Hkv, Tp, d, generator=g) for _ in range(2))
    full = torch.arange(Tp)
    visible = attention_mask(full, full, window, causal=causal) & (full < T)
    documents = None
    if docs:
        tokens = torch.randint(1, 9, (B, Tp), generator=g)
        tokens[0, [9, 30, 47]] = 0
        tokens[1, [20, 21, 52]] = 0
        documents = Documents.of(tokens, eos_id=0)
        ids = documents.host_ids
        visible = (visible & (ids[:, :, None] == ids[:, None, :])).unsqueeze(1)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    want, _ = attention_tiles.reference_forward(*leaves, visible, d**-0.5)
    want.backward(dy.double())
    pos = [positions_for(Tp, r, cp, layout) for r in range(cp)]
    span = Span.of(window, causal, T if Tp > T else None)
    kv_blocks = [torch.stack([k[:, :, p], v[:, :, p]]) for p in pos]
    dkv = [torch.zeros(2, B, Hkv, p.numel(), d) for p in pos]
    policy = attention_tiles.policy(q)
    for rank in range(cp):
        plan = RingPlan.of(pos, rank, span, 8, CPU, policy)
        p = pos[rank]
        y, dq, _ = _ring_rank(plan, q[:, :, p], k, v, dy[:, :, p], documents, kv_blocks, dkv)
        real = p < T
        bound = fp32_sum_bound(3 * d + 3 * Tp + Tp * H // Hkv)
        check(scaled_err(y[:, :, real], want[:, :, p[real]]), bound, f"rank {rank} out")
        check(scaled_err(dq[:, :, real], leaves[0].grad[:, :, p[real]]), bound, f"rank {rank} dq")
    for r, p in enumerate(pos):
        real = p < T
        for grad, leaf in zip(dkv[r], leaves[1:], strict=True):
            got, ref = grad[:, :, real], leaf.grad[:, :, p[real]]
            check(scaled_err(got, ref), fp32_sum_bound(3 * d + 3 * Tp + Tp * H // Hkv), "dk/dv")
    assert ops.calls and not any(c.startswith("cpu") for c in ops.calls)
    if window == 7 and layout == "contiguous":
        assert "flash_window" in ops.calls and "efficient" not in ops.calls
    if window == 0 and not docs:
        assert set(ops.calls) <= {"flash", "flash_backward"}


def test_the_trainers_ring_at_cp1_is_one_flash_call_equal_to_sdpa(fake_cuda):
    """`ring_vs_sdpa` (the GPU check's ring stage) on the faked CUDA path: the ring as the trainer
    installs it takes one causal flash call at its one step and matches SDPA."""
    ops, merges = fake_cuda
    result = ring_vs_sdpa("cpu", T=256, H=4, Hkv=2, d=16, dtype=torch.float32, reps=1, warmup=0)
    assert result["policy"] == "whole" and result["tiles"] == ["cuda_flash"]
    assert merges.count == 0  # the one step's result is copied into the output
    assert set(ops.calls) == {"flash", "flash_backward"}
    bound = fp32_sum_bound(3 * 16 + 3 * 256 + 256 * 2)
    check(result["out_rel_err"], bound, "out")
    check(result["dq_rel_err"], bound, "dq")


@pytest.mark.parametrize(
    ("device", "dtype", "caps", "want"),
    [
        ("cuda", torch.bfloat16, ALL, dispatch.TilePolicy(whole=True, window=True)),
        ("cuda", torch.float16, dispatch.Capabilities(flash=True), dispatch.TilePolicy(True)),
        ("cuda", torch.bfloat16, dispatch.Capabilities(efficient=True), dispatch.TilePolicy()),
        ("cuda", torch.float32, ALL, dispatch.TilePolicy()),  # the reference materialises scores
        ("cpu", torch.float32, dispatch.Capabilities(), dispatch.TilePolicy(whole=True)),
        ("mps", torch.bfloat16, ALL, dispatch.TilePolicy()),
    ],
)
def test_tile_policy_per_backend(device, dtype, caps, want):
    assert dispatch.tile_policy(device, dtype, 64, caps) == want
