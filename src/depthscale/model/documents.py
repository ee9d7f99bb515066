"""Packed documents (`data.document_mask`): which tokens of a training row belong together, so
attention never crosses a document boundary and RoPE positions restart in every document.

A row is a window of the token stream, in which every document ends with EOS. Here a document
*starts* at each EOS: the EOS that ends one document is the first token of the next, the role BOS
plays at inference (the stream has one token for both, and `depthscale generate`, `depthscale eval`
and the Hugging Face export all put it before a document's first text token). So a document's last
token predicts EOS from its own document, and the EOS predicts the next document's first token from
itself alone: with the mask on, no prediction reads across a boundary, and none is lost.
(Megatron's `--reset-attention-mask` counts the EOS with the document it ends instead, so the
prediction it makes reads the wrong document, which `--eod-mask-loss` then drops.)
`mask_eos_target` drops the loss on EOS targets, for corpora whose document ends are cuts, not
ends: the model is then never taught to stop.

Everything is computed on the host from the row's tokens before the step (no device sync), for the
full row, before any context-parallel shard: a rank holding a shard looks up its tokens by their
global positions. The depth reads of Attention Residuals are per token (a softmax over earlier
sublayer outputs at the same position), so they need nothing from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

IGNORE_INDEX = -100
"""The label the loss skips (`cross_entropy`'s ignore_index)."""


@dataclass(frozen=True, eq=False)
class Documents:
    """The documents of a batch of rows [B, T] (the full rows, under context parallelism too).

    `ids`: each token's document number within its row (0 for the first, +1 at every EOS after
    position 0), non-decreasing along the row; `starts`: the row position its document starts at.
    Both on the compute device, and again on the host (`host_ids`, `host_starts`) for planning."""

    ids: Tensor
    starts: Tensor
    host_ids: Tensor
    host_starts: Tensor
    cache: dict = field(default_factory=dict, repr=False)
    """What attention derives once per batch and reuses in every layer (block masks, kernel
    plans), keyed by its user."""

    @classmethod
    def of(cls, tokens: Tensor, eos_id: int, device: torch.device | str | None = None) -> Documents:
        """The documents of `tokens` [B, T]: one starts at position 0 and at every EOS."""
        t = tokens.detach().cpu()
        starts_here = t == eos_id
        starts_here[:, 0] = True
        ids = starts_here.cumsum(1) - 1
        index = torch.arange(t.shape[1]).expand_as(t)
        starts = torch.where(starts_here, index, 0).cummax(1).values
        device = tokens.device if device is None else device
        return cls(ids.to(device), starts.to(device), ids, starts)

    @property
    def shape(self) -> torch.Size:
        return self.host_ids.shape

    def rope_positions(self, positions: Tensor | None, seq_len: int) -> Tensor:
        """[B, T_local] positions within each token's document, for the tokens at the row
        positions `positions` [T_local] (None: the whole row, 0..seq_len−1)."""
        if positions is None:
            positions = torch.arange(seq_len, device=self.starts.device)
            return positions - self.starts[:, :seq_len]
        return positions - self.starts[:, positions]

    def same_document(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """bool [B, 1, Tq, Tk]: query and key (row positions) in the same document."""
        return self.ids[:, q_pos][:, None, :, None] == self.ids[:, k_pos][:, None, None, :]

    def lengths(self) -> list[int]:
        """Every document's length, row after row (the row order the varlen kernels pack)."""
        counts = []
        for row in self.host_ids:
            counts += torch.bincount(row).tolist()
        return counts


@dataclass(frozen=True)
class DocumentPacking:
    """How rows are cut into documents: at each `eos_id` (see the module doc)."""

    eos_id: int
    mask_eos_target: bool = False

    def labels(self, labels: Tensor) -> Tensor:
        """The labels the loss sees: EOS targets ignored under `mask_eos_target`."""
        if not self.mask_eos_target:
            return labels
        return labels.masked_fill(labels == self.eos_id, IGNORE_INDEX)

    def documents(
        self, tokens: Tensor, device: torch.device | str | None = None
    ) -> Documents | None:
        """The rows' documents; None when no row holds a boundary (every row one document, or
        part of one): the rows then compute exactly as unmasked ones, on the unmasked kernels."""
        documents = Documents.of(tokens, self.eos_id, device)
        return documents if bool(documents.host_ids[:, -1].any()) else None
