"""Attention-Residual depth reads: a softmax over earlier outputs, per token.

The score of source v for query w is `(w ⊙ g) · RMSNorm(v)`: the key norm's gain g folds into the
query, so keys are never materialised. Logits, softmax and weighted sums run in fp32; results are stored
in the sources' dtype.

- `depth_read`: the reference (plain autograd). Everything else is tested against it.
- `depth_read_efficient`: same result, but autograd saves only per-token fp32 scalars (inverse RMS,
  logits, weights) besides the sources, which stay alive anyway; plain autograd keeps several fp32
  [m, B, T, d] intermediates per read.
- Two-phase (paper §4.2, Algorithm 1), exact in forward and backward:
  `inter_block_read` (phase 1) reads the completed blocks once for all S queries of a block and returns
  normalised outputs and log-sum-exps, one tensor per query; `merge_partial` (phase 2) merges one
  query's phase-1 result with the running partial sum by online softmax. Phase-1 outputs are stored in
  the sources' dtype like every other result (the merge saves them for backward: in a bf16 model an
  fp32 copy would cost two bf16 activations per sublayer), so bf16 rounds them once more than a
  one-pass read would; log-sum-exps stay fp32.

Kernels: `multi_query_reads` and `merge_partial` run fused Triton kernels
(`depthscale.kernels.attnres_triton`) for CUDA inputs when triton imports, and fused C++ kernels
(`depthscale.kernels.attnres_cpu`, one pass over a token's sources, threads over tokens,
deterministic) for fp32/bf16/fp16 CPU inputs when they build; otherwise, for float64 and under
torch.compile, the PyTorch ops below. `kernels.use_triton` / `kernels.use_cpu_kernels` override the
choice, DEPTHSCALE_CPU_KERNELS=0 disables the CPU kernels. One rule picks the path
(`kernel_dispatch.choose`); `kernel_paths()` says which path each read type took, the first time
a (read type, path, fallback reason) occurs it is logged to `depthscale.kernels`, and strict mode
raises where a read misses an available kernel (a silent fallback, e.g. for sources of mixed
dtypes, costs time and memory).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from depthscale.model.kernel_dispatch import (  # noqa: F401  (public here too)
    KernelFallbackError,
    choose,
    kernel_paths,
    record,
    reset_kernel_paths,
)


def _acc(t: Tensor) -> Tensor:
    """Accumulation precision: fp32, or fp64 for fp64 inputs (so gradcheck can run)."""
    return t.double() if t.dtype == torch.float64 else t.float()


def _query(query: Tensor, key_weight: Tensor | None) -> Tensor:
    return _acc(query) if key_weight is None else _acc(query) * _acc(key_weight)


def depth_read(
    sources: list[Tensor], query: Tensor, key_weight: Tensor | None, eps: float
) -> Tensor:
    """h = Σ_i softmax_i(w · RMSNorm(v_i)) · v_i over m sources [B, T, d] -> [B, T, d]."""
    if len(sources) == 1:
        return sources[0]
    values = _acc(torch.stack(sources))  # [m, B, T, d]
    inv_rms = torch.rsqrt(values.pow(2).mean(-1) + eps)  # [m, B, T]
    logits = (values @ _query(query, key_weight)) * inv_rms
    weights = torch.softmax(logits, dim=0)
    return (weights.unsqueeze(-1) * values).sum(0).to(sources[0].dtype)


def depth_weights(
    sources: list[Tensor], query: Tensor, key_weight: Tensor | None, eps: float
) -> Tensor:
    """The softmax weights over depth [m, B, T] (diagnostics)."""
    values = _acc(torch.stack(sources))
    logits = (values @ _query(query, key_weight)) * torch.rsqrt(values.pow(2).mean(-1) + eps)
    return torch.softmax(logits, dim=0)


# ---------------------------------------------------------------------------------------------
# Multi-query read with a hand-written backward: the core of both the efficient and two-phase paths.
#
# For queries w_s (s = 1..S) over sources v_i (i = 1..m), per token:
#   r_i = (mean(v_i²) + eps)^-½,  z_si = r_i (v_i · w_s),  a_si = softmax_i(z_si),  o_s = Σ_i a_si v_i
# Backward from do_s (and dlse_s for the log-sum-exp output):
#   dz_si = a_si (do_s · v_i − do_s · o_s) + a_si dlse_s
#   dv_i  = Σ_s a_si do_s + Σ_s dz_si r_i (w_s − (z_si r_i / d) v_i)
#   dw_s  = Σ_tokens Σ_i dz_si r_i v_i


def _flat(sources: tuple[Tensor, ...] | list[Tensor]) -> list[Tensor]:
    """Sources as [N, d] views in accumulation precision (no copy for fp32 inputs). Looping over the
    few sources beats stacking them: a stack is one more full copy of all m sources."""
    return [_acc(s).reshape(-1, s.shape[-1]) for s in sources]


def _inv_rms(v: Tensor, eps: float) -> Tensor:
    """(mean(v²) + eps)^-½ per row in one pass (no squared temporary)."""
    return torch.rsqrt(torch.linalg.vector_norm(v, dim=-1).square() / v.shape[-1] + eps)


def _multi_query_forward(w: Tensor, eps: float, sources: tuple[Tensor, ...] | list[Tensor]):
    """Forward of the multi-query read in PyTorch: one output [B, T, d] (sources[0]'s dtype) and one
    lse [B, T] (accumulation dtype) per query, and the per-token scalars backward needs."""
    shape, dtype = sources[0].shape, sources[0].dtype
    values = _flat(sources)
    inv_rms = torch.stack([_inv_rms(v, eps) for v in values])  # [m, N]
    logits = torch.stack([(v @ w.T).T for v in values], dim=1) * inv_rms  # [S, m, N]
    lse = torch.logsumexp(logits, dim=1)  # [S, N]
    weights = torch.exp(logits - lse[:, None])
    outs, lses = [], []
    for s in range(w.shape[0]):
        out = weights[s, 0, :, None] * values[0]
        for i in range(1, len(values)):
            out.addcmul_(weights[s, i, :, None], values[i])  # [N, d]
        outs.append(out.reshape(shape).to(dtype))
        lses.append(lse[s].reshape(shape[:-1]).clone())  # not views of one tensor: own outputs
    return outs, lses, inv_rms, logits, weights


def _multi_query_backward(w, inv_rms, logits, weights, sources, d_outs, d_lses):
    """PyTorch backward of the multi-query read; a None upstream gradient counts as zero."""
    values = _flat(sources)
    d, m, N = w.shape[1], len(values), values[0].shape[0]
    acc = values[0].dtype
    d_outs = [None if g is None else g.reshape(-1, d).to(acc) for g in d_outs]
    # dot[s, i, n] = do_s · v_i ; dz = a (dot − Σ_j a_j dot_j) (+ a dlse)
    zeros = values[0].new_zeros(m, N)
    dots = torch.stack(
        [zeros if g is None else torch.stack([torch.linalg.vecdot(g, v) for v in values])
         for g in d_outs]
    )  # fmt: skip
    d_logits = weights * (dots - (weights * dots).sum(1, keepdim=True))
    if any(g is not None for g in d_lses):
        d_lse = torch.stack([zeros[0] if g is None else g.reshape(-1).to(acc) for g in d_lses])
        d_logits = d_logits + weights * d_lse[:, None]
    g = d_logits * inv_rms  # [S, m, N]
    # the RMS term: −(Σ_s g_si z_si) r_i / d · v_i
    rms_coef = (g * logits).sum(0) * inv_rms / d  # [m, N]
    d_w = torch.zeros_like(w)
    grads = []
    for i, (v, src) in enumerate(zip(values, sources)):
        dv = g[:, i, :].T @ w
        for s, d_out in enumerate(d_outs):
            if d_out is not None:
                dv.addcmul_(weights[s, i, :, None], d_out)
        dv.addcmul_(rms_coef[i, :, None], v, value=-1.0)
        d_w += g[:, i, :] @ v
        grads.append(dv.reshape(src.shape).to(src.dtype))
    return grads, d_w


def _contiguous(tensors) -> list[Tensor]:
    return [t if t.is_contiguous() else t.contiguous() for t in tensors]


class _MultiQueryRead(torch.autograd.Function):
    """Returns S outputs, then S log-sum-exps, then (`chain`) the m sources again as aliases; each
    its own tensor: a stacked [S, ...] output would cost a zero-filled [S, B, T, d] gradient per
    consumer in backward. `ops`: the CPU kernels, or None for PyTorch, where every pass touches each
    source a fixed number of times and writes in place (the read is memory-bound: passes over
    [N, d] tensors, not FLOPs, are what it costs). Both save per-token scalars only, besides the
    sources, which are alive anyway.

    Chaining: when the next read takes the aliases instead of the sources, autograd sees one
    consumer per source, and this read's backward adds its gradient to the aliases' (the later reads'
    sum) itself, in the same order autograd would have, instead of autograd summing separately
    stored [B, T, d] gradients in its input buffers (one more pass over memory per read and source).
    """

    @staticmethod
    def forward(
        ctx, w: Tensor, eps: float, ops: Any, chain: bool, *sources: Tensor
    ) -> tuple[Tensor, ...]:
        if ops is not None:
            outs, lses, *scalars = ops.read_forward(_contiguous(sources), w, eps, True)
        else:
            outs, lses, *scalars = _multi_query_forward(w, eps, sources)
        ctx.save_for_backward(w, *scalars, *sources)
        ctx.ops = ops
        ctx.set_materialize_grads(False)
        aliases = [s.view_as(s) for s in sources] if chain else []
        return (*outs, *lses, *aliases)

    @staticmethod
    def backward(ctx, *upstream: Tensor | None):
        w, s1, s2, s3, *sources = ctx.saved_tensors
        S = w.shape[0]
        d_outs, d_lses = list(upstream[:S]), list(upstream[S : 2 * S])
        d_up = list(upstream[2 * S :])  # the aliases' gradients (chain), None where unused
        if ctx.ops is not None:
            grads, d_w = ctx.ops.read_backward(
                _contiguous(sources), w, s1, s2, s3, d_outs, d_lses, d_up
            )
        else:
            grads, d_w = _multi_query_backward(w, s1, s2, s3, sources, d_outs, d_lses)
            if d_up:
                grads = [g if up is None else up + g for g, up in zip(grads, d_up)]
        return (d_w, None, None, None, *grads)


def _merge_forward(
    inter_out: Tensor, inter_lse: Tensor, partial: Tensor, query: Tensor, eps: float
):
    p = _acc(partial)
    inv_rms = _inv_rms(p, eps)
    z = (p @ query) * inv_rms
    alpha = torch.sigmoid(inter_lse - z)
    return torch.lerp(p, _acc(inter_out), alpha[..., None]), alpha, z, inv_rms


class _MergePartial(torch.autograd.Function):
    """Phase 2 as a gate: h = α·o + (1−α)·p with α = sigmoid(lse − z), z the partial sum's logit.
    Saves per-token scalars only (α, z, inverse RMS) besides o and p, as they come (o in the
    sources' dtype: no fp32 copy of a [B, T, d] tensor is kept for backward). `ops`: the CPU
    kernels, or None for PyTorch. `chain`: also return p as an alias whose gradient backward adds
    to p's own (see `_MultiQueryRead`)."""

    @staticmethod
    def forward(
        ctx,
        inter_out: Tensor,
        inter_lse: Tensor,
        partial: Tensor,
        query: Tensor,
        eps: float,
        ops: Any,
        chain: bool,
    ) -> Tensor | tuple[Tensor, Tensor]:
        if ops is not None:
            o, p = inter_out.contiguous(), partial.contiguous()
            h, alpha, z, inv_rms = ops.merge_forward(
                o, inter_lse.contiguous(), p, query.contiguous(), eps, True
            )
            ctx.save_for_backward(o, p, query, alpha, z, inv_rms)
        else:
            h, alpha, z, inv_rms = _merge_forward(inter_out, inter_lse, partial, query, eps)
            h = h.to(partial.dtype)
            ctx.save_for_backward(inter_out, partial, query, alpha, z, inv_rms)
        ctx.ops = ops
        ctx.lse_shape = inter_lse.shape
        ctx.set_materialize_grads(False)
        return (h, partial.view_as(partial)) if chain else h

    @staticmethod
    def backward(ctx, dh: Tensor | None, d_up: Tensor | None = None):
        inter_out, partial, query, alpha, z, inv_rms = ctx.saved_tensors
        if dh is None:  # h unused: only the alias's gradient passes through
            return None, None, d_up, None, None, None, None
        if ctx.ops is not None:
            d_o, d_alpha, d_partial, d_query = ctx.ops.merge_backward(
                inter_out, partial, query.contiguous(), alpha, z, inv_rms, dh, d_up
            )
            return d_o, d_alpha.reshape(ctx.lse_shape), d_partial, d_query, None, None, None
        p = _acc(partial)
        dh = dh.to(p.dtype)
        d_alpha = torch.linalg.vecdot(dh, _acc(inter_out) - p) * alpha * (1 - alpha)  # d(lse − z)
        dz = -d_alpha
        coef = (dz * inv_rms)[..., None]
        d_partial = (1 - alpha)[..., None] * dh + coef * query
        d_partial -= (dz * z * inv_rms.pow(2) / p.shape[-1])[..., None] * p
        d_partial = d_partial.to(partial.dtype)
        if d_up is not None:
            d_partial = d_up + d_partial
        d_query = (coef * p).reshape(-1, p.shape[-1]).sum(0)
        d_o = (alpha[..., None] * dh).to(inter_out.dtype)
        return d_o, d_alpha, d_partial, d_query, None, None, None


def _reads(
    sources: list[Tensor],
    queries: Tensor,
    eps: float,
    chain: bool,
    kind: str,
    chosen: tuple[str, Any, Any] | None = None,
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    path, ops, _ = chosen or choose(kind, sources, queries)
    if path == "triton":
        return ops.triton_reads(sources, queries, eps, chain)
    w = _acc(queries).contiguous()
    cpu = ops if path == "cpu" else None
    if not torch.is_grad_enabled():  # inference: nothing to save (and simpler for torch.compile)
        if cpu is not None:
            outs, lses, *_ = cpu.read_forward(_contiguous(sources), w, eps, False)
        else:
            outs, lses, *_ = _multi_query_forward(w, eps, sources)
        return list(outs), list(lses), list(sources)
    results = _MultiQueryRead.apply(w, eps, cpu, chain, *sources)
    S = w.shape[0]
    chained = list(results[2 * S :]) if chain else list(sources)
    return list(results[:S]), list(results[S : 2 * S]), chained


def multi_query_reads(
    sources: list[Tensor], queries: Tensor, eps: float
) -> tuple[list[Tensor], list[Tensor]]:
    """S queries [S, d] (gain already folded in) over m sources [B, T, d] -> per query, an output
    [B, T, d] in the sources' dtype (sources[0]'s if they are mixed) and a log-sum-exp [B, T] in
    fp32 (fp64 for fp64 inputs), with a backward that saves only per-token scalars. Separate
    tensors, not stacked: consumers take one query's result each."""
    outs, lses, _ = _reads(sources, queries, eps, chain=False, kind="read")
    return outs, lses


def multi_query_read(sources: list[Tensor], queries: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """`multi_query_reads` stacked: outputs [S, B, T, d] and log-sum-exps [S, B, T] (tests and
    benchmarks compare implementations through this form)."""
    chosen = choose("read", sources, queries)
    if chosen[0] == "triton":
        return chosen[1].triton_multi_query_read(sources, queries, eps)
    outs, lses, _ = _reads(sources, queries, eps, chain=False, kind="read", chosen=chosen)
    return torch.stack(outs), torch.stack(lses)


def depth_read_efficient(
    sources: list[Tensor], query: Tensor, key_weight: Tensor | None, eps: float
) -> Tensor:
    """`depth_read` with the memory-efficient backward."""
    if len(sources) == 1:
        return sources[0]
    outs, _ = multi_query_reads(sources, _query(query, key_weight)[None], eps)
    return outs[0]


def inter_block_read(
    blocks: list[Tensor], queries: Tensor, eps: float
) -> tuple[list[Tensor], list[Tensor]]:
    """Phase 1: all S queries of a block [S, d] over its completed blocks, one pass over memory;
    per query an output [B, T, d] in the blocks' dtype and an fp32 log-sum-exp [B, T]."""
    outs, lses, _ = _reads(blocks, queries, eps, chain=False, kind="phase1")
    return outs, lses


def inter_block_read_chained(
    blocks: list[Tensor], queries: Tensor, eps: float
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """`inter_block_read`, plus the blocks to use from now on in place of `blocks`: the same
    values (aliases) whose gradients this read's backward extends, so that autograd never sums a
    block's gradients from several reads in a buffer of its own (an extra pass over memory per
    read and block). Numerically identical to reading `blocks` again (the sums run in autograd's
    order). Where nothing chains (inference, and the Triton kernels under torch.compile: a custom
    op's outputs may not alias its inputs) the blocks come back unchanged."""
    return _reads(blocks, queries, eps, chain=True, kind="phase1")


def _merge(
    inter_out: Tensor, inter_lse: Tensor, partial: Tensor, query: Tensor, eps: float, chain: bool
) -> tuple[Tensor, Tensor]:
    path, ops, _ = choose("merge", [partial], query, inter_lse, inter_out)
    if path == "triton":
        return ops.triton_merge(inter_out, inter_lse, partial, query, eps, chain)
    w = _acc(query)
    cpu = ops if path == "cpu" else None
    if not torch.is_grad_enabled():
        if cpu is not None:
            h = cpu.merge_forward(
                inter_out.contiguous(),
                inter_lse.contiguous(),
                partial.contiguous(),
                w.contiguous(),
                eps,
                False,
            )[0]
            return h, partial
        return _merge_forward(inter_out, inter_lse, partial, w, eps)[0].to(partial.dtype), partial
    if chain:
        return _MergePartial.apply(inter_out, inter_lse, partial, w, eps, cpu, True)
    return _MergePartial.apply(inter_out, inter_lse, partial, w, eps, cpu, False), partial


def merge_partial(
    inter_out: Tensor, inter_lse: Tensor, partial: Tensor, query: Tensor, eps: float
) -> Tensor:
    """Phase 2: merge a phase-1 result (output [B,T,d] in the partial sum's dtype or fp32, fp32 lse
    [B,T]) with the partial sum's one-source term by online softmax; exact, elementwise over
    tokens."""
    return _merge(inter_out, inter_lse, partial, query, eps, chain=False)[0]


def merge_partial_chained(
    inter_out: Tensor, inter_lse: Tensor, partial: Tensor, query: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """`merge_partial`, plus the partial sum to use from now on (an alias whose gradient this
    merge's backward extends; see `inter_block_read_chained`)."""
    return _merge(inter_out, inter_lse, partial, query, eps, chain=True)
