"""Launches of the AttnRes Triton kernels: buffers, address tables, grids. Plain functions on
tensors, no autograd (that is `attnres_triton.py`). Variants come from `attnres_triton_config`,
the kernels from `attnres_triton_jit` and `attnres_triton_jit_backward`."""

from __future__ import annotations

import torch
import triton
from torch import Tensor

import depthscale.kernels.attnres_triton_config as config
import depthscale.kernels.attnres_triton_jit as jit
import depthscale.kernels.attnres_triton_jit_backward as jit_backward

_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"the AttnRes Triton kernels take fp32/bf16/fp16, got {dtype}") from None


def aligned(t: Tensor) -> Tensor:
    """t as a contiguous tensor at a 16-byte aligned address (copied if it is not: a view at an
    odd offset; fresh allocations always are), so every launch can take the ALIGNED variant."""
    t = t.contiguous()
    return t if t.data_ptr() % config.ALIGN == 0 else t.clone()


def _address(t: Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def address_table(tensors: list[Tensor | None], device: torch.device) -> Tensor:
    """int64 [len] of the tensors' addresses (0 for None), written on the device by
    `_write_table_kernel` from kernel arguments: no host buffer, no copy to the device, nothing a
    CUDA graph would replay stale (see that kernel)."""
    addresses = [_address(t) for t in tensors]
    table = torch.empty(len(addresses), dtype=torch.int64, device=device)
    slots = jit.TABLE_SLOTS
    options = config.table_variant().launch_options()
    for start in range(0, len(addresses), slots):
        chunk = addresses[start : start + slots]
        jit._write_table_kernel[(1,)](
            table, start, len(chunk), *chunk, *[0] * (slots - len(chunk)), **options
        )
    return table


def _launch(variant: config.Variant, grid: int, *args) -> None:
    """Launch `variant` over `grid` programs. Every tensor argument must be 16-byte aligned: the
    kernels are compiled with their pointers marked so (`aot.attributes`), as the JIT marks aligned
    pointers, and a misaligned one would make Triton compile a variant the AOT test never saw."""
    for a in args:
        if isinstance(a, Tensor) and a.data_ptr() % config.ALIGN:
            raise ValueError(
                f"{variant.kernel}: a tensor argument at {a.data_ptr():#x} is not "
                f"{config.ALIGN}-byte aligned; pass it through attnres_triton_launch.aligned"
            )
    kernel = getattr(jit, variant.kernel, None) or getattr(jit_backward, variant.kernel)
    kernel[(grid,)](*args, **variant.launch_options())


def _sms(device: torch.device) -> int:
    """Multiprocessors to fill; the interpreter runs programs one after another: 1."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def _rows(n: int, m: int, s_pad: int) -> int:
    """Scratch row length: n rounded up to 16 elements (aligned rows, vector loads). The kernels
    index the [m, s_pad, rows] scratch in int32."""
    zn = triton.cdiv(n, 16) * 16
    if m * s_pad * zn >= 2**31:
        raise ValueError(
            f"AttnRes Triton read too large: {m} sources × {s_pad} queries × {n} tokens "
            "≥ 2^31 scratch entries; split the batch"
        )
    return zn


def read_forward(w: Tensor, sources: list[Tensor], eps: float, outs: list[Tensor]) -> Tensor:
    """Writes out_s = Σ_i softmax_i(z_si) v_i into `outs` (S tensors shaped like the sources) and
    returns the log-sum-exps [S, *tokens] fp32. w: [S, d] fp32; sources: m [*tokens, d] tensors of
    one dtype, contiguous and aligned (`aligned`). One launch (`_read_forward_kernel`): each source
    row is read from HBM once, its re-read served by L2."""
    S, d = w.shape
    src0, m = sources[0], len(sources)
    N, device = src0.numel() // d, src0.device
    lse = torch.empty(S, *src0.shape[:-1], dtype=torch.float32, device=device)
    if N == 0:
        return lse
    plan = config.read_forward_launch(N, d, m, S, dtype_name(src0.dtype))
    s_pad = plan.variant.meta["S_PAD"]
    zn = _rows(N, m * plan.n_parts, s_pad)
    w_pad = torch.nn.functional.pad(w, (0, 0, 0, s_pad - S))  # zero queries: no query masks
    dots = torch.empty(plan.n_parts, m, s_pad, zn, dtype=torch.float32, device=device)
    sqs = torch.empty(plan.n_parts, m, zn, dtype=torch.float32, device=device)
    z = torch.empty(m, s_pad, zn, dtype=torch.float32, device=device)
    sync = torch.zeros(1 + 2 * plan.n_blocks, dtype=torch.int32, device=device)
    table = address_table([*sources, *outs], device)
    _launch(plan.variant, plan.grid, table, src0, w_pad, dots, sqs, z, lse, sync, N, zn, d, m, S,
            plan.part, plan.n_parts, plan.n_chunks, plan.n_blocks, eps)  # fmt: skip
    return lse


def read_backward(
    w: Tensor,
    lse: Tensor,
    sources: list[Tensor],
    d_outs: list[Tensor | None],
    d_lse: Tensor | None,
    d_ups: list[Tensor | None],
    eps: float,
) -> tuple[Tensor, list[Tensor]]:
    """(dw [S, d] fp32, the sources' gradients) of a read, from the upstream gradients `d_outs`
    (S tensors in the sources' dtype, contiguous and aligned, None for zero) and `d_lse` ([S,
    *tokens] fp32 or None); each source's gradient is written once, as d_ups[i] + this read's
    where d_ups[i] is given (chaining: autograd's sum of a source's gradients, done in place of
    it)."""
    S, d = w.shape
    src0, m = sources[0], len(sources)
    N, device = src0.numel() // d, src0.device
    d_srcs = [torch.empty_like(s) for s in sources]
    if N == 0:
        return torch.zeros_like(w), d_srcs
    plan = config.read_backward_launch(N, d, m, S, dtype_name(src0.dtype))
    s_pad = plan.variant.meta["S_PAD"]
    rows = 2 * s_pad + 1  # per source: S_PAD dots (a), S_PAD P (g), one Σv² (c)
    zn = _rows(N, plan.n_parts * m, rows)
    w_pad = torch.nn.functional.pad(w, (0, 0, 0, s_pad - S))
    if d_lse is None:
        d_lse = torch.zeros(S, N, dtype=torch.float32, device=device)
    lse, d_lse = aligned(lse), aligned(d_lse)
    parts = torch.empty(plan.n_parts, m, rows, zn, dtype=torch.float32, device=device)
    weights = torch.empty(m, rows, zn, dtype=torch.float32, device=device)
    lanes = torch.empty(plan.n_lanes, s_pad, d, dtype=torch.float32, device=device)
    sync = torch.zeros(1 + 2 * plan.n_blocks + plan.n_lanes * plan.n_chunks, dtype=torch.int32,
                       device=device)  # fmt: skip
    table = address_table([*sources, *d_srcs, *d_ups, *d_outs], device)
    _launch(plan.variant, plan.grid, table, src0, w_pad, lse, d_lse, parts, weights, lanes, sync,
            N, zn, d, m, S, plan.block_n, plan.part, plan.n_parts, plan.n_groups, plan.n_chunks,
            plan.n_blocks, plan.n_lanes, eps)  # fmt: skip
    return lanes.sum(0)[:S], d_srcs


def merge_forward(o: Tensor, lse: Tensor, p: Tensor, w: Tensor, eps: float) -> Tensor:
    """h = α o + β p (see `attnres_triton.py`); o, p contiguous and aligned, lse [*tokens] fp32,
    w [d] fp32."""
    d = p.shape[-1]
    N = p.numel() // d
    h = torch.empty_like(p)
    if N == 0:
        return h
    variant = config.merge_forward_variant(d, dtype_name(p.dtype), dtype_name(o.dtype))
    lse, w = aligned(lse), aligned(w)
    blocks = triton.cdiv(N, variant.meta["BLOCK_N"])
    _launch(variant, blocks, o, lse, p, w, h, N, d, eps)
    return h


def merge_backward(
    o: Tensor, lse: Tensor, p: Tensor, w: Tensor, dh: Tensor, up: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(d_o, d_lse, d_p, dw) of a merge from dh (p's dtype, contiguous and aligned); d_p is
    written as up + this merge's where the chained gradient `up` is given."""
    d = p.shape[-1]
    N = p.numel() // d
    d_o, d_lse, d_p = torch.empty_like(o), torch.empty_like(lse), torch.empty_like(p)
    if N == 0:
        return d_o, d_lse, d_p, torch.zeros_like(w)
    variant = config.merge_backward_variant(d, dtype_name(p.dtype), dtype_name(o.dtype))
    lse, w = aligned(lse), aligned(w)
    n_blocks = triton.cdiv(N, variant.meta["BLOCK_N"])
    n_progs = config.programs(n_blocks, _sms(p.device))
    dw = torch.empty(n_progs, d, dtype=torch.float32, device=p.device)
    _launch(variant, n_progs, o, lse, p, w, dh, p if up is None else up, d_o, d_lse, d_p, dw, N,
            d, eps, int(up is not None), n_blocks, n_progs)  # fmt: skip
    return d_o, d_lse, d_p, dw.sum(0)
