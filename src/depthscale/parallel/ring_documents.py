"""Packed documents on the ring (`data.document_mask` under context parallelism).

The ring plan (`ring_schedule.py`) says which keys each query may see by position — causal, window,
padding — once per shape for the whole run. Packed documents narrow that per batch: a key is seen
only from its own document. Every rank holds the documents of the *full* rows (`Documents`), so
nothing more travels: a tile's mask is looked up by its rows' and keys' global positions.

Per (plan, step) and batch, planned once on the host and shared by every layer and by backward:

* a tile whose every key lies in an earlier document than every one of its rows, in every row of
  the batch, is skipped;
* a tile whose rows and keys lie in one document (in each row of the batch) keeps the plan's mask;
* any other tile's mask is the plan's ∧ same document, [B, 1, rows, keys]. A row that sees none of
  the tile's keys (in some row of the batch) gets output 0 and LSE −inf from it, which the ring's
  merge leaves out; the kernels are not asked what an empty row gives (torch's CPU flash kernel
  returns an LSE of 0).

Such a bias has one entry per (row, key) of the tile, so a step the plan took whole (CUDA's policy:
every key in one call) is cut into its bounded tiles (at most `kv_tile` keys) when one of its
tiles would need it; a step whose tiles each lie in one document (or are skipped) stays whole.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from depthscale.model.attention_tiles import TileMask, additive_bias, fused
from depthscale.model.documents import Documents
from depthscale.parallel.ring_schedule import RingPlan, Tile


class DocumentTile(NamedTuple):
    """A tile of the plan with the mask it runs under for this batch."""

    tile: Tile
    mask: TileMask
    empty: Tensor | None
    """bool [B, 1, rows] on the device: rows that see none of the tile's keys (None: none)."""

    def clear_empty(self, out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
        """The tile's output [B, H, rows, d] and LSE [B, H, rows] with empty rows at 0 and −inf."""
        if self.empty is None:
            return out, lse
        return out.masked_fill(self.empty[..., None], 0.0), lse.masked_fill(
            self.empty, float("-inf")
        )


def step_tiles(plan: RingPlan, step: int, documents: Documents | None) -> list[DocumentTile]:
    """The work at `step` under this batch's documents (None: the plan's tiles as they are)."""
    if documents is None:
        return [DocumentTile(t, plan.tile_mask(t), None) for t in plan.tiles(step)]
    key = ("ring", id(plan), step)
    hit = documents.cache.get(key)
    if hit is None or hit[0] is not plan:  # the plan is kept with its entry: its id stays unique
        whole = plan.policy.whole
        tiles = [_tile(plan, t, documents, biased=not whole) for t in plan.tiles(step)]
        if any(t is _BIASED for t in tiles):  # a whole step that needs a bias: bounded tiles
            tiles = [_tile(plan, t, documents) for t in plan.tiles(step, bounded=True)]
        hit = (plan, [t for t in tiles if t is not None])
        documents.cache[key] = hit
    return hit[1]


_BIASED = object()
"""What `_tile` gives, with biased=False, for a tile that needs a per-batch bias."""


def _tile(
    plan: RingPlan, tile: Tile, documents: Documents, biased: bool = True
) -> DocumentTile | None | object:
    """The tile under the batch's documents: None if skipped, `_BIASED` if it needs a bias and
    `biased` is False."""
    ids = documents.host_ids
    q_doc, k_doc = ids[:, tile.host_q_pos], ids[:, tile.host_k_pos]  # [B, rows], [B, keys]
    if bool((k_doc.amax(1) < q_doc.amin(1)).all()):
        return None  # every key in an earlier document than every row
    first = torch.minimum(q_doc.amin(1), k_doc.amin(1))
    last = torch.maximum(q_doc.amax(1), k_doc.amax(1))
    if bool((first == last).all()):
        return DocumentTile(tile, plan.tile_mask(tile), None)
    if not biased:
        return _BIASED
    seen = (q_doc[:, :, None] == k_doc[:, None, :]).unsqueeze(1)  # [B, 1, rows, keys]
    by_position = plan.mask(tile, host=True)
    if by_position is not None:
        seen &= by_position
    empty = ~seen.any(-1)
    empty_rows = empty.to(plan.device) if bool(empty.any()) else None
    seen = seen.to(plan.device)
    if fused(plan.device):
        return DocumentTile(tile, TileMask(False, additive_bias(seen), None), empty_rows)
    return DocumentTile(tile, TileMask(False, None, seen), empty_rows)
