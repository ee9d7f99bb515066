"""Which attention kernel runs where: pure choosers over (device type, dtype, mask kind, head size,
what this torch offers), so the CUDA choice is tested on a machine without a GPU.

Ring-attention tiles (`attention_tiles`) need a kernel that returns the log-sum-exp and a backward
that takes the *global* output and LSE back; sliding windows (`window_attention`) need one call per
layer whose cost follows the window. On CUDA, in bf16/fp16:

* tiles without a mask or top-left causal → `aten._scaled_dot_product_flash_attention` and its
  backward (FlashAttention-2: GQA as is, LSE [B, H, Tq]); square band tiles (a sliding window's
  diagonal block and halo) → `aten._flash_attention_forward` with its window arguments. The ring
  then gives such work all of a step's keys in one call (`TilePolicy`, on CPU's flash kernel too):
  one kernel call and one merge per step instead of one per 512-key tile;
* tiles with an arbitrary mask (window edges, padding) → `aten._scaled_dot_product_efficient_attention`
  with an additive bias and `compute_log_sumexp`, and its backward;
* windows → `aten._flash_attention_forward` with `window_size_left` (FlashAttention-2's local
  attention: blocks outside the band are never computed), else FlexAttention with a sliding-window
  block mask (compiled), else blockwise SDPA;
* packed documents (`data.document_mask`) → the same op in its variable-length form
  (`cum_seq_q`/`cum_seq_k`: every document its own sequence, a window as above), else FlexAttention
  with a document block mask, else SDPA with the dense mask.

CPU keeps its own kernels (torch's CPU flash kernel per tile, the project's banded window kernel);
every other case falls back to the fp32 reference, which is also the truth the tests compare with.

Each fused op is used only if its schema has the arguments we pass (checked by name, so a renamed
or reordered argument in another torch version falls back instead of failing), its kernel is built
in, the device can run it (flash: sm80+) and its SDPA backend is not switched off
(`torch.backends.cuda.enable_flash_sdp(False)` etc.).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import torch

HALF = (torch.bfloat16, torch.float16)
MaskKind = Literal["none", "causal", "window", "masked"]
TilePath = Literal["cpu_flash", "cuda_flash", "cuda_flash_window", "cuda_efficient", "reference"]
WindowPath = Literal["cpu_band", "cpu_tiles", "cuda_flash_window", "flex", "sdpa_blocks"]
DocumentPath = Literal["cpu_tiles", "cuda_varlen", "flex", "sdpa_dense"]

SCHEMAS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "_scaled_dot_product_flash_attention": (
        ("query", "key", "value", "dropout_p", "is_causal", "return_debug_mask"), ("scale",),
    ),
    "_scaled_dot_product_flash_attention_backward": (
        ("grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k",
         "max_q", "max_k", "dropout_p", "is_causal", "philox_seed", "philox_offset"),
        ("scale",),
    ),
    "_scaled_dot_product_efficient_attention": (
        ("query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal"),
        ("scale",),
    ),
    "_scaled_dot_product_efficient_attention_backward": (
        ("grad_out_", "query", "key", "value", "attn_bias", "out", "logsumexp", "philox_seed",
         "philox_offset", "dropout_p", "grad_input_mask", "is_causal"),
        ("scale",),
    ),
    "_flash_attention_forward": (
        ("query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p",
         "is_causal", "return_debug_mask"),
        ("scale", "window_size_left", "window_size_right"),
    ),
    # called by autograd for `window_attention` and by the ring's band tiles, the last two
    # positional arguments (the forward's RNG state, unread without dropout) by position
    "_flash_attention_backward": (
        ("grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k",
         "max_q", "max_k", "dropout_p", "is_causal"),
        ("scale", "window_size_left", "window_size_right"),
    ),
}  # fmt: skip
"""Per fused op: the arguments we pass by position (their names, in order) and those we pass by
name. An op whose schema lacks them is not used."""


@dataclass(frozen=True)
class Capabilities:
    """What the fused attention kernels of this torch build offer on one device."""

    flash: bool = False
    """SDPA's flash op and its backward (bf16/fp16, head size ≤ 256, a multiple of 8)."""
    efficient: bool = False
    """SDPA's memory-efficient op with an additive bias, its LSE and its backward."""
    flash_window: bool = False
    """`_flash_attention_forward` with a sliding window and variable-length sequences
    (`cum_seq_q`/`cum_seq_k`), differentiable."""
    flex: bool = False
    """FlexAttention, compiled by Triton (block-sparse: a window costs what it covers)."""


def schema_matches(op_name: str, positional: tuple[str, ...], keywords: tuple[str, ...]) -> bool:
    """Whether `aten.<op_name>` exists, its arguments start with `positional` in that order and
    include every one of `keywords`."""
    packet = getattr(torch.ops.aten, op_name, None)
    overload = getattr(packet, "default", None) if packet is not None else None
    if overload is None:
        return False
    got = tuple(a.name for a in overload._schema.arguments)
    return got[: len(positional)] == positional and set(keywords) <= set(got)


@lru_cache(maxsize=1)
def _schemas() -> dict[str, bool]:
    return {name: schema_matches(name, *args) for name, args in SCHEMAS.items()}


@lru_cache(maxsize=8)
def _cuda_build(device: torch.device) -> tuple[bool, bool, bool]:
    """(flash kernel built and the device sm80+, efficient kernel built, Triton for FlexAttention):
    what does not change while the process runs."""
    major, _ = torch.cuda.get_device_capability(device)
    flash = bool(torch.backends.cuda.is_flash_attention_available()) and major >= 8
    efficient = True  # built into every CUDA wheel; it runs from sm50 up
    flex = importlib.util.find_spec("triton") is not None and (
        importlib.util.find_spec("torch.nn.attention.flex_attention") is not None
    )
    return flash, efficient, flex


def capabilities(device: torch.device) -> Capabilities:
    """The fused kernels usable on `device` now: nothing off CUDA (CPU keeps its own kernels);
    on CUDA the built-in kernels whose schema matches and whose SDPA backend is enabled."""
    if device.type != "cuda":
        return Capabilities()
    flash_built, efficient_built, flex = _cuda_build(device)
    s = _schemas()
    flash_on = flash_built and torch.backends.cuda.flash_sdp_enabled()
    return Capabilities(
        flash=flash_on
        and s["_scaled_dot_product_flash_attention"]
        and s["_scaled_dot_product_flash_attention_backward"],
        efficient=efficient_built
        and torch.backends.cuda.mem_efficient_sdp_enabled()
        and s["_scaled_dot_product_efficient_attention"]
        and s["_scaled_dot_product_efficient_attention_backward"],
        flash_window=flash_on and s["_flash_attention_forward"] and s["_flash_attention_backward"],
        flex=flex,
    )


# What `torch.compiler.assume_constant_result` does (as model/kernel_dispatch.record): under
# torch.compile the probe runs once while tracing and its answer is a constant of the graph, so a
# compiled layer neither breaks its graph on it nor re-probes (SDPA switches flipped after a
# compile are not seen by that graph).
capabilities._dynamo_marked_constant = True  # type: ignore[attr-defined]


def flash_head_ok(head_dim: int) -> bool:
    """FlashAttention-2 and the efficient kernel take head sizes that are multiples of 8 up to
    256 (SDPA pads others; the raw ops do not)."""
    return head_dim % 8 == 0 and head_dim <= 256


def tile_path(
    device_type: str, dtype: torch.dtype, mask: MaskKind, head_dim: int, caps: Capabilities
) -> TilePath:
    """The kernel a ring-attention tile runs on: CPU's flash kernel on CPU; on CUDA in bf16/fp16
    the flash op for unmasked and causal tiles, flash's window op for band tiles, and the
    efficient op (additive bias) for the rest, or for all when those are unavailable; otherwise
    the fp32 reference."""
    if device_type == "cpu":
        return "cpu_flash"
    if device_type == "cuda" and dtype in HALF and flash_head_ok(head_dim):
        if mask in ("none", "causal") and caps.flash:
            return "cuda_flash"
        if mask == "window" and caps.flash_window:
            return "cuda_flash_window"
        if caps.efficient:
            return "cuda_efficient"
    return "reference"


@dataclass(frozen=True)
class TilePolicy:
    """How the ring cuts a step's keys into kernel calls (`parallel/ring_schedule.py` plans by it).

    Bounded (the default): runs of at most `kv_tile` consecutive keys, each with the rows that see
    it — what a materialised score tile (the reference) needs. Whole: a kernel that tiles
    internally (FlashAttention-2, torch's CPU flash kernel) takes a step's unmasked or causal work
    in one call however many keys it has, so a step costs one call and one fp32 merge instead of
    one per `kv_tile` keys (at 16K local tokens, 32-64 merges over every query row: on CUDA the
    merges, not the attention, bounded the ring). Only masked work (a bias) stays cut into
    `kv_tile` runs, to bound the bias."""

    whole: bool = False
    window: bool = False
    """Square band tiles (a window's diagonal block and halo) take flash's window arguments
    instead of a bias (whole policy only)."""


def tile_policy(
    device_type: str, dtype: torch.dtype, head_dim: int, caps: Capabilities
) -> TilePolicy:
    """Whole steps where unmasked and causal tiles run on a flash kernel: CUDA's flash op (with
    its window arguments where available) and CPU's (measured: one causal call over a 2K/8K
    block is as fast or faster than its 512-key tiles and their merges, 0.5×/0.95× on 2 cores).
    Bounded elsewhere: the efficient op alone would take a causal step as a [T, T] bias, the
    reference materialises scores."""
    causal = tile_path(device_type, dtype, "causal", head_dim, caps)
    if causal == "cpu_flash":
        return TilePolicy(whole=True)
    if causal != "cuda_flash":
        return TilePolicy()
    window = tile_path(device_type, dtype, "window", head_dim, caps) == "cuda_flash_window"
    return TilePolicy(whole=True, window=window)


def tile_dtype(device_type: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype ring tiles compute in: the model's half dtype on CUDA (the fused kernels take it;
    their LSE and the ring's merge stay fp32), fp32 elsewhere (CPU's kernels run fp32 tiles; the
    reference upcasts whatever it gets)."""
    return dtype if device_type == "cuda" and dtype in HALF else torch.float32


def window_path(
    device_type: str, dtype: torch.dtype, head_dim: int, caps: Capabilities, band_kernel: bool
) -> WindowPath:
    """The kernel a causal sliding window runs on. CPU: the banded kernel (fp32, where it built),
    else torch's flash kernel per tile (fp32/bf16). CUDA: flash's sliding window in bf16/fp16,
    else FlexAttention with a block mask. Else, and elsewhere, one SDPA call per block of rows."""
    if device_type == "cpu":
        if dtype == torch.float32 and band_kernel:
            return "cpu_band"
        if dtype in (torch.float32, torch.bfloat16):
            return "cpu_tiles"
        return "sdpa_blocks"
    if device_type == "cuda":
        if dtype in HALF and flash_head_ok(head_dim) and caps.flash_window:
            return "cuda_flash_window"
        if caps.flex and head_dim >= 16:
            return "flex"
    return "sdpa_blocks"


def kernel_family(kernel_name: str) -> str:
    """The attention backend a GPU kernel (as the profiler names it) belongs to: 'cudnn', 'flash',
    'efficient', 'flex' (an Inductor Triton template), or 'other' (GEMMs, softmax: the math path)."""
    n = kernel_name.lower()
    if "cudnn" in n:  # cuDNN's SDPA kernels have "flash" in their names too
        return "cudnn"
    if "flash" in n:
        return "flash"
    if "fmha" in n or "attentionkernel" in n or "efficient_attention" in n:
        return "efficient"
    if "flex" in n or "triton_tem" in n:
        return "flex"
    return "other"


def document_path(
    device_type: str, dtype: torch.dtype, head_dim: int, caps: Capabilities
) -> DocumentPath:
    """The kernel causal attention within packed documents runs on. CPU: blocks of rows on
    torch's flash kernel, each over the keys from its earliest document start (fp32/bf16). CUDA:
    FlashAttention-2's variable-length form in bf16/fp16 (documents as separate sequences: nothing
    across them is computed), else FlexAttention with a document block mask. Else, and elsewhere,
    SDPA with the dense [B, 1, T, T] mask."""
    if device_type == "cpu" and dtype in (torch.float32, torch.bfloat16):
        return "cpu_tiles"
    if device_type == "cuda":
        if dtype in HALF and flash_head_ok(head_dim) and caps.flash_window:
            return "cuda_varlen"
        if caps.flex and head_dim >= 16:
            return "flex"
    return "sdpa_dense"
