"""One tile of ring attention — local query rows × a run of held keys — forward and backward, on a
fused attention kernel where one exists.

A tile's result is merged by log-sum-exp, and its backward recomputes probabilities from the
*global* LSE and output (FlashAttention-2's backward, split over K/V blocks): so the kernel must
return the LSE and take it back. On CPU, torch's flash kernel (`_scaled_dot_product_flash_attention
_for_cpu` and its backward) does both, tiles its work internally (no [Tq, Tk] score matrix), takes
GQA as is (H query heads over Hkv key heads) and a causal flag; masks that are not top-left causal
(window edges, zigzag tiles) go in as an additive fp32 bias built once per plan. Elsewhere (CUDA
today: its fused ops' LSE layout is padded and has not been checked against a GPU here) the
reference below runs, which materialises fp32 scores per tile (bounded by the plan's `kv_tile`).

Shapes: q [B, H, Tq, d], k/v [B, Hkv, Tk, d], all fp32; out [B, H, Tq, d], lse [B, H, Tq]; the
backward returns dq [B, H, Tq, d] and dk/dv [B, Hkv, Tk, d] (summed over each KV head's queries).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class TileMask(NamedTuple):
    """Which (row, key) pairs of a tile are visible: all (`causal` False, `bias` None), top-left
    causal (row i sees keys 0..i), or the pairs where `bias` [Tq, Tk] is 0 (−inf elsewhere);
    `dense` is the boolean form for the reference path (None: all visible)."""

    causal: bool
    bias: Tensor | None
    dense: Tensor | None


def additive_bias(visible: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """A boolean visibility mask as the fused kernel takes it: 0 where visible, −inf elsewhere."""
    bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return bias.masked_fill_(~visible, float("-inf"))


def fused(device: torch.device) -> bool:
    """Whether tiles on `device` run a fused kernel (else the reference)."""
    return device.type == "cpu"


def forward(q: Tensor, k: Tensor, v: Tensor, mask: TileMask, scale: float) -> tuple[Tensor, Tensor]:
    if fused(q.device):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, mask.causal, attn_mask=mask.bias, scale=scale
        )
    return reference_forward(q, k, v, mask.dense, scale)


def backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    mask: TileMask,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of the tile from the global `out` and `lse` of its rows (and their `do`)."""
    if fused(q.device):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse, 0.0, mask.causal, attn_mask=mask.bias, scale=scale
        )
    return reference_backward(do, q, k, v, out, lse, mask.dense, scale)


def _grouped(q: Tensor, k: Tensor) -> Tensor:
    """q [B, H, T, d] as [B, Hkv, G, T, d]: the G query heads of each KV head."""
    return q.unflatten(1, (k.shape[1], q.shape[1] // k.shape[1]))


def _scores(qg: Tensor, k: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """fp32 scores [B, Hkv, G, Tq, Tk], masked pairs at −inf."""
    s = torch.einsum("bhgqd,bhkd->bhgqk", qg, k) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def reference_forward(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    """Scores materialised in fp32. Every row sees at least one key (the plan drops rows that see
    none), so the LSE is finite."""
    s = _scores(_grouped(q, k), k, mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    return torch.einsum("bhgqk,bhkd->bhgqd", p, v).flatten(1, 2), lse.flatten(1, 2)


def reference_backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    mask: Tensor | None,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    qg, dog = _grouped(q, k), _grouped(do, k)
    delta = (dog * _grouped(out, k)).sum(-1)
    p = torch.exp(_scores(qg, k, mask, scale) - _grouped(lse, k).unsqueeze(-1))
    dv = torch.einsum("bhgqk,bhgqd->bhkd", p, dog)
    ds = p * (torch.einsum("bhgqd,bhkd->bhgqk", dog, v) - delta.unsqueeze(-1))
    dq = torch.einsum("bhgqk,bhkd->bhgqd", ds, k) * scale
    dk = torch.einsum("bhgqk,bhgqd->bhkd", ds, qg) * scale
    return dq.flatten(1, 2), dk, dv
