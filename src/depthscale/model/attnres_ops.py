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
  normalised outputs and log-sum-exps; `merge_partial` (phase 2) merges one query's phase-1 result with
  the running partial sum by online softmax.

`multi_query_read` and `merge_partial` run fused Triton kernels (`depthscale.kernels.attnres_triton`)
for CUDA inputs when triton imports; `depthscale.kernels.use_triton` overrides the choice.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import Tensor


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
    """Forward of the multi-query read; also returns the per-token scalars backward needs."""
    shape = sources[0].shape
    values = _flat(sources)
    inv_rms = torch.stack([_inv_rms(v, eps) for v in values])  # [m, N]
    logits = torch.stack([(v @ w.T).T for v in values], dim=1) * inv_rms  # [S, m, N]
    lse = torch.logsumexp(logits, dim=1)  # [S, N]
    weights = torch.exp(logits - lse[:, None])
    out = weights[:, 0, :, None] * values[0]
    for i in range(1, len(values)):
        out.addcmul_(weights[:, i, :, None], values[i])  # [S, N, d]
    S = w.shape[0]
    return out.reshape(S, *shape), lse.reshape(S, *shape[:-1]), inv_rms, logits, weights


class _MultiQueryRead(torch.autograd.Function):
    """Every pass touches each source a fixed number of times and writes in place: the read is
    memory-bound, so passes over [N, d] tensors, not FLOPs, are what it costs."""

    @staticmethod
    def forward(ctx, w: Tensor, eps: float, *sources: Tensor) -> tuple[Tensor, Tensor]:
        out, lse, inv_rms, logits, weights = _multi_query_forward(w, eps, sources)
        ctx.save_for_backward(w, inv_rms, logits, weights, *sources)
        return out, lse

    @staticmethod
    def backward(ctx, d_out: Tensor, d_lse: Tensor):
        w, inv_rms, logits, weights, *sources = ctx.saved_tensors
        values = _flat(sources)
        S, d = w.shape
        d_out = d_out.reshape(S, -1, d).to(values[0].dtype)
        # dot[s, i, n] = do_s · v_i ; dz = a (dot − Σ_j a_j dot_j) (+ a dlse)
        dots = torch.stack([torch.linalg.vecdot(d_out, v) for v in values], dim=1)
        d_logits = weights * (dots - (weights * dots).sum(1, keepdim=True))
        if d_lse is not None:
            d_logits = d_logits + weights * d_lse.reshape(S, 1, -1).to(values[0].dtype)
        g = d_logits * inv_rms  # [S, m, N]
        # the RMS term: −(Σ_s g_si z_si) r_i / d · v_i
        rms_coef = (g * logits).sum(0) * inv_rms / d  # [m, N]
        d_w = torch.zeros_like(w)
        grads = []
        for i, (v, src) in enumerate(zip(values, sources)):
            dv = g[:, i, :].T @ w
            for s in range(S):
                dv.addcmul_(weights[s, i, :, None], d_out[s])
            dv.addcmul_(rms_coef[i, :, None], v, value=-1.0)
            d_w += g[:, i, :] @ v
            grads.append(dv.reshape(src.shape).to(src.dtype))
        return (d_w, None, *grads)


def _merge_forward(
    inter_out: Tensor, inter_lse: Tensor, partial: Tensor, query: Tensor, eps: float
):
    p = _acc(partial)
    inv_rms = _inv_rms(p, eps)
    z = (p @ query) * inv_rms
    alpha = torch.sigmoid(inter_lse - z)
    return torch.lerp(p, inter_out, alpha[..., None]), alpha, z, inv_rms


class _MergePartial(torch.autograd.Function):
    """Phase 2 as a gate: h = α·o + (1−α)·p with α = sigmoid(lse − z), z the partial sum's logit.
    Saves per-token scalars only (α, z, inverse RMS) besides o and p, which are alive anyway."""

    @staticmethod
    def forward(
        ctx, inter_out: Tensor, inter_lse: Tensor, partial: Tensor, query: Tensor, eps: float
    ) -> Tensor:
        h, alpha, z, inv_rms = _merge_forward(inter_out, inter_lse, partial, query, eps)
        ctx.save_for_backward(inter_out, partial, query, alpha, z, inv_rms)
        ctx.eps = eps
        return h.to(partial.dtype)

    @staticmethod
    def backward(ctx, dh: Tensor):
        inter_out, partial, query, alpha, z, inv_rms = ctx.saved_tensors
        p = _acc(partial)
        dh = dh.to(p.dtype)
        d_alpha = torch.linalg.vecdot(dh, inter_out - p) * alpha * (1 - alpha)  # d(lse − z)
        dz = -d_alpha
        coef = (dz * inv_rms)[..., None]
        d_partial = (1 - alpha)[..., None] * dh + coef * query
        d_partial -= (dz * z * inv_rms.pow(2) / p.shape[-1])[..., None] * p
        d_query = (coef * p).reshape(-1, p.shape[-1]).sum(0)
        return alpha[..., None] * dh, d_alpha, d_partial.to(partial.dtype), d_query, None


def _triton_ops(values: list[Tensor], *others: Tensor) -> ModuleType | None:
    """The Triton kernels module when it applies, else None: CUDA inputs (any device under
    `kernels.use_triton(True)`, none under `use_triton(False)`), values of one dtype, no float64
    (gradcheck), triton importable. Imported lazily: model/ must not need triton."""
    from depthscale import kernels

    tensors = [*values, *others]
    override = kernels.triton_override()
    if override is False or (override is None and not all(t.is_cuda for t in tensors)):
        return None
    if len({v.dtype for v in values}) != 1 or any(t.dtype == torch.float64 for t in tensors):
        return None
    return kernels.load_attnres_triton()


def multi_query_read(sources: list[Tensor], queries: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """S queries [S, d] (gain already folded in) over m sources [B, T, d] -> fp32 outputs
    [S, B, T, d] and log-sum-exps [S, B, T], with a backward that saves only per-token scalars."""
    ops = _triton_ops(sources, queries)
    if ops is not None:
        return ops.triton_multi_query_read(sources, queries, eps)
    if not torch.is_grad_enabled():  # inference: nothing to save (and simpler for torch.compile)
        return _multi_query_forward(_acc(queries), eps, sources)[:2]
    return _MultiQueryRead.apply(_acc(queries), eps, *sources)


def depth_read_efficient(
    sources: list[Tensor], query: Tensor, key_weight: Tensor | None, eps: float
) -> Tensor:
    """`depth_read` with the memory-efficient backward."""
    if len(sources) == 1:
        return sources[0]
    out, _ = multi_query_read(sources, _query(query, key_weight)[None], eps)
    return out[0].to(sources[0].dtype)


def inter_block_read(blocks: list[Tensor], queries: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Phase 1: all S queries of a block [S, d] over its completed blocks, one pass over memory."""
    return multi_query_read(blocks, queries, eps)


def merge_partial(
    inter_out: Tensor, inter_lse: Tensor, partial: Tensor, query: Tensor, eps: float
) -> Tensor:
    """Phase 2: merge a phase-1 result (fp32 output [B,T,d], lse [B,T]) with the partial sum's
    one-source term by online softmax; exact, elementwise over tokens."""
    ops = _triton_ops([partial], inter_out, inter_lse, query)
    if ops is not None:
        return ops.triton_merge_partial(inter_out, inter_lse, partial, query, eps)
    if not torch.is_grad_enabled():
        return _merge_forward(inter_out, inter_lse, partial, _acc(query), eps)[0].to(partial.dtype)
    return _MergePartial.apply(inter_out, inter_lse, partial, _acc(query), eps)
