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
"""

from __future__ import annotations

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


def _forward_stats(values: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """values [m, N, d] fp32, w [S, d] -> inverse RMS [m, N] and logits [S, m, N]."""
    inv_rms = torch.rsqrt(values.pow(2).mean(-1) + eps)
    logits = torch.einsum("mnd,sd->smn", values, w) * inv_rms
    return inv_rms, logits


class _MultiQueryRead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: Tensor, eps: float, *sources: Tensor) -> tuple[Tensor, Tensor]:
        shape = sources[0].shape
        values = _acc(torch.stack([s.reshape(-1, shape[-1]) for s in sources]))  # [m, N, d]
        inv_rms, logits = _forward_stats(values, w, eps)
        lse = torch.logsumexp(logits, dim=1)  # [S, N]
        weights = torch.exp(logits - lse[:, None])
        out = torch.einsum("smn,mnd->snd", weights, values)  # fp32 [S, N, d]
        ctx.save_for_backward(w, inv_rms, logits, weights, *sources)
        ctx.eps = eps
        return out.reshape(w.shape[0], *shape), lse.reshape(w.shape[0], *shape[:-1])

    @staticmethod
    def backward(ctx, d_out: Tensor, d_lse: Tensor):
        w, inv_rms, logits, weights, *sources = ctx.saved_tensors
        d = sources[0].shape[-1]
        values = _acc(torch.stack([s.reshape(-1, d) for s in sources]))
        S = w.shape[0]
        d_out = d_out.reshape(S, -1, d).to(values.dtype)
        out = torch.einsum("smn,mnd->snd", weights, values)
        d_weight = torch.einsum("snd,mnd->smn", d_out, values) - (d_out * out).sum(-1)[:, None]
        d_logits = weights * d_weight
        if d_lse is not None:
            d_logits = d_logits + weights * d_lse.reshape(S, 1, -1).to(values.dtype)
        g = d_logits * inv_rms  # [S, m, N]
        d_values = torch.einsum("smn,snd->mnd", weights, d_out)
        d_values += torch.einsum("smn,sd->mnd", g, w)
        d_values -= (g * logits * inv_rms / d).sum(0)[..., None] * values
        d_w = torch.einsum("smn,mnd->sd", g, values)
        grads = [dv.reshape(s.shape).to(s.dtype) for dv, s in zip(d_values, sources)]
        return (d_w, None, *grads)


def multi_query_read(sources: list[Tensor], queries: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """S queries [S, d] (gain already folded in) over m sources [B, T, d] -> fp32 outputs
    [S, B, T, d] and log-sum-exps [S, B, T], with a backward that saves only per-token scalars."""
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
    p = _acc(partial)
    z = (p @ _acc(query)) * torch.rsqrt(p.pow(2).mean(-1) + eps)  # intra logit [B, T]
    m = torch.maximum(inter_lse, z)
    a_inter = torch.exp(inter_lse - m)
    a_intra = torch.exp(z - m)
    h = (a_inter[..., None] * inter_out + a_intra[..., None] * p) / (a_inter + a_intra)[..., None]
    return h.to(partial.dtype)
