"""The residual stream as one object, the depth state, read and written by every sublayer.

A sublayer does `h, state = res.read(state)`, `y = f(norm(h))`, `state = res.write(state, y)`. Both
return a new state and leave their argument as it was: what a read hands on (the two-phase memo, the
aliases below) is in the state it returns, never a side effect.

- standard (PreNorm): the state is the hidden tensor; read returns it, write adds y.
- Block AttnRes: the state is the completed sources `blocks = [b_0 (embedding), b_1, ...]` plus the
  running partial sum of the current block. read is a softmax over depth (`depth_read`); the first
  sublayer of a block sees completed blocks only; the last sublayer of a block commits the partial sum
  as a new block.
- Full AttnRes is Block AttnRes with one sublayer per block: every output is its own source.

Reads come in three exact implementations (`model.attnres_read`): the plain-autograd reference, the
memory-efficient one, and the paper's two-phase computation, where the first sublayer of a block reads
the completed blocks once for all queries of the block (phase 1) and every sublayer merges that result
with the running partial sum (phase 2). Phase-1 results ride along in the returned state's `inter`,
and these reads hand the blocks and the partial sum on as aliases, so that each block's gradients are summed
inside the reads' backward (one pass) instead of in autograd's buffers (see `attnres_ops`).

Pipeline stages send and receive `DepthState`s (blocks and partial only); nothing inside attention or
the MLP knows which residual is in use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from depthscale import shape
from depthscale.config import ModelConfig
from depthscale.model.attnres_ops import (
    depth_read,
    depth_read_efficient,
    inter_block_read_chained,
    merge_partial_chained,
)


@dataclass
class DepthState:
    """blocks: completed depth sources (empty for the standard residual).
    partial: running sum of the current block (the hidden state for the standard residual);
    None right after a block was committed."""

    blocks: list[Tensor] = field(default_factory=list)
    partial: Tensor | None = None
    inter: InterBlock | None = None
    """Two-phase memo: phase-1 results for the remaining sublayers of the current block."""
    # The state a two-phase read returns holds aliases of `blocks` / `partial` (same values and
    # storage) that its backward accumulates gradients through (`attnres_ops.inter_block_read_chained`).

    @property
    def seq_len(self) -> int:
        """Tokens per sequence held in this state (a shard of the sequence under tp)."""
        return (self.partial if self.partial is not None else self.blocks[0]).shape[1]

    def sources(self) -> list[Tensor]:
        return self.blocks if self.partial is None else [*self.blocks, self.partial]


@dataclass
class InterBlock:
    members: list[AttnResidual]
    out: list[Tensor]  # S × [B, T, d] normalised phase-1 outputs, in the blocks' dtype
    lse: list[Tensor]  # S × [B, T] fp32

    def slot(self, member: AttnResidual) -> int | None:
        return next((i for i, m in enumerate(self.members) if m is member), None)


# FSDP2 hooks backward through the tensors inside a unit's inputs and outputs (DepthStates). torch
# >= 2.13 walks dataclasses itself; torch 2.11 sees only pytree nodes, and without these a block
# unit's parameters are not all-gathered again before its backward.
torch.export.register_dataclass(DepthState)
torch.export.register_dataclass(InterBlock)


def block_assignment(cfg: ModelConfig) -> list[int]:
    """Block index of every sublayer of the model `cfg` describes (the rule: `shape.block_assignment`)."""
    return shape.block_assignment(
        cfg.residual, cfg.n_sublayers, cfg.attnres_block_size, cfg.attnres_n_blocks
    )


class StandardResidual(nn.Module):
    """PreNorm residual: x_{l+1} = x_l + f(norm(x_l))."""

    def read(self, state: DepthState) -> tuple[Tensor, DepthState]:
        return state.partial, state

    def write(self, state: DepthState, y: Tensor) -> DepthState:
        return DepthState(state.blocks, state.partial + y)


ReadImpl = str  # "reference" | "efficient" | "two_phase"


class AttnResidual(nn.Module):
    """One sublayer's Attention Residual: a zero-initialised pseudo-query and a key RMSNorm gain."""

    def __init__(
        self,
        dim: int,
        ends_block: bool,
        key_norm_gain: bool,
        eps: float,
        read_impl: ReadImpl = "two_phase",
    ) -> None:
        super().__init__()
        self.ends_block = ends_block
        self.eps = eps
        self.read_impl = read_impl
        self.pseudo_query = nn.Parameter(torch.zeros(dim))
        self.key_norm = nn.Parameter(torch.ones(dim)) if key_norm_gain else None
        self.group: list[AttnResidual] = [self]
        """The sublayers of this block present in this module tree, in order (set by link_groups)."""

    def query(self) -> Tensor:
        return self.pseudo_query if self.key_norm is None else self.pseudo_query * self.key_norm

    def read(self, state: DepthState) -> tuple[Tensor, DepthState]:
        """This sublayer's input and the state to carry on (the argument is left as it was)."""
        if self.read_impl == "reference":
            return depth_read(state.sources(), self.pseudo_query, self.key_norm, self.eps), state
        if self.read_impl == "efficient":
            h = depth_read_efficient(state.sources(), self.pseudo_query, self.key_norm, self.eps)
            return h, state
        return self._two_phase_read(state)

    def _two_phase_read(self, state: DepthState) -> tuple[Tensor, DepthState]:
        blocks, partial, inter = state.blocks, state.partial, state.inter
        slot = inter.slot(self) if inter is not None else None
        if (
            slot is None
        ):  # first sublayer of the block here: phase 1 for it and the rest of the block
            members = self.group[next(i for i, m in enumerate(self.group) if m is self) :]
            queries = torch.stack([m.query() for m in members])
            out, lse, blocks = inter_block_read_chained(blocks, queries, self.eps)
            inter, slot = InterBlock(members, out, lse), 0
        if partial is None:
            return inter.out[slot], DepthState(blocks, None, inter)  # already in the blocks' dtype
        h, partial = merge_partial_chained(
            inter.out[slot], inter.lse[slot], partial, self.query(), self.eps
        )
        return h, DepthState(blocks, partial, inter)

    def write(self, state: DepthState, y: Tensor) -> DepthState:
        partial = y if state.partial is None else state.partial + y
        if self.ends_block:
            return DepthState([*state.blocks, partial], None)
        return DepthState(state.blocks, partial, state.inter)


def link_groups(residuals: list[nn.Module]) -> None:
    """Tell each AttnResidual which sublayers share its block (in this module tree), so phase 1
    can batch their queries. Call again after a pipeline stage drops layers."""
    group: list[AttnResidual] = []
    for res in residuals:
        if not isinstance(res, AttnResidual):
            continue
        group.append(res)
        res.group = group
        if res.ends_block:
            group = []


def make_residual(cfg: ModelConfig, sublayer: int) -> nn.Module:
    """The residual module of sublayer `sublayer` (0-based; attention and MLP each count one)."""
    if cfg.residual == "standard":
        return StandardResidual()
    blocks = block_assignment(cfg)
    ends_block = sublayer == len(blocks) - 1 or blocks[sublayer + 1] != blocks[sublayer]
    return AttnResidual(
        cfg.dim, ends_block, cfg.attnres_key_norm_gain, cfg.attnres_eps, cfg.attnres_read
    )


def initial_state(cfg: ModelConfig, embedding: Tensor) -> DepthState:
    """Standard: the embedding is the hidden state. AttnRes: it is the first source b_0, once."""
    if cfg.residual == "standard":
        return DepthState([], embedding)
    return DepthState([embedding], None)


def make_output_residual(cfg: ModelConfig) -> AttnResidual | None:
    """AttnRes aggregates all blocks with one more depth read (its own query) before the final norm."""
    if cfg.residual == "standard":
        return None
    return AttnResidual(
        cfg.dim,
        ends_block=False,
        key_norm_gain=cfg.attnres_key_norm_gain,
        eps=cfg.attnres_eps,
        read_impl=cfg.attnres_read,
    )
