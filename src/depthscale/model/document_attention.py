"""Causal attention that never crosses a document boundary inside a packed row
(`data.document_mask`; the documents come from `model/documents.py`), optionally in a sliding
window. `attention_dispatch.document_path` chooses the kernel:

* CUDA, bf16/fp16: FlashAttention-2's variable-length form (`aten._flash_attention_forward` with
  `cum_seq_q`/`cum_seq_k`): the B rows are laid end to end and every document is its own sequence,
  so no score across documents is ever computed; GQA and the window as in `window_attention`,
  differentiated by its own backward. What torchtitan and OLMo-core run (`cu_doc_lens`).
* CUDA otherwise: FlexAttention with a document block mask (causal ∧ same document ∧ window), built
  once per batch and shared by every layer; blocks wholly across documents are skipped.
* CPU: blocks of query rows on torch's flash kernel (`window_attention.Tiles`), each over the keys
  from the earliest document start any of its rows has in any row of the batch (and no further
  back than the window), with the exact mask as an additive bias [B, 1, rows, keys]: the work
  follows the documents, not the row.
* Elsewhere: SDPA with the dense [B, 1, T, T] boolean mask, which is also what the tests compare
  with.

Every path gives each query at least its own key, so no row is empty.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from depthscale.model import attention_dispatch as dispatch
from depthscale.model import attention_tiles as tiles
from depthscale.model import window_attention as wa
from depthscale.model.documents import Documents


def visible(documents: Documents, q_pos: Tensor, k_pos: Tensor, window: int) -> Tensor:
    """bool [B, 1, Tq, Tk]: the key at row position k_pos is visible to the query at q_pos —
    causal, within `window` (0: any distance) and in the same document."""
    diff = q_pos[:, None] - k_pos[None, :]
    allowed = diff >= 0
    if window > 0:
        allowed &= diff < window
    return allowed & documents.same_document(q_pos, k_pos)


def path(q: Tensor) -> dispatch.DocumentPath:
    caps = dispatch.capabilities(q.device)
    return dispatch.document_path(q.device.type, q.dtype, q.shape[-1], caps)


def document_attention(
    q: Tensor, k: Tensor, v: Tensor, window: int, documents: Documents, block: int | None = None
) -> Tensor:
    """Causal attention of q [B, H, T, d] over k/v [B, Hkv, T, d] (row positions 0..T−1) within
    each document of `documents`; with `window` > 0 each query sees at most the `window` latest
    keys of its document. The result of SDPA with that dense mask. `block`: query rows per tile
    of the CPU path (default `window_attention.TILE_BLOCK`)."""
    B, _, T, _ = q.shape
    if tuple(documents.shape) != (B, T):
        raise ValueError(
            f"documents are for rows {tuple(documents.shape)}, attention got {B} rows of {T}"
        )
    kernel = path(q)
    if kernel == "cuda_varlen":
        return varlen(q, k, v, window, documents)
    if kernel == "flex":
        return flex(q, k, v, window, documents, compiled=not torch.compiler.is_compiling())
    if kernel == "cpu_tiles":
        return wa.Tiles.apply(q, k, v, blocks(documents, window, block or wa.TILE_BLOCK, q))
    return dense(q, k, v, window, documents)


def dense(q: Tensor, k: Tensor, v: Tensor, window: int, documents: Documents) -> Tensor:
    pos = torch.arange(q.shape[2], device=q.device)
    mask = visible(documents, pos, pos, window)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1]
    )


def blocks(documents: Documents, window: int, block: int, q: Tensor) -> list[wa.Block]:
    """The CPU path's blocks, planned on the host once per batch (cached on `documents`): rows
    [i0, i1) see keys from k0 = the earliest start of the documents their first row is in (rows
    after it start no earlier), or the window's reach if that is later."""
    T = q.shape[2]
    key = ("cpu_tiles", T, window, block, q.dtype, q.device)
    if key not in documents.cache:
        first_start = documents.host_starts[:, :T].min(0).values  # [T], over the batch
        out = []
        for i0 in range(0, T, block):
            i1 = min(i0 + block, T)
            k0 = int(first_start[i0])
            if window > 0:
                k0 = max(k0, i0 - window + 1)
            q_pos = torch.arange(i0, i1, device=q.device)
            k_pos = torch.arange(k0, i1, device=q.device)
            bias = tiles.additive_bias(visible(documents, q_pos, k_pos, window), q.dtype)
            out.append(wa.Block(i0, i1, k0, bias))
        documents.cache[key] = out
    return documents.cache[key]


def flex(
    q: Tensor, k: Tensor, v: Tensor, window: int, documents: Documents, compiled: bool = True
) -> Tensor:
    """FlexAttention over the batch's document block mask (see `window_attention.flex_window`
    for `compiled`)."""
    from torch.nn.attention.flex_attention import flex_attention

    fn = wa._compiled_flex() if compiled else flex_attention
    mask = block_mask(documents, window, q.shape[2], q.device)
    return fn(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def block_mask(documents: Documents, window: int, T: int, device: torch.device):
    """The batch's block mask, built once and shared by every layer (cached on `documents`)."""
    key = ("flex", T, window, device)
    if key not in documents.cache:
        from torch.nn.attention.flex_attention import create_block_mask

        ids = documents.ids

        def mask_mod(b, h, q_idx, kv_idx):
            keep = (q_idx >= kv_idx) & (ids[b, q_idx] == ids[b, kv_idx])
            if window > 0:
                keep &= q_idx - kv_idx < window
            return keep

        B = documents.shape[0]
        documents.cache[key] = create_block_mask(mask_mod, B, None, T, T, device=device)
    return documents.cache[key]


def varlen(q: Tensor, k: Tensor, v: Tensor, window: int, documents: Documents, op=None) -> Tensor:
    """FlashAttention-2 over every document as its own sequence: q/k/v laid out [B·T, heads, d]
    (rows end to end), `cum_seq` the documents' cumulative lengths (int32, planned on the host
    once per batch), the causal flag and, for a window, (window − 1, 0) as in
    `window_attention.flash_window`. `op`: the kernel (default `aten._flash_attention_forward`;
    a stand-in lets the packing be tested without a GPU)."""
    op = op or torch.ops.aten._flash_attention_forward
    B, H, T, d = q.shape
    cum, longest = cumulative_lengths(documents, q.device)
    left, right = (window - 1, 0) if window > 0 else (None, None)

    def packed(x: Tensor) -> Tensor:  # [B, h, T, d] → [B·T, h, d]
        return x.transpose(1, 2).reshape(B * T, x.shape[1], d)

    out = op(
        packed(q), packed(k), packed(v), cum, cum, longest, longest, 0.0, True, False,
        scale=d**-0.5, window_size_left=left, window_size_right=right,
    )[0]  # fmt: skip
    return out.view(B, T, H, d).transpose(1, 2)


def cumulative_lengths(documents: Documents, device: torch.device) -> tuple[Tensor, int]:
    """(cumulative document lengths [n + 1] int32 on `device`, the longest document): the
    variable-length kernels' `cu_seqlens` and `max_seqlen`, cached on `documents`."""
    key = ("varlen", device)
    if key not in documents.cache:
        lengths = torch.tensor(documents.lengths(), dtype=torch.int32)
        cum = torch.cat([lengths.new_zeros(1), lengths.cumsum(0, dtype=torch.int32)])
        documents.cache[key] = (cum.to(device, non_blocking=True), int(lengths.max()))
    return documents.cache[key]
