"""The largest attention logit of each head, for QK-clip (`train/qk_clip.py`, Kimi K2's MuonClip).

The fused attention kernels never materialise the logits, so this recomputes them from the
forward's own q and k (after RoPE), under no_grad, in blocks of query rows: per head the maximum
of q·k/√head_dim over the (query, key) pairs the attention's mask allows — causal, the sliding
window, packed documents. Cost per layer and micro-batch: one more QKᵀ in fp32, over the causal
part of each block (about half of the forward's QKᵀ + AV FLOPs, at fp32 speed), and a block of
scores of at most `BLOCK_BYTES`; nothing is kept for the backward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from depthscale.model.documents import Documents

BLOCK_ROWS = 128
"""Query rows per block: causal blocks skip the keys after their last row (≈ half the pairs)."""
NEG = float("-inf")
BLOCK_BYTES = 1 << 26
"""At most this many bytes of fp32 scores per block (64 MiB): bounds the extra memory per layer."""


@torch.no_grad()
def max_logits(
    q: Tensor,
    k: Tensor,
    window: int = 0,
    documents: Documents | None = None,
    block_bytes: int = BLOCK_BYTES,
) -> Tensor:
    """fp32 [H]: per query head, max over the batch and the allowed pairs of q·k/√hd, for
    q [B, H, T, hd] and k [B, Hkv, T, hd] of the whole rows (positions 0..T-1; a grouped head h
    reads kv head h // (H/Hkv), as SDPA's GQA). Causal rows always allow the diagonal, so no head
    is left at -inf."""
    B, H, T, hd = q.shape
    kv, g = k.shape[1], H // k.shape[1]
    qs = q.float().reshape(B, kv, g, T, hd) * hd**-0.5
    kf = k.float()
    rows = max(1, min(BLOCK_ROWS, block_bytes // (4 * B * H * T)))
    pos = torch.arange(T, device=q.device)
    best = torch.full((H,), float("-inf"), device=q.device)
    for start in range(0, T, rows):
        end = min(start + rows, T)
        first = max(0, start - window + 1) if window > 0 else 0  # earlier keys: out of every window
        c, n = end - start, end - first
        block = qs[:, :, :, start:end].reshape(B, kv, g * c, hd)
        scores = (block @ kf[:, :, first:end].mT).view(B, kv, g, c, n)
        if window == 0 and documents is None:  # every key before the block is allowed
            diagonal = scores[..., start - first :]
            diagonal.masked_fill_(torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1), NEG)
        else:
            diff = pos[start:end, None] - pos[None, first:end]
            allowed = (diff >= 0) & (diff < window) if window > 0 else diff >= 0
            if documents is not None:
                ids = documents.ids
                same = ids[:, start:end, None] == ids[:, None, first:end]
                allowed = allowed & same[:, None, None]
            scores.masked_fill_(~allowed, NEG)
        best = torch.maximum(best, scores.amax(dim=(3, 4)).amax(0).reshape(H))
    return best
