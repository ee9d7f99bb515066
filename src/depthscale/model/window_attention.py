"""Causal sliding-window attention at a cost that follows the window, not the sequence (Blockwise
Parallel Transformer; MegaScale uses windows to cut compute). `attention_dispatch.window_path`
chooses the kernel:

* CUDA, bf16/fp16: FlashAttention-2's sliding window (`aten._flash_attention_forward` with
  `window_size_left = window − 1`, `window_size_right = 0`): one call per layer, blocks outside the
  band never computed, GQA as is, differentiated by its own backward.
* CUDA otherwise (fp32, or no flash window in this build): FlexAttention with a sliding-window block
  mask (built once per (T, window, device)), compiled by Triton; one call per layer too.
* CPU: the queries are cut into blocks of `block` rows; a block [i0, i1) sees exactly the keys
  [i0 − window + 1, i1), one tile of at most block + window − 1 keys with a band mask, so the work
  is T·(block + window) instead of T²/2, and each block's LSE is final (no merge). fp32 runs the
  project's banded kernel (`kernels/window_cpu.cpp`: a KV head's query heads stacked into one GEMM
  per tile, the band applied by index, dK/dV accumulated in place); bf16, or fp32 where the kernel
  did not build, runs each tile on torch's fused flash kernel through `attention_tiles` (band as an
  additive bias built once per shape; dK/dV of overlapping key ranges added into one buffer).
* Elsewhere each block is one SDPA call with a boolean mask, differentiated by autograd.

A dense [T, T] mask would make SDPA compute every score and then discard most (and on CUDA rules
out the flash kernel); per-block SDPA calls on CUDA would be launch-bound.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from depthscale.model import attention_dispatch as dispatch
from depthscale.model import attention_tiles as tiles

BAND_BLOCK = 32
"""Query rows per tile of the banded CPU kernel (stacked over a KV head's query heads, so its GEMMs
keep G·32 rows): each block's band wastes about block/2 keys per row. At T = 4096, window 512:
blocks of 16 / 32 / 64 cost 0.25 / 0.24–0.25 / 0.26–0.28 of full causal (benchmarks/attention.py)."""
TILE_BLOCK = 64
"""Query rows per block on torch's flash kernel or SDPA: one head's rows per call, so smaller
blocks lose more to short GEMMs than they save in masked-out scores."""


def _spans(T: int, window: int, block: int) -> list[tuple[int, int, int]]:
    """(i0, i1, k0) per query block: rows [i0, i1) see keys [k0, i1)."""
    return [(i0, min(i0 + block, T), max(0, i0 - window + 1)) for i0 in range(0, T, block)]


@lru_cache(maxsize=64)
def _band(rows: int, keys: int, window: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Visibility of a block's `keys` keys (ending with the block's last row) to its `rows` rows:
    bool for SDPA, or an additive bias (0 / −inf) in the queries' dtype for the fused kernel."""
    q_pos = torch.arange(keys - rows, keys, device=device)[:, None]
    diff = q_pos - torch.arange(keys, device=device)[None, :]
    visible = (diff >= 0) & (diff < window)
    return visible if dtype == torch.bool else tiles.additive_bias(visible, dtype)


def window_attention(
    q: Tensor, k: Tensor, v: Tensor, window: int, block: int | None = None
) -> Tensor:
    """Causal attention of q [B, H, T, d] over k/v [B, Hkv, T, d] (positions 0..T−1), each query
    seeing the `window` latest keys including its own; the result of SDPA with that dense mask.
    `block`: query rows per tile of the blockwise paths (default: the path's, BAND_BLOCK or
    TILE_BLOCK)."""
    kernel = path(q)
    if kernel == "cuda_flash_window":
        return flash_window(q, k, v, window)
    if kernel == "flex":
        return flex_window(q, k, v, window, compiled=not torch.compiler.is_compiling())
    if kernel == "cpu_band":
        return _Band.apply(q, k, v, window, block or BAND_BLOCK)
    if kernel == "cpu_tiles":
        blocks = window_blocks(q.shape[2], window, block or TILE_BLOCK, q.dtype, q.device)
        return Tiles.apply(q, k, v, blocks)
    return sdpa_blocks(q, k, v, window, block or TILE_BLOCK)


def path(q: Tensor) -> dispatch.WindowPath:
    """The kernel a window over `q` runs on (see `attention_dispatch.window_path`). Not the banded
    CPU kernel while torch.compile traces: its op has no fake kernel (as for the AttnRes reads)."""
    band = q.device.type == "cpu" and not torch.compiler.is_compiling() and _band_ops() is not None
    caps = dispatch.capabilities(q.device)
    return dispatch.window_path(q.device.type, q.dtype, q.shape[-1], caps, band)


def sdpa_blocks(q: Tensor, k: Tensor, v: Tensor, window: int, block: int) -> Tensor:
    """One SDPA call with a boolean band mask per block of `block` query rows."""
    gqa = q.shape[1] != k.shape[1]
    outs = []
    for i0, i1, k0 in _spans(q.shape[2], window, block):
        mask = _band(i1 - i0, i1 - k0, window, torch.bool, q.device)
        outs.append(
            F.scaled_dot_product_attention(
                q[:, :, i0:i1], k[:, :, k0:i1], v[:, :, k0:i1], attn_mask=mask, enable_gqa=gqa
            )
        )
    return torch.cat(outs, dim=2)


def flash_window(q: Tensor, k: Tensor, v: Tensor, window: int) -> Tensor:
    """FlashAttention-2's local attention: row i sees keys [i − window_size_left, i +
    window_size_right] (bottom-right aligned, the same as top-left here: Tq = Tk), so (window − 1,
    0) with the causal flag is exactly this window. The op takes [B, T, H, d]; autograd runs its
    backward with the same window."""
    T = q.shape[2]
    out = torch.ops.aten._flash_attention_forward(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, T, T, 0.0, True,
        False, scale=q.shape[-1] ** -0.5, window_size_left=window - 1, window_size_right=0,
    )[0]  # fmt: skip
    return out.transpose(1, 2)


def flex_window(q: Tensor, k: Tensor, v: Tensor, window: int, compiled: bool = True) -> Tensor:
    """FlexAttention over a sliding-window block mask: only the blocks the band touches are
    computed. `compiled`: through `torch.compile` (the fused Triton kernel; uncompiled, flex runs
    an unfused reference — what CPU tests use, forward only — and inside a compiled region the
    region's compile covers it)."""
    from torch.nn.attention.flex_attention import flex_attention

    fn = _compiled_flex() if compiled else flex_attention
    mask = _window_block_mask(q.shape[2], window, q.device)
    return fn(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


@lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _sliding(window: int):
    def visible(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    return visible


@lru_cache(maxsize=16)
def _window_block_mask(T: int, window: int, device: torch.device):
    """The block mask of a causal window over T positions, built once per (T, window, device)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(_sliding(window), None, None, T, T, device=device)


def _band_ops():
    """`torch.ops.depthscale_window`, or None: under `use_cpu_kernels(False)`, with
    DEPTHSCALE_CPU_KERNELS=0, or where the CPU kernels did not build (as for the depth reads)."""
    from depthscale import kernels

    if kernels.cpu_kernels_override() is False or kernels.load_attnres_cpu() is None:
        return None
    return torch.ops.depthscale_window


class _Band(torch.autograd.Function):
    """The banded CPU kernel as one autograd node: it saves q, k, v, the output and its fp32 LSE
    and recomputes the probabilities in backward (FlashAttention-2's backward)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, window: int, block: int):
        scale = q.shape[-1] ** -0.5
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse = _band_ops().forward(q, k, v, window, block, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.window, ctx.block, ctx.scale = window, block, scale
        return out

    @staticmethod
    def backward(ctx, do: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        do = do.contiguous()
        delta = (do * out).sum(-1)
        grads = _band_ops().backward(do, q, k, v, lse, delta, ctx.window, ctx.block, ctx.scale)
        return *grads, None, None


class Block(NamedTuple):
    """Query rows [i0, i1) attend keys [k0, i1) where `bias` [.., i1 − i0, i1 − k0] is 0 (−inf
    elsewhere, in the queries' dtype; leading dims broadcast over batch and heads). Every row
    sees at least one key (its own), so each block's LSE is final."""

    i0: int
    i1: int
    k0: int
    bias: Tensor


def window_blocks(T: int, window: int, block: int, dtype: torch.dtype, device) -> list[Block]:
    """The blocks of a causal window over T positions (the band as the fused kernel's bias)."""
    return [
        Block(i0, i1, k0, _band(i1 - i0, i1 - k0, window, dtype, device))
        for i0, i1, k0 in _spans(T, window, block)
    ]


class Tiles(torch.autograd.Function):
    """Attention of query blocks over their key ranges (`Block`s), each on torch's fused flash
    kernel through `attention_tiles`, as one autograd node: it saves q, k, v, the output and its
    fp32 LSE and recomputes each block's probabilities in backward; dK/dV of overlapping key
    ranges are added into one fp32 buffer."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, blocks: list[Block]):
        scale = q.shape[-1] ** -0.5
        out = q.new_empty(q.shape)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        for i0, i1, k0, bias in blocks:
            mask = tiles.TileMask(False, bias, None)
            o, s = tiles.forward(q[:, :, i0:i1], k[:, :, k0:i1], v[:, :, k0:i1], mask, scale)
            out[:, :, i0:i1] = o
            lse[:, :, i0:i1] = s
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.blocks, ctx.scale = blocks, scale
        return out

    @staticmethod
    def backward(ctx, do: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        do = do.contiguous()
        dq = torch.empty_like(q)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for i0, i1, k0, bias in ctx.blocks:
            dq_b, dk_b, dv_b = tiles.backward(
                do[:, :, i0:i1],
                q[:, :, i0:i1],
                k[:, :, k0:i1],
                v[:, :, k0:i1],
                out[:, :, i0:i1],
                lse[:, :, i0:i1],
                tiles.TileMask(False, bias, None),
                ctx.scale,
            )
            dq[:, :, i0:i1] = dq_b
            dk[:, :, k0:i1] += dk_b
            dv[:, :, k0:i1] += dv_b
        return dq, dk.to(k.dtype), dv.to(v.dtype), None
