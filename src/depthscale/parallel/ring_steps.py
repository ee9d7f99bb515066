"""The compute of one ring step: the local queries against the K/V block held at that step, tile
by tile (`RingPlan.tiles`, cut by the backend's `TilePolicy`), each tile on a fused kernel
(`model/attention_tiles.py`).

Forward: each tile's (out, LSE) is merged into the running fp32 (out, LSE) of its rows by online
softmax (`merge`) — one merge per tile, so the policy that gives a step one tile (CUDA's whole
policy) gives it one merge. Backward: each tile's dQ adds into the fp32 dQ of its rows and its
dK/dV into the block's fp32 buffer, from the global output and LSE (nothing to merge).
"""

from __future__ import annotations

import torch
from torch import Tensor

from depthscale.model import attention_tiles
from depthscale.parallel.ring_documents import DocumentTile
from depthscale.parallel.ring_schedule import Index


def merge(out: Tensor, lse: Tensor, rows: Index, out_b: Tensor, lse_b: Tensor) -> None:
    """Online-softmax merge of a block result into the running (out, lse) rows, in place.

    out ← out − σ(lse_b − lse)·(out − out_b); lse ← log(e^lse + e^lse_b). Rows not yet seen have
    lse = −inf and out = 0, which this maps to exactly (out_b, lse_b)."""
    o, s = rows.take(out, 3), rows.take(lse, 3)
    weight = torch.sigmoid(lse_b - s).nan_to_num_(0.0)  # both −inf (packed documents): nothing
    o = o - weight.unsqueeze(-1) * (o - out_b)
    rows.put(out, o, 3)
    rows.put(lse, torch.logaddexp(s, lse_b), 3)


def forward_step(
    tiles: list[DocumentTile], held, qg, out, lse, scale: float, fresh: bool = False
) -> None:
    """Attend the local queries to the held block, tile by tile, merged into (out, lse).
    `fresh`: nothing is merged into (out, lse) yet (0 and −inf), so the first tile's result is
    copied in — what the merge would give, exactly, in one pass instead of four."""
    groups = qg.shape[1:3]
    for work in tiles:
        tile = work.tile
        kv = tile.cols.take(held, 3).to(qg.dtype)
        q = tile.rows.take(qg, 3).flatten(1, 2)
        out_t, lse_t = work.clear_empty(*attention_tiles.forward(q, kv[0], kv[1], work.mask, scale))
        out_t, lse_t = out_t.unflatten(1, groups), lse_t.unflatten(1, groups)
        if fresh:
            tile.rows.put(out, out_t, 3)
            tile.rows.put(lse, lse_t, 3)
            fresh = False
        else:
            merge(out, lse, tile.rows, out_t, lse_t)


def backward_step(tiles: list[DocumentTile], held, saved, dq, dkv, scale: float) -> None:
    """The held block's share of dQ (into `dq`) and of its own dK/dV (into `dkv`)."""
    qg, do, yg, lse = saved
    groups = qg.shape[1:3]
    for tile, mask, _ in tiles:
        kv, rows = tile.cols.take(held, 3).to(qg.dtype), tile.rows
        dq_t, dk_t, dv_t = attention_tiles.backward(
            rows.take(do, 3).flatten(1, 2),
            rows.take(qg, 3).flatten(1, 2),
            kv[0],
            kv[1],
            rows.take(yg, 3).flatten(1, 2),
            rows.take(lse, 3).flatten(1, 2),
            mask,
            scale,
        )
        rows.add(dq, dq_t.unflatten(1, groups).float(), 3)
        tile.grad_cols.add(dkv, torch.stack([dk_t, dv_t]).float(), 3)
