"""Fused Triton kernels for the Attention-Residual depth reads, forward and backward.

Drop-in for `multi_query_read` (phase 1) and `merge_partial` (phase 2) of `model/attnres_ops.py`,
which stay the reference; `attnres_ops` dispatches here for CUDA inputs. On CPU they run only under
`TRITON_INTERPRET=1` (the tests).

Math, per token. Queries w_s (s = 1..S, key-norm gain folded in) over sources v_i (i = 1..m):
  r_i = (mean(v_i²) + eps)^-½,  z_si = r_i (v_i · w_s),  a_si = softmax_i(z_si),
  o_s = Σ_i a_si v_i,  lse_s = logsumexp_i z_si
Phase-1 backward from do_s and dlse_s, with P_si = do_s · v_i and D_s = do_s · o_s = Σ_i a_si P_si:
  g_si = a_si (P_si − D_s + dlse_s) r_i      (dz_si r_i)
  dv_i = Σ_s a_si do_s + Σ_s g_si (w_s − (z_si r_i / d) v_i),   dw_s = Σ_tokens Σ_i g_si v_i
Phase 2 is the same read over two sources: the phase-1 result (logit lse, value o) and the partial
sum p (logit z = r (p · w)). With α = softmax weight of o, β = 1 − α:
  h = α o + β p;  do = α dh,  dlse = α (dh · o − dh · h),  dz = β (dh · p − dh · h)
  dp = β dh + dz r (w − (z r / d) p),  dw = Σ_tokens dz r p

Design:
- A program owns BLOCK_N tokens with whole rows (BLOCK_D = next power of two ≥ d, masked) and all S
  queries (padded to a power of two), so the forward reads every source row from memory once for all
  queries. The softmax over sources is online (running max and sum): m is a runtime loop bound.
- Sources are never stacked (a stack is one more full copy of all m): the kernels get an int64
  tensor of the m base addresses and cast each to a pointer of the sources' dtype; on CUDA that is
  one small asynchronous copy from pinned memory. The compiler cannot see the alignment of such a
  pointer, so the ALIGNED flag asserts 16 bytes when true, or loads would not vectorise.
- Backward saves only the sources, the queries and lse [S, N]; r, z and a are recomputed. It makes
  two passes over the sources, because D_s needs all of them before any dv_i is known; the second
  pass rereads rows this program has just read (mostly L2 hits).
- dw: a fixed number of backward programs stride over the token blocks, each writes its partial sum,
  and a torch `.sum` over programs finishes it: deterministic, no atomics.
- Arithmetic is fp32 throughout; results are stored in their tensors' dtypes: phase-1 outputs in
  the sources' dtype (lse in fp32), so a bf16 model saves bf16, not fp32, [B, T, d] tensors; the
  merge reads a phase-1 output of any float dtype.
- Custom ops (`torch.library.custom_op`, namespace `depthscale_triton`): the address table needs
  `data_ptr()`, which dynamo cannot trace, so the compiler sees each read as one opaque op with a
  shape-only fake version, inside its graph (no graph break).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_TILE = 8192
"""Target fp32 elements of a program's [S_PAD, BLOCK_N, BLOCK_D] tiles (sets BLOCK_N and warps)."""


@triton.jit
def _source(addresses, i, src0, tile, tile_ok, w, d, eps, ALIGNED: tl.constexpr):
    """Rows of source i (entry i of the address table) in fp32 [BLOCK_N, BLOCK_D], their inverse
    RMS r [BLOCK_N] and logits z [S_PAD, BLOCK_N]."""
    base = tl.load(addresses + i).to(src0.dtype)
    if ALIGNED:
        base = tl.multiple_of(base, 16)
    v = tl.load(base + tile, mask=tile_ok, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(v * v, axis=1) / d + eps)
    z = tl.sum(v[None, :, :] * w[:, None, :], axis=2) * r[None, :]
    return v, r, z


@triton.jit
def _read_fwd_kernel(addresses, src0, w_ptr, out_ptr, lse_ptr, m, S, N, d, eps,
                     S_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     ALIGNED: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    qs = tl.arange(0, S_PAD)
    tile = rows[:, None].to(tl.int64) * d + cols[None, :]
    tile_ok = (rows[:, None] < N) & (cols[None, :] < d)
    w = tl.load(
        w_ptr + qs[:, None] * d + cols[None, :],
        mask=(qs[:, None] < S) & (cols[None, :] < d),
        other=0.0,
    )
    run_max = tl.full((S_PAD, BLOCK_N), float("-inf"), tl.float32)
    run_sum = tl.zeros((S_PAD, BLOCK_N), tl.float32)
    acc = tl.zeros((S_PAD, BLOCK_N, BLOCK_D), tl.float32)
    for i in range(m):
        v, r, z = _source(addresses, i, src0, tile, tile_ok, w, d, eps, ALIGNED)
        new_max = tl.maximum(run_max, z)
        scale = tl.exp(run_max - new_max)
        p = tl.exp(z - new_max)
        run_sum = run_sum * scale + p
        acc = acc * scale[:, :, None] + p[:, :, None] * v[None, :, :]
        run_max = new_max
    q_rows = qs[:, None].to(tl.int64) * N
    tl.store(
        out_ptr + (q_rows * d)[:, :, None] + tile[None, :, :],
        (acc / run_sum[:, :, None]).to(out_ptr.dtype.element_ty),
        mask=(qs[:, None, None] < S) & tile_ok[None, :, :],
    )
    tl.store(
        lse_ptr + q_rows + rows[None, :],
        run_max + tl.log(run_sum),
        mask=(qs[:, None] < S) & (rows[None, :] < N),
    )


@triton.jit
def _read_bwd_kernel(addresses, src0, w_ptr, lse_ptr, dout_ptr, dlse_ptr, dw_ptr, m, S, N, d, eps,
                     S_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     ALIGNED: tl.constexpr):  # fmt: skip
    """addresses holds the m sources, then their m gradient buffers."""
    cols = tl.arange(0, BLOCK_D)
    qs = tl.arange(0, S_PAD)
    w = tl.load(
        w_ptr + qs[:, None] * d + cols[None, :],
        mask=(qs[:, None] < S) & (cols[None, :] < d),
        other=0.0,
    )
    dw = tl.zeros((S_PAD, BLOCK_D), tl.float32)
    for start in range(tl.program_id(0) * BLOCK_N, N, tl.num_programs(0) * BLOCK_N):
        rows = start + tl.arange(0, BLOCK_N)
        tile = rows[:, None].to(tl.int64) * d + cols[None, :]
        tile_ok = (rows[:, None] < N) & (cols[None, :] < d)
        q_rows = qs[:, None].to(tl.int64) * N
        sq_ok = (qs[:, None] < S) & (rows[None, :] < N)
        lse = tl.load(lse_ptr + q_rows + rows[None, :], mask=sq_ok, other=float("inf"))  # a = 0
        dlse = tl.load(dlse_ptr + q_rows + rows[None, :], mask=sq_ok, other=0.0)
        do = tl.load(
            dout_ptr + (q_rows * d)[:, :, None] + tile[None, :, :],
            mask=(qs[:, None, None] < S) & tile_ok[None, :, :],
            other=0.0,
        ).to(tl.float32)
        D = tl.zeros((S_PAD, BLOCK_N), tl.float32)  # D_s = do_s · o_s = Σ_i a_si P_si
        for i in range(m):
            v, r, z = _source(addresses, i, src0, tile, tile_ok, w, d, eps, ALIGNED)
            D += tl.exp(z - lse) * tl.sum(do * v[None, :, :], axis=2)
        for i in range(m):
            v, r, z = _source(addresses, i, src0, tile, tile_ok, w, d, eps, ALIGNED)
            a = tl.exp(z - lse)
            g = a * (tl.sum(do * v[None, :, :], axis=2) - D + dlse) * r[None, :]
            dv = tl.sum(a[:, :, None] * do + g[:, :, None] * w[:, None, :], axis=0)
            dv -= (tl.sum(g * z, axis=0) * r / d)[:, None] * v
            dv_base = tl.load(addresses + m + i).to(src0.dtype)
            if ALIGNED:
                dv_base = tl.multiple_of(dv_base, 16)
            tl.store(dv_base + tile, dv.to(src0.dtype.element_ty), mask=tile_ok)
            dw += tl.sum(g[:, :, None] * v[None, :, :], axis=1)
    tl.store(
        dw_ptr + tl.program_id(0) * S_PAD * BLOCK_D + qs[:, None] * BLOCK_D + cols[None, :], dw
    )


@triton.jit
def _merge_fwd_kernel(o_ptr, lse_ptr, p_ptr, w_ptr, h_ptr, N, d, eps,
                      BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    tile = rows[:, None].to(tl.int64) * d + cols[None, :]
    tile_ok = (rows[:, None] < N) & (cols[None, :] < d)
    o = tl.load(o_ptr + tile, mask=tile_ok, other=0.0).to(tl.float32)
    p = tl.load(p_ptr + tile, mask=tile_ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < d, other=0.0)
    lse = tl.load(lse_ptr + rows, mask=rows < N, other=0.0)
    r = tl.rsqrt(tl.sum(p * p, axis=1) / d + eps)
    z = tl.sum(p * w[None, :], axis=1) * r
    top = tl.maximum(lse, z)
    a_o = tl.exp(lse - top)
    a_p = tl.exp(z - top)
    h = (a_o[:, None] * o + a_p[:, None] * p) / (a_o + a_p)[:, None]
    tl.store(h_ptr + tile, h.to(h_ptr.dtype.element_ty), mask=tile_ok)


@triton.jit
def _merge_bwd_kernel(o_ptr, lse_ptr, p_ptr, w_ptr, dh_ptr, do_ptr, dlse_ptr, dp_ptr, dw_ptr,
                      N, d, eps, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    cols = tl.arange(0, BLOCK_D)
    w = tl.load(w_ptr + cols, mask=cols < d, other=0.0)
    dw = tl.zeros((BLOCK_D,), tl.float32)
    for start in range(tl.program_id(0) * BLOCK_N, N, tl.num_programs(0) * BLOCK_N):
        rows = start + tl.arange(0, BLOCK_N)
        tile = rows[:, None].to(tl.int64) * d + cols[None, :]
        tile_ok = (rows[:, None] < N) & (cols[None, :] < d)
        o = tl.load(o_ptr + tile, mask=tile_ok, other=0.0).to(tl.float32)
        p = tl.load(p_ptr + tile, mask=tile_ok, other=0.0).to(tl.float32)
        dh = tl.load(dh_ptr + tile, mask=tile_ok, other=0.0).to(tl.float32)
        lse = tl.load(lse_ptr + rows, mask=rows < N, other=0.0)
        r = tl.rsqrt(tl.sum(p * p, axis=1) / d + eps)
        z = tl.sum(p * w[None, :], axis=1) * r
        top = tl.maximum(lse, z)
        a_o = tl.exp(lse - top)
        a_p = tl.exp(z - top)
        alpha = a_o / (a_o + a_p)
        beta = a_p / (a_o + a_p)
        dh_o = tl.sum(dh * o, axis=1)
        dh_p = tl.sum(dh * p, axis=1)
        dh_h = alpha * dh_o + beta * dh_p
        g = beta * (dh_p - dh_h) * r  # dz r
        dp = beta[:, None] * dh + g[:, None] * w[None, :] - (g * z * r / d)[:, None] * p
        tl.store(do_ptr + tile, (alpha[:, None] * dh).to(do_ptr.dtype.element_ty), mask=tile_ok)
        tl.store(dlse_ptr + rows, alpha * (dh_o - dh_h), mask=rows < N)
        tl.store(dp_ptr + tile, dp.to(dp_ptr.dtype.element_ty), mask=tile_ok)
        dw += tl.sum(g[:, None] * p, axis=0)
    tl.store(dw_ptr + tl.program_id(0) * BLOCK_D + cols, dw)


def _blocks(d: int, s_pad: int = 1) -> tuple[int, int, int]:
    """BLOCK_D, BLOCK_N and num_warps: whole rows, as many tokens (≤ 64) as keep the
    [s_pad, BLOCK_N, BLOCK_D] fp32 tile near _TILE elements (at least one token), and ~16 of its
    elements per thread (checked with ptxas for sm_90: no spills up to s_pad · BLOCK_D = 8192)."""
    block_d = triton.next_power_of_2(d)
    block_n = max(1, min(64, _TILE // (s_pad * block_d)))
    num_warps = max(1, min(16, s_pad * block_n * block_d // 512))
    return block_d, block_n, num_warps


def _n_programs(n_blocks: int, device: torch.device) -> int:
    """Backward grid: enough programs to fill the GPU, few enough that the per-program dw partials
    stay small. The interpreter runs programs one after another, so two suffice there."""
    if device.type == "cuda":
        return min(n_blocks, 4 * torch.cuda.get_device_properties(device).multi_processor_count)
    return min(n_blocks, 2)


def _addresses(tensors: list[Tensor], device: torch.device) -> tuple[Tensor, bool]:
    """int64 base addresses of `tensors` on `device`, for the kernels to cast to pointers, and
    whether all are 16-byte aligned (fresh allocations are; views at an offset may not be)."""
    addresses = [t.data_ptr() for t in tensors]
    table = torch.tensor(addresses, dtype=torch.int64)
    if device.type == "cuda":  # pinned + non_blocking: no host sync
        table = table.pin_memory().to(device, non_blocking=True)
    return table, all(a % 16 == 0 for a in addresses)


# The kernels are torch custom ops (opaque to torch.compile, with shape-only fake versions), so a
# compiled model calls them inside its graph: no graph break per read. Their autograd formulas are
# registered on the forward ops; each backward is an op of its own.


@torch.library.custom_op("depthscale_triton::read_forward", mutates_args=())
def _read_forward(w: Tensor, sources: list[Tensor], eps: float) -> tuple[Tensor, Tensor]:
    srcs = [s.contiguous() for s in sources]
    shape, device = srcs[0].shape, srcs[0].device
    (S, d), N = w.shape, srcs[0].numel() // w.shape[1]
    s_pad = triton.next_power_of_2(S)
    block_d, block_n, warps = _blocks(d, s_pad)
    out = torch.empty(S, *shape, dtype=srcs[0].dtype, device=device)
    lse = torch.empty(S, *shape[:-1], dtype=torch.float32, device=device)
    table, aligned = _addresses(srcs, device)
    _read_fwd_kernel[(triton.cdiv(N, block_n),)](
        table, srcs[0], w, out, lse, len(srcs), S, N, d, eps,
        S_PAD=s_pad, BLOCK_N=block_n, BLOCK_D=block_d, ALIGNED=aligned,
        num_warps=warps)  # fmt: skip
    return out, lse


@_read_forward.register_fake
def _(w: Tensor, sources: list[Tensor], eps: float) -> tuple[Tensor, Tensor]:
    shape = sources[0].shape
    out = sources[0].new_empty(w.shape[0], *shape)
    return out, sources[0].new_empty(w.shape[0], *shape[:-1], dtype=torch.float32)


@torch.library.custom_op("depthscale_triton::read_backward", mutates_args=())
def _read_backward(
    w: Tensor, lse: Tensor, sources: list[Tensor], d_out: Tensor, d_lse: Tensor, eps: float
) -> tuple[Tensor, list[Tensor]]:
    srcs = [s.contiguous() for s in sources]
    d_srcs = [torch.empty_like(s) for s in srcs]
    device = srcs[0].device
    (S, d), N = w.shape, srcs[0].numel() // w.shape[1]
    s_pad = triton.next_power_of_2(S)
    block_d, block_n, warps = _blocks(d, s_pad)
    n_prog = _n_programs(triton.cdiv(N, block_n), device)
    dw = torch.empty(n_prog, s_pad, block_d, dtype=torch.float32, device=device)
    table, aligned = _addresses(srcs + d_srcs, device)
    d_out = d_out.to(srcs[0].dtype).contiguous()  # the output's dtype: no copy
    d_lse = d_lse.float().contiguous()
    _read_bwd_kernel[(n_prog,)](
        table, srcs[0], w, lse, d_out, d_lse, dw, len(srcs), S, N, d, eps,
        S_PAD=s_pad, BLOCK_N=block_n, BLOCK_D=block_d, ALIGNED=aligned,
        num_warps=warps)  # fmt: skip
    return dw[:, :S, :d].sum(0), d_srcs


@_read_backward.register_fake
def _(w, lse, sources, d_out, d_lse, eps):
    return torch.empty_like(w), [
        torch.empty_like(s, memory_format=torch.contiguous_format) for s in sources
    ]


def _read_setup(ctx, inputs, output) -> None:
    w, sources, eps = inputs
    ctx.save_for_backward(w, output[1], *sources)
    ctx.eps = eps


def _read_grads(ctx, d_out: Tensor, d_lse: Tensor):
    w, lse, *sources = ctx.saved_tensors
    dw, d_srcs = _read_backward(w, lse, sources, d_out, d_lse, ctx.eps)
    return dw, d_srcs, None


_read_forward.register_autograd(_read_grads, setup_context=_read_setup)


@torch.library.custom_op("depthscale_triton::merge_forward", mutates_args=())
def _merge_forward(
    inter_out: Tensor, inter_lse: Tensor, partial: Tensor, w: Tensor, eps: float
) -> Tensor:
    o, lse, p = inter_out.contiguous(), inter_lse.contiguous(), partial.contiguous()
    d = p.shape[-1]
    N = p.numel() // d
    block_d, block_n, warps = _blocks(d)
    h = torch.empty_like(p)
    _merge_fwd_kernel[(triton.cdiv(N, block_n),)](
        o, lse, p, w, h, N, d, eps,
        BLOCK_N=block_n, BLOCK_D=block_d, num_warps=warps)  # fmt: skip
    return h


@_merge_forward.register_fake
def _(inter_out, inter_lse, partial, w, eps):
    return torch.empty_like(partial, memory_format=torch.contiguous_format)


@torch.library.custom_op("depthscale_triton::merge_backward", mutates_args=())
def _merge_backward(
    inter_out: Tensor, inter_lse: Tensor, partial: Tensor, w: Tensor, dh: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    o, lse, p = inter_out.contiguous(), inter_lse.contiguous(), partial.contiguous()
    d = p.shape[-1]
    N = p.numel() // d
    block_d, block_n, warps = _blocks(d)
    n_prog = _n_programs(triton.cdiv(N, block_n), p.device)
    d_o, d_lse, d_p = torch.empty_like(o), torch.empty_like(lse), torch.empty_like(p)
    dw = torch.empty(n_prog, block_d, dtype=torch.float32, device=p.device)
    _merge_bwd_kernel[(n_prog,)](
        o, lse, p, w, dh.contiguous(), d_o, d_lse, d_p, dw, N, d, eps,
        BLOCK_N=block_n, BLOCK_D=block_d, num_warps=warps)  # fmt: skip
    return d_o, d_lse, d_p, dw[:, :d].sum(0)


@_merge_backward.register_fake
def _(inter_out, inter_lse, partial, w, dh, eps):
    contiguous = torch.contiguous_format
    return (
        torch.empty_like(inter_out, memory_format=contiguous),
        torch.empty_like(inter_lse, memory_format=contiguous),
        torch.empty_like(partial, memory_format=contiguous),
        torch.empty_like(w),
    )


def _merge_setup(ctx, inputs, output) -> None:
    inter_out, inter_lse, partial, w, eps = inputs
    ctx.save_for_backward(inter_out, inter_lse, partial, w)
    ctx.eps = eps


def _merge_grads(ctx, dh: Tensor):
    o, lse, p, w = ctx.saved_tensors
    return (*_merge_backward(o, lse, p, w, dh, ctx.eps), None)


_merge_forward.register_autograd(_merge_grads, setup_context=_merge_setup)


def triton_multi_query_read(
    sources: list[Tensor], queries: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """`attnres_ops.multi_query_read` as fused kernels: S queries [S, d] over m sources [B, T, d]
    (one dtype: fp32, bf16 or fp16) -> outputs [S, B, T, d] in that dtype and fp32 log-sum-exps
    [S, B, T]."""
    if len({(s.shape, s.dtype, s.device) for s in sources}) != 1:
        raise ValueError("sources must share shape, dtype and device")
    return _read_forward(queries.float().contiguous(), list(sources), eps)


def triton_merge_partial(
    inter_out: Tensor, inter_lse: Tensor, partial: Tensor, query: Tensor, eps: float
) -> Tensor:
    """`attnres_ops.merge_partial` as one fused kernel each way: phase-1 output [B, T, d] (any
    float dtype, read as is: its gradient comes back in that dtype) and lse [B, T] merged with the
    partial sum [B, T, d] for query [d] -> [B, T, d] in partial's dtype."""
    return _merge_forward(inter_out, inter_lse.float(), partial, query.float().contiguous(), eps)
