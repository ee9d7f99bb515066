"""Cutting a model into pipeline stages (chunks) and the depth-state shapes that cross each cut.

Every rank builds the full single-process model from the same seed, keeps the layers of its own
stages and drops the rest, so parameter names (and checkpoints) are the single-process ones. The
number of AttnRes blocks in the depth state at every cut follows from the block assignment alone,
so receivers know every message's shape in advance (no shape handshake).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from depthscale.config import ModelConfig
from depthscale.model.residual import DepthState, block_assignment, link_groups
from depthscale.model.transformer import Transformer, cross_entropy


def split_layers(n_layers: int, n_stages: int) -> list[range]:
    """Contiguous, balanced layer ranges; earlier stages take the remainder. With fewer layers than
    stages the trailing stages are empty and just pass the depth state on (the last adds the head)."""
    base, extra = divmod(n_layers, n_stages)
    bounds, start = [], 0
    for s in range(n_stages):
        size = base + (1 if s < extra else 0)
        bounds.append(range(start, start + size))
        start += size
    return bounds


def blocks_after(cfg: ModelConfig, n_layers_done: int) -> int:
    """Completed depth sources (b_0 and finished blocks) in the state after `n_layers_done` layers."""
    if cfg.residual == "standard":
        return 0
    per_layer = 1 if cfg.parallel_block else 2
    t = n_layers_done * per_layer  # sublayers done
    blocks = block_assignment(cfg)
    ends = sum(1 for i in range(t) if i == len(blocks) - 1 or blocks[i + 1] != blocks[i])
    return 1 + ends


def has_partial_after(cfg: ModelConfig, n_layers_done: int) -> bool:
    if cfg.residual == "standard":
        return True
    per_layer = 1 if cfg.parallel_block else 2
    t = n_layers_done * per_layer
    if t == 0:
        return False
    blocks = block_assignment(cfg)
    return not (t - 1 == len(blocks) - 1 or blocks[t] != blocks[t - 1])


@dataclass(frozen=True)
class StageSpec:
    stage: int
    n_stages: int
    layers: range

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.n_stages - 1


class PipelineStage(nn.Module):
    """One chunk: the embedding (first stage), a range of layers, the head and loss (last stage).
    Holds references to the rank's model modules, so parameters are shared, never copied."""

    def __init__(self, model: Transformer, spec: StageSpec) -> None:
        super().__init__()
        self.spec = spec
        self.cfg = model.cfg
        self._model = [
            model
        ]  # a list: not registered as a submodule (the model owns the parameters)
        self.layer_ids = [str(i) for i in spec.layers]
        link_groups([r for i in self.layer_ids for r in model.layers[i].residuals()])

    @property
    def model(self) -> Transformer:
        return self._model[0]

    def forward(self, inputs: Tensor | DepthState) -> DepthState:
        m = self.model
        state = m.embed(inputs) if self.spec.is_first else inputs
        cos, sin = m.rope(None, _seq_len(state))
        for i in self.layer_ids:
            state = m.layers[i](state, cos, sin)
        return state

    def loss(self, state: DepthState, labels: Tensor) -> Tensor:
        return cross_entropy(self.model.head(state), labels)


def _seq_len(state: DepthState) -> int:
    t = state.partial if state.partial is not None else state.blocks[0]
    return t.shape[1]


def build_stages(
    model: Transformer, pp_rank: int, pp_size: int, virtual: int
) -> list[PipelineStage]:
    """This rank's stages (rank r holds stages r, r+P, ...); drops the layers it does not run."""
    cfg = model.cfg
    n_stages = pp_size * virtual
    ranges = split_layers(cfg.n_layers, n_stages)
    specs = [StageSpec(s, n_stages, ranges[s]) for s in range(pp_rank, n_stages, pp_size)]
    keep = {str(i) for spec in specs for i in spec.layers}
    for name in [k for k in model.layers if k not in keep]:
        del model.layers[name]
    if not specs[0].is_first:
        model.tok_embeddings = None
    if not specs[-1].is_last:
        model.norm = model.output = model.output_residual = None
    return [PipelineStage(model, spec) for spec in specs]


def tied_embedding_ranks(cfg: ModelConfig, pp_size: int) -> tuple[int, int] | None:
    """Pipeline ranks holding a copy of a tied embedding/head weight (first and last stage), or None.

    With tied embeddings the first stage's rank keeps the embedding and the last stage's rank keeps
    the same weight as its head (equal at init: every rank built the same model). Summing their
    gradients over these two ranks after backward keeps the copies identical, Megatron-style."""
    if not cfg.tie_embeddings or pp_size == 1:
        return None
    return 0, pp_size - 1


def sync_tied_grads(model: Transformer, group) -> None:
    """All-reduce the tied embedding/head gradient between the first and last stage's ranks."""
    import torch.distributed as dist

    weight = (
        model.tok_embeddings.weight if model.tok_embeddings is not None else model.output.weight
    )
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    dist.all_reduce(weight.grad, group=group)
