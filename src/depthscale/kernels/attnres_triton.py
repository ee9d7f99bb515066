"""Fused Triton kernels for the Attention-Residual depth reads, forward and backward.

Drop-in for `multi_query_read` (phase 1) and `merge_partial` (phase 2) of `model/attnres_ops.py`,
which stay the reference; `attnres_ops` dispatches here for CUDA inputs. On CPU they run only under
`TRITON_INTERPRET=1` (the tests). Kernels: `attnres_triton_jit.py` (the read's backward:
`attnres_triton_jit_backward.py`); which compiled variant a launch uses: `attnres_triton_config.py`;
buffers and grids: `attnres_triton_launch.py`; ahead-of-time compiles for sm_90a/sm_80 on a
machine without a GPU: `aot.py`.

Math, per token. Queries w_s (s = 1..S, key-norm gain folded in) over sources v_i (i = 1..m):
  r_i = (mean(v_i²) + eps)^-½,  z_si = r_i (v_i · w_s),  a_si = softmax_i(z_si),
  o_s = Σ_i a_si v_i,  lse_s = logsumexp_i z_si
Phase-1 backward from do_s and dlse_s, with P_si = do_s · v_i and D_s = Σ_i a_si P_si:
  g_si = a_si (P_si − D_s + dlse_s) r_i,   c_i = (Σ_s g_si z_si) r_i / d
  dv_i = Σ_s a_si do_s + Σ_s g_si w_s − c_i v_i,   dw_s = Σ_tokens Σ_i g_si v_i
Phase 2 is the same read over two sources: the phase-1 result (logit lse, value o) and the partial
sum p (logit z = r (p · w)). With α = softmax weight of o, β = 1 − α:
  h = α o + β p;  do = α dh,  dlse = α (dh · o − dh · h),  dz = β (dh · p − dh · h)
  dp = β dh + dz r (w − (z r / d) p),  dw = Σ_tokens dz r p

Design, and why:
- d is chunked inside every kernel (BLOCK_D columns at a time, d a runtime argument). The first
  design held whole rows ([S_PAD, BLOCK_N, next_pow2(d)] fp32 per program): BLOCK_N fell to 1 and
  ptxas spilled from d = 4096 on (1–9 KB per thread), and d = 8192, S = 1 took 3 minutes to
  compile into 43 KB/thread of local memory. Now a compiled variant depends on (S_PAD, BLOCK_N,
  BLOCK_D, dtype, ALIGNED, warps) only, never on d: a few dozen variants cover every production
  shape, each compiles in about a second, and tests/unit/test_triton_aot.py compiles all of them
  for sm_90a and sm_80 and asserts zero spills.
- A read needs every whole-d dot product before any weight is known, so each source row is used
  twice — and read from HBM once: one launch (`_read_forward_kernel`) whose programs take tickets
  (an atomic counter: the order they start in) naming work items, a token block's logits items
  (source × 512-column part: partial dots into fp32 scratch; the last to arrive sums the parts in
  order and writes the logits z and lse) followed by its weighted-sum items (d-chunks, waiting on
  the block's flag), so the sum re-reads source bytes read moments before: L2 hits. A program
  waits only on smaller tickets, which have started and wait on nothing: no deadlock. The first
  design had a logits launch then a sum launch over all tokens: every source read twice from HBM,
  a ceiling of (m+1)/(2m+1) of bandwidth. `benchmarks/attnres_traffic.py` models the bytes.
- The backward is one launch too (`_read_backward_kernel`, `attnres_triton_jit_backward.py`), built
  the same way: a token block's logits items (512-column part × group of sources: partial w·v,
  do·v and Σv² into fp32 scratch; the last to arrive computes a, g and c for the block) come just
  before its gradient items (d-chunks), which re-read the block's sources and upstream gradients
  from L2, so each is read from HBM once and each source gradient written once: ≈ (2m + S)·2d bytes
  per token, the minimum. The first design had three launches (logits, weights, gradients) and
  read every source and upstream gradient twice: 1.5–2× the minimum. A block's bytes must stay in
  L2 between the two reads, so its tokens shrink as rows grow (16, 4 or 1 tokens: ≤ 1 MiB,
  `BACKWARD_BLOCK_BYTES`); a tile's 16 rows are (source, token) pairs, so the query contractions
  stay fp32 `tl.dot`s (from S_PAD = 16 for the logits, 4 for the gradients) and the loads vectors
  whatever the block size. Upstream gradients are walked one query at a time, so no tile grows
  with S. The queries' gradient dw: each gradient item's [S_PAD, GRAD_D] share is added to one of
  n_lanes L2-resident [S_PAD, d] lanes (block b to lane b mod n_lanes) after block b − n_lanes's
  share — a chain per lane and chunk, so the sum's order is fixed (deterministic, no float
  atomics) — and a torch sum over the lanes finishes it; lanes are spaced so the awaited item ran
  ≥ 8 MiB of traffic earlier (`DW_LANE_SPACING`). The previous design's per-program dw partials
  need a program that owns a d-chunk over many token blocks, which a ticketed launch has not.
  The merge's backward needs whole-d dots per token before its pass over d, so it keeps one grid
  of ~4 programs per SM striding over token blocks, each accumulating its own [d] row of the
  partials in place (17 MB at d = 8192 on an H100).
- Gradient chaining: a chained read (`attnres_ops.inter_block_read_chained`) returns the sources
  again as aliases, and its backward writes each source's gradient once as the aliases' gradient
  (the later reads' sum) plus its own, rounded as autograd would add them — instead of autograd
  keeping a separate gradient per read and summing them in a buffer (one more pass over [N, d] per
  read and source). The gradients themselves are fresh tensors: an incoming gradient may be shared
  with another input (AddBackward hands one tensor to both), so it is never written in place, and
  an autograd Function returns all its inputs' gradients at once, so they are allocated together.
- Sources, outputs and gradients are never stacked (a stack is one more full copy): the kernels
  read an int64 table of their addresses, written on the device by a one-program kernel whose
  arguments are the addresses (`attnres_triton_launch.address_table`). A CUDA graph captures those
  arguments by value — under replay the graph's tensors keep their addresses — so the read is
  CUDA-graph safe with no host sync. The first design built the table on the host and copied it
  from pinned memory: a graph replays that copy from a host buffer long since freed or reused.
- Alignment is proved: every scalar argument is annotated and excluded from Triton's
  specialisation (so a value of 1 or a multiple of 16 never makes a new variant); every pointer is
  16-byte aligned (a misaligned view is copied first, `_launch` refuses one) and compiled so, as the
  JIT marks it; the kernels rewrite d as `d // 16 * 16` under ALIGNED (d a multiple of every
  BLOCK_D: no column masks) and mark the address table's entries `tl.multiple_of`, so every source,
  output and gradient access is a 64- or 128-bit vector (the AOT test reads the PTX).
- Arithmetic is fp32 throughout; results are stored in their tensors' dtypes: phase-1 outputs in
  the sources' dtype (lse in fp32), so a bf16 model saves bf16, not fp32, [B, T, d] tensors; the
  merge reads a phase-1 output of the partial sum's dtype or fp32.
- Under torch.compile the reads are custom ops (`torch.library.custom_op`, namespace
  `depthscale_triton`): the address table needs `data_ptr()`, which dynamo cannot trace, so the
  compiler sees each read as one opaque op with a shape-only fake version, inside its graph (no
  graph break), with the backward registered on it (no chaining there: a custom op's outputs may
  not alias its inputs). Eager reads go through autograd Functions that chain.
"""

from __future__ import annotations

import torch
from torch import Tensor

import depthscale.kernels.attnres_triton_launch as launch
from depthscale.kernels.attnres_triton_launch import aligned


def _sources(sources) -> list[Tensor]:
    srcs = [aligned(s) for s in sources]
    if len({(s.shape, s.dtype, s.device) for s in srcs}) != 1:
        raise ValueError("sources must share shape, dtype and device")
    return srcs


def _forward(w: Tensor, srcs: list[Tensor], eps: float) -> tuple[list[Tensor], Tensor]:
    outs = [torch.empty_like(srcs[0]) for _ in range(w.shape[0])]
    return outs, launch.read_forward(w, srcs, eps, outs)


def _grad(g: Tensor | None, like: Tensor) -> Tensor | None:
    return None if g is None else aligned(g.to(like.dtype))


def _backward(w, lse, srcs, d_outs, d_lses, d_ups, eps) -> tuple[Tensor, list[Tensor]]:
    """d_outs, d_lses: S upstream gradients each (None for none); d_ups: m chained gradients (or
    None each)."""
    d_outs = [_grad(g, srcs[0]) for g in d_outs]
    d_lse = None
    if any(g is not None for g in d_lses):
        d_lse = torch.stack([torch.zeros_like(lse[0]) if g is None else g.float() for g in d_lses])
    d_ups = [_grad(g, srcs[0]) for g in d_ups]
    return launch.read_backward(w, lse, srcs, d_outs, d_lse, d_ups, eps)


# ---------------------------------------------------------------------------------------------
# Custom ops: what torch.compile sees (opaque, with fake versions and a registered backward).


@torch.library.custom_op("depthscale_triton::read_forward", mutates_args=())
def _read_forward(w: Tensor, sources: list[Tensor], eps: float) -> tuple[Tensor, Tensor]:
    srcs = _sources(sources)
    out = torch.empty(w.shape[0], *srcs[0].shape, dtype=srcs[0].dtype, device=srcs[0].device)
    return out, launch.read_forward(w, srcs, eps, [aligned(o) for o in out.unbind(0)])


@_read_forward.register_fake
def _(w: Tensor, sources: list[Tensor], eps: float) -> tuple[Tensor, Tensor]:
    shape = sources[0].shape
    out = sources[0].new_empty(w.shape[0], *shape)
    return out, sources[0].new_empty(w.shape[0], *shape[:-1], dtype=torch.float32)


@torch.library.custom_op("depthscale_triton::read_backward", mutates_args=())
def _read_backward(
    w: Tensor, lse: Tensor, sources: list[Tensor], d_out: Tensor, d_lse: Tensor, eps: float
) -> tuple[Tensor, list[Tensor]]:
    srcs = _sources(sources)
    return _backward(w, lse, srcs, list(d_out.unbind(0)), list(d_lse.unbind(0)), [None] * len(srcs),
                     eps)  # fmt: skip


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
    if d_out is None:
        d_out = torch.zeros(w.shape[0], *sources[0].shape, dtype=sources[0].dtype,
                            device=sources[0].device)  # fmt: skip
    if d_lse is None:
        d_lse = torch.zeros_like(lse)
    dw, d_srcs = _read_backward(w, lse, sources, d_out, d_lse, ctx.eps)
    return dw, d_srcs, None


_read_forward.register_autograd(_read_grads, setup_context=_read_setup)


@torch.library.custom_op("depthscale_triton::merge_forward", mutates_args=())
def _merge_forward(
    inter_out: Tensor, inter_lse: Tensor, partial: Tensor, w: Tensor, eps: float
) -> Tensor:
    return launch.merge_forward(
        aligned(inter_out), inter_lse.contiguous(), aligned(partial), w, eps
    )


@_merge_forward.register_fake
def _(inter_out, inter_lse, partial, w, eps):
    return torch.empty_like(partial, memory_format=torch.contiguous_format)


@torch.library.custom_op("depthscale_triton::merge_backward", mutates_args=())
def _merge_backward(
    inter_out: Tensor, inter_lse: Tensor, partial: Tensor, w: Tensor, dh: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return launch.merge_backward(aligned(inter_out), inter_lse.contiguous(), aligned(partial), w,
                                 _grad(dh, partial), None, eps)  # fmt: skip


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


# ---------------------------------------------------------------------------------------------
# Eager autograd: separate outputs (no stacked [S, ...] gradient), chaining.


class TritonRead(torch.autograd.Function):
    """S outputs, S log-sum-exps, then (`chain`) the m sources again as aliases whose gradient
    this read's backward adds to its own (see the module docstring)."""

    @staticmethod
    def forward(ctx, w: Tensor, eps: float, chain: bool, *sources: Tensor):
        srcs = _sources(sources)
        outs, lse = _forward(w, srcs, eps)
        ctx.save_for_backward(w, lse, *srcs)
        ctx.eps = eps
        ctx.set_materialize_grads(False)
        aliases = [s.view_as(s) for s in sources] if chain else []
        return (*outs, *(x.clone() for x in lse.unbind(0)), *aliases)

    @staticmethod
    def backward(ctx, *upstream: Tensor | None):
        w, lse, *srcs = ctx.saved_tensors
        S, m = w.shape[0], len(srcs)
        d_ups = list(upstream[2 * S :]) or [None] * m
        d_w, d_srcs = _backward(w, lse, srcs, upstream[:S], upstream[S : 2 * S], d_ups, ctx.eps)
        return (d_w, None, None, *d_srcs)


class TritonMerge(torch.autograd.Function):
    """h, then (`chain`) the partial sum again as an alias whose gradient the backward adds to
    its own."""

    @staticmethod
    def forward(ctx, inter_out, inter_lse, partial, w, eps: float, chain: bool):
        o, lse, p = aligned(inter_out), inter_lse.contiguous(), aligned(partial)
        h = launch.merge_forward(o, lse, p, w, eps)
        ctx.save_for_backward(o, lse, p, w)
        ctx.eps = eps
        ctx.set_materialize_grads(False)
        return (h, partial.view_as(partial)) if chain else h

    @staticmethod
    def backward(ctx, dh: Tensor | None, d_up: Tensor | None = None):
        o, lse, p, w = ctx.saved_tensors
        if dh is None:  # h unused: only the alias's gradient passes through
            return None, None, d_up, None, None, None
        d_o, d_lse, d_p, d_w = launch.merge_backward(
            o, lse, p, w, _grad(dh, p), _grad(d_up, p), ctx.eps
        )
        return d_o, d_lse, d_p, d_w, None, None


# ---------------------------------------------------------------------------------------------
# Entry points for `attnres_ops`.


def triton_reads(
    sources: list[Tensor], queries: Tensor, eps: float, chain: bool
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """S queries [S, d] over m sources [B, T, d] -> per query an output [B, T, d] (the sources'
    dtype) and an fp32 lse [B, T], and the sources to use from now on (aliases whose gradients
    this read's backward extends when `chain`, in eager mode; else the sources)."""
    w = queries.float().contiguous()
    if torch.compiler.is_compiling():
        out, lse = _read_forward(w, list(sources), eps)
        return list(out.unbind(0)), list(lse.unbind(0)), list(sources)
    if not torch.is_grad_enabled():
        outs, lse = _forward(w, _sources(sources), eps)
        return outs, list(lse.unbind(0)), list(sources)
    results = TritonRead.apply(w, eps, chain, *sources)
    S = w.shape[0]
    chained = list(results[2 * S :]) if chain else list(sources)
    return list(results[:S]), list(results[S : 2 * S]), chained


def triton_merge(
    inter_out: Tensor, inter_lse: Tensor, partial: Tensor, query: Tensor, eps: float, chain: bool
) -> tuple[Tensor, Tensor]:
    """`attnres_ops.merge_partial(_chained)`: h [B, T, d] in partial's dtype and the partial sum
    to use from now on."""
    w = query.float().contiguous()
    lse = inter_lse.float()
    if torch.compiler.is_compiling():
        return _merge_forward(inter_out, lse, partial, w, eps), partial
    if not torch.is_grad_enabled():
        o, p = aligned(inter_out), aligned(partial)
        return launch.merge_forward(o, lse.contiguous(), p, w, eps), partial
    if chain:
        return TritonMerge.apply(inter_out, lse, partial, w, eps, True)
    return TritonMerge.apply(inter_out, lse, partial, w, eps, False), partial


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
    """`attnres_ops.merge_partial` as one fused kernel each way: phase-1 output [B, T, d] (the
    partial sum's dtype or fp32, read as is: its gradient comes back in that dtype) and lse [B, T]
    merged with the partial sum [B, T, d] for query [d] -> [B, T, d] in partial's dtype."""
    return _merge_forward(inter_out, inter_lse.float(), partial, query.float().contiguous(), eps)
