"""One tile of ring attention — local query rows × a run of held keys — forward and backward, on a
fused attention kernel where one exists (`attention_dispatch.tile_path` chooses).

A tile's result is merged by log-sum-exp, and its backward recomputes probabilities from the
*global* LSE and output (FlashAttention-2's backward, split over K/V blocks): so the kernel must
return the LSE and take it back.

* CPU: torch's flash kernel (`_scaled_dot_product_flash_attention_for_cpu` and its backward), fp32
  tiles; it tiles its work internally, takes GQA as is and a causal flag, and an additive fp32 bias
  for masks that are not top-left causal (window edges, padding).
* CUDA, bf16/fp16: SDPA's flash op (`_scaled_dot_product_flash_attention` and its backward: GQA as
  is, LSE [B, H, Tq] fp32) for unmasked and causal tiles; `_flash_attention_forward` with its window
  arguments for square band tiles (row i sees keys i − left … i + right); SDPA's memory-efficient
  op with an additive bias for the rest. That kernel has no GQA, so each KV head's G query heads are stacked along the
  rows ([B, Hkv, G·Tq, d]: dK/dV come out summed over them, K/V are not copied per query head) and
  the bias repeated G times; its bias rows must be 16-byte aligned and its LSE rows are padded to a
  multiple of 32, both handled here.
* Anything else: the reference below (fp32 scores materialised per tile, bounded by the plan's
  `kv_tile`) — also the truth the tests compare with.

Causal alignment: a causal tile is "row i sees keys 0..i" (top-left) with Tq ≤ Tk. Keys past Tq are
then seen by no row, so they are dropped before a kernel runs (their dK/dV are zero): every kernel
gets a square causal tile, where top-left and bottom-right alignment (FlashAttention-2's convention
for Tq ≠ Tk) agree.

Shapes: q [B, H, Tq, d], k/v [B, Hkv, Tk, d]; out [B, H, Tq, d], lse [B, H, Tq] fp32; the backward
returns dq [B, H, Tq, d] and dk/dv [B, Hkv, Tk, d] (summed over each KV head's queries), in the
kernel's dtype (the ring accumulates them in fp32).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from depthscale.model import attention_dispatch as dispatch

aten = torch.ops.aten
BIAS_ALIGN = 16
"""The efficient kernel reads bias rows in 128-bit vectors: its row stride must be a multiple of
8 half-precision elements (SDPA pads user masks the same way); 16 keeps fp32 aligned too."""
LSE_ROWS = 32
"""The efficient kernel's LSE has its query dim padded to a multiple of 32."""


class TileMask(NamedTuple):
    """Which (row, key) pairs of a tile are visible: all (`causal` False, `bias` None), top-left
    causal (row i sees keys 0..i), a band of a square tile (`window` (left, right): row i sees keys
    i − left … i + right), or the pairs where `bias` [Tq, Tk] is 0 (−inf elsewhere); `dense` is the
    boolean form (None: all visible, or given by the fields above)."""

    causal: bool
    bias: Tensor | None
    dense: Tensor | None
    window: tuple[int, int] | None = None


def additive_bias(visible: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """A boolean visibility mask as the fused kernel takes it: 0 where visible, −inf elsewhere."""
    bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return bias.masked_fill_(~visible, float("-inf"))


def fused(device: torch.device) -> bool:
    """Whether masks for tiles on `device` are built in the fused kernels' form (the causal flag,
    an additive bias) rather than as a boolean mask: where fused tile kernels exist. Every path
    takes that form (the reference rebuilds the boolean mask from it)."""
    return device.type in ("cpu", "cuda")


def mask_kind(mask: TileMask) -> dispatch.MaskKind:
    if mask.causal:
        return "causal"
    if mask.window is not None:
        return "window"
    return "none" if mask.bias is None and mask.dense is None else "masked"


def backend(device: torch.device) -> tuple[str, dispatch.Capabilities]:
    """(device type, fused kernels usable there): what every choice below reads — the one place
    a test replaces to run the CUDA choices with CPU tensors."""
    return device.type, dispatch.capabilities(device)


def path(q: Tensor, mask: TileMask) -> dispatch.TilePath:
    """The kernel this tile runs on (see `attention_dispatch.tile_path`)."""
    kind, caps = backend(q.device)
    return dispatch.tile_path(kind, q.dtype, mask_kind(mask), q.shape[-1], caps)


def policy(q: Tensor) -> dispatch.TilePolicy:
    """How the ring cuts its steps into tiles for q's kernels (`attention_dispatch.TilePolicy`)."""
    kind, caps = backend(q.device)
    return dispatch.tile_policy(kind, q.dtype, q.shape[-1], caps)


def tile_dtype(q: Tensor) -> torch.dtype:
    """What tiles compute in (`attention_dispatch.tile_dtype`)."""
    return dispatch.tile_dtype(backend(q.device)[0], q.dtype)


def visible(mask: TileMask, Tq: int, Tk: int, device: torch.device) -> Tensor | None:
    """The boolean [Tq, Tk] form of any mask (None: every pair visible)."""
    if mask.dense is not None:
        return mask.dense
    if mask.causal:
        return torch.ones(Tq, Tk, dtype=torch.bool, device=device).tril()
    if mask.window is not None:
        left, right = mask.window
        offset = torch.arange(Tq, device=device)[:, None] - torch.arange(Tk, device=device)
        return (offset <= left) & (offset >= -right)
    return None if mask.bias is None else mask.bias == 0


def _bias(mask: TileMask, Tq: int, Tk: int, device: torch.device) -> Tensor | None:
    """The additive bias of a mask that is not a kernel flag (a band, where the kernel has no
    window arguments, or a boolean mask); None for a causal tile (the kernel's flag)."""
    if mask.causal or mask.bias is not None or (mask.window is None and mask.dense is None):
        return mask.bias
    return additive_bias(visible(mask, Tq, Tk, device))


def forward(q: Tensor, k: Tensor, v: Tensor, mask: TileMask, scale: float) -> tuple[Tensor, Tensor]:
    kernel = path(q, mask)
    if kernel == "reference":
        return reference_forward(
            *_upcast(q, k, v), visible(mask, q.shape[2], k.shape[2], q.device), scale
        )
    k, v = _square(mask, q, k), _square(mask, q, v)
    if kernel == "cpu_flash":
        bias = _bias(mask, q.shape[2], k.shape[2], q.device)
        return aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, mask.causal, attn_mask=bias, scale=scale
        )
    if kernel == "cuda_flash":
        return cuda_flash_forward(q, k, v, mask.causal, scale)
    if kernel == "cuda_flash_window":
        return cuda_flash_window_forward(q, k, v, mask.window, scale)
    return cuda_efficient_forward(q, k, v, _efficient_mask(mask, q, k.shape[2]), scale)


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
    kernel = path(q, mask)
    if kernel == "reference":
        do, q, k, v, out = _upcast(do, q, k, v, out)
        return reference_backward(
            do, q, k, v, out, lse, visible(mask, q.shape[2], k.shape[2], q.device), scale
        )
    Tk = k.shape[2]
    k, v = _square(mask, q, k), _square(mask, q, v)
    if kernel == "cpu_flash":
        bias = _bias(mask, q.shape[2], k.shape[2], q.device)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse, 0.0, mask.causal, attn_mask=bias, scale=scale
        )
    elif kernel == "cuda_flash":
        dq, dk, dv = cuda_flash_backward(do, q, k, v, out, lse, mask.causal, scale)
    elif kernel == "cuda_flash_window":
        dq, dk, dv = cuda_flash_window_backward(do, q, k, v, out, lse, mask.window, scale)
    else:
        bias = _efficient_mask(mask, q, k.shape[2])
        dq, dk, dv = cuda_efficient_backward(do, q, k, v, out, lse, bias, scale)
    return dq, _unsquare(dk, Tk), _unsquare(dv, Tk)


def _upcast(*xs: Tensor) -> list[Tensor]:
    """Half-precision tensors in fp32 for the reference (fp32 and fp64 kept as they are)."""
    return [x.to(torch.promote_types(x.dtype, torch.float32)) for x in xs]


def _square(mask: TileMask, q: Tensor, kv: Tensor) -> Tensor:
    """A causal tile's keys past its last row are seen by no row: drop them (see the module doc)."""
    return kv.narrow(2, 0, q.shape[2]) if mask.causal and kv.shape[2] > q.shape[2] else kv


def _unsquare(grad: Tensor, Tk: int) -> Tensor:
    """dK/dV of the dropped keys: zero."""
    return F.pad(grad, (0, 0, 0, Tk - grad.shape[2])) if grad.shape[2] < Tk else grad


def _efficient_mask(mask: TileMask, q: Tensor, Tk: int) -> Tensor | None:
    """The additive bias for the efficient kernel. A causal tile (square after `_square`) goes in
    as a bias too: its rows are stacked over query heads, which the kernel's causal flag would not
    follow."""
    if mask.causal:
        T = q.shape[2]
        return additive_bias(torch.ones(T, T, dtype=torch.bool, device=q.device).tril())
    return _bias(mask, q.shape[2], Tk, q.device)


# ------------------------------------------------------------------------- CUDA: the flash op


@lru_cache(maxsize=8)
def _no_dropout_rng(device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """Placeholders for the random-number state the backward ops take: read only with dropout, so
    never here. (flash seed [2] and offset [] as uint64 — the forward's types —, efficient's long.)"""
    return (
        torch.zeros(2, dtype=torch.uint64, device=device),
        torch.zeros((), dtype=torch.uint64, device=device),
        torch.zeros((), dtype=torch.long, device=device),
    )


def cuda_flash_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[
        :2
    ]
    return out, lse


def cuda_flash_backward(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale
) -> tuple[Tensor, Tensor, Tensor]:
    """The flash backward from the global `out`/`lse` (the LSE must be contiguous: the kernel
    reads its rows by the shape, not the strides)."""
    seed, offset, _ = _no_dropout_rng(q.device)
    Tq, Tk = q.shape[2], k.shape[2]
    return aten._scaled_dot_product_flash_attention_backward(
        do, q, k, v, out, lse.contiguous(), None, None, Tq, Tk, 0.0, causal, seed, offset,
        scale=scale,
    )  # fmt: skip


# ----------------------------------------------------------- CUDA: flash with window arguments


def cuda_flash_window_forward(
    q: Tensor, k: Tensor, v: Tensor, window: tuple[int, int], scale: float
) -> tuple[Tensor, Tensor]:
    """A square band tile on FlashAttention-2's local attention: row i sees keys [i − left,
    i + right] (bottom-right aligned, the same as top-left here: Tq = Tk), blocks outside the band
    never computed. The op takes [B, T, H, d] (GQA as is) and returns the LSE [B, H, Tq]."""
    (Tq, Tk), (left, right) = (q.shape[2], k.shape[2]), window
    out, lse = aten._flash_attention_forward(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, Tq, Tk, 0.0, False,
        False, scale=scale, window_size_left=left, window_size_right=right,
    )[:2]  # fmt: skip
    return out.transpose(1, 2), lse


def cuda_flash_window_backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    window: tuple[int, int],
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Its backward from the global `out`/`lse` (LSE contiguous, as for the flash op)."""
    seed, offset, _ = _no_dropout_rng(q.device)
    (Tq, Tk), (left, right) = (q.shape[2], k.shape[2]), window

    def bthd(x: Tensor) -> Tensor:  # the op's layout, last dim contiguous
        return x.transpose(1, 2).contiguous()

    dq, dk, dv = aten._flash_attention_backward(
        bthd(do), bthd(q), bthd(k), bthd(v), bthd(out), lse.contiguous(), None, None, Tq, Tk,
        0.0, False, seed, offset, scale=scale, window_size_left=left, window_size_right=right,
    )  # fmt: skip
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


# --------------------------------------------------------------- CUDA: the memory-efficient op


def _stack_heads(x: Tensor, hkv: int) -> Tensor:
    """[B, H, T, ...] → [B, Hkv, G·T, ...]: each KV head's G query heads stacked along the rows."""
    return x.unflatten(1, (hkv, -1)).flatten(2, 3)


def _unstack_heads(x: Tensor, groups: int) -> Tensor:
    """[B, Hkv, G·T, ...] → [B, H, T, ...]."""
    return x.unflatten(2, (groups, -1)).flatten(1, 2)


def _kernel_bias(bias: Tensor | None, q: Tensor, hkv: int) -> Tensor | None:
    """The bias ([Tq, Tk], or [B, 1, Tq, Tk] per row of the batch) repeated for the G stacked
    query heads, in q's dtype, rows aligned to BIAS_ALIGN elements, broadcast to
    [B, Hkv, G·Tq, Tk] (what the kernel's shape checks want)."""
    if bias is None:
        return None
    B, H, Tq, _ = q.shape
    Tk, G = bias.shape[-1], H // hkv
    n = B if bias.dim() == 4 else 1
    width = math.ceil(Tk / BIAS_ALIGN) * BIAS_ALIGN
    rows = torch.empty(n, G, Tq, width, dtype=q.dtype, device=q.device)[..., :Tk]
    rows.copy_(bias.reshape(n, 1, Tq, Tk).expand(n, G, Tq, Tk))
    return rows.flatten(1, 2).unsqueeze(1).expand(B, hkv, G * Tq, Tk)


def cuda_efficient_forward(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    hkv, groups = k.shape[1], q.shape[1] // k.shape[1]
    out, lse = aten._scaled_dot_product_efficient_attention(
        _stack_heads(q, hkv), k, v, _kernel_bias(bias, q, hkv), True, 0.0, False, scale=scale
    )[:2]
    rows = groups * q.shape[2]
    return _unstack_heads(out, groups), _unstack_heads(lse[..., :rows], groups)


def cuda_efficient_backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    bias: Tensor | None,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """The efficient backward from the global `out`/`lse`: the LSE goes in padded to LSE_ROWS
    (+inf past the rows: a padded row, if read, has probability 0)."""
    hkv, groups = k.shape[1], q.shape[1] // k.shape[1]
    B, rows = q.shape[0], groups * q.shape[2]
    padded = lse.new_full((B, hkv, math.ceil(rows / LSE_ROWS) * LSE_ROWS), float("inf"))
    padded[..., :rows] = _stack_heads(lse, hkv)
    _, _, seed = _no_dropout_rng(q.device)
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        _stack_heads(do, hkv).contiguous(),
        _stack_heads(q, hkv).contiguous(),
        k.contiguous(),
        v.contiguous(),
        _kernel_bias(bias, q, hkv),
        _stack_heads(out, hkv).contiguous(),
        padded,
        seed,
        seed,
        0.0,
        [True, True, True, False],
        False,
        scale=scale,
    )
    return _unstack_heads(dq, groups), dk, dv


# ------------------------------------------------------------------------- the reference (fp32)


def _grouped(q: Tensor, k: Tensor) -> Tensor:
    """q [B, H, T, d] as [B, Hkv, G, T, d]: the G query heads of each KV head."""
    return q.unflatten(1, (k.shape[1], q.shape[1] // k.shape[1]))


def _scores(qg: Tensor, k: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """fp32 scores [B, Hkv, G, Tq, Tk], masked pairs at −inf (a mask [B, 1, Tq, Tk] per row of
    the batch, or [Tq, Tk] for all)."""
    s = torch.einsum("bhgqd,bhkd->bhgqk", qg, k) * scale
    if mask is not None and mask.dim() == 4:
        mask = mask.unsqueeze(2)
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
