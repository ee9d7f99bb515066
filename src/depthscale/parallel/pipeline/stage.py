"""Cutting a model into pipeline stages (chunks) and the depth-state shapes that cross each cut.

Every rank builds the full single-process model from the same seed, keeps the layers of its own
stages and drops the rest, so parameter names (and checkpoints) are the single-process ones. The
number of AttnRes blocks in the depth state at every cut follows from the block assignment alone,
so receivers know every message's shape in advance (no shape handshake).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from depthscale.config import ModelConfig
from depthscale.model.documents import Documents
from depthscale.model.residual import DepthState, block_assignment, link_groups
from depthscale.model.transformer import Transformer, cross_entropy
from depthscale.observe import spans
from depthscale.parallel.pipeline.schedules import split_layers
from depthscale.parallel.startup import own_group


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
    split: tuple[range, ...]
    """Every stage's layers (the depth cache plans hops with them)."""

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.n_stages - 1


class PipelineStage(nn.Module):
    """One chunk: the embedding (first stage), a range of layers, the head and loss (last stage).

    The modules it runs are registered as its children (the model owns them too: parameters are
    shared, never copied, and keep their single-process names in the model's state dict). That makes
    the stage a self-contained root for wrappers such as FSDP2, whose root hooks fire on
    `stage(...)`: the last stage computes head and loss inside `forward`, so everything a stage
    touches runs within one call."""

    def __init__(self, model: Transformer, spec: StageSpec) -> None:
        super().__init__()
        self.spec = spec
        self.cfg = model.cfg
        self._model = [model]  # a list: the stage calls the model's methods but does not own it
        self.register_modules()
        link_groups([r for layer in self.layers for r in layer.residuals()])
        self.loss_fn: Callable[[Tensor, Tensor], Tensor] = cross_entropy
        """logits, labels → the loss to backpropagate; the parallel plan sets the layout's."""
        self.keep_gathered = False
        """Set by the parallel plan when FSDP shards this stage and does not reshard after
        forward: its gathered parameters then stay for the whole step (the runtime reshards them
        at the stage's last backward), gathered once per step instead of per micro-batch."""

    def register_modules(self) -> None:
        """(Re-)register the model's modules this stage runs, as its children: again after a layout
        replaced some of them on the model (tensor parallelism swaps the embedding and the head),
        so that wrappers applied to the stage afterwards (FSDP2, DDP) own the new ones."""
        model, spec = self.model, self.spec
        self.layers = nn.ModuleList([model.layers[str(i)] for i in spec.layers])
        if spec.is_first:
            self.tok_embeddings = model.tok_embeddings
        if spec.is_last:
            self.output_residual = model.output_residual
            self.norm, self.output = model.norm, model.output

    @property
    def model(self) -> Transformer:
        return self._model[0]

    def forward(
        self,
        inputs: Tensor | DepthState,
        labels: Tensor | None = None,
        positions: Tensor | None = None,
        documents: Documents | None = None,
    ) -> Any:
        """tokens (first stage) or the received depth state → the depth state to send on; the last
        stage, given `labels`, returns the loss (`loss_fn`) instead. `positions`: the tokens'
        global positions (None: 0..T-1); `documents`: the rows' packed documents."""
        m = self.model
        state = m.embed(inputs) if self.spec.is_first else inputs
        cos, sin = m.rope_for(state, positions, documents)
        for layer in self.layers:
            state = layer(state, cos, sin, positions, None, 0, documents)
        if self.spec.is_last and labels is not None:
            return self.loss_fn(m.head(state), labels)
        return state


def build_stages(
    model: Transformer, pp_rank: int, pp_size: int, virtual: int, ends_fewer: int = 0
) -> list[PipelineStage]:
    """This rank's stages (rank r holds stages r, r+P, ...); drops the layers it does not run.
    `ends_fewer`: the first and last stage hold that many layers fewer (`split_layers`)."""
    cfg = model.cfg
    n_stages = pp_size * virtual
    ranges = split_layers(cfg.n_layers, n_stages, ends_fewer)
    specs = [
        StageSpec(s, n_stages, ranges[s], tuple(ranges)) for s in range(pp_rank, n_stages, pp_size)
    ]
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


def tied_embedding_group(cfg: ModelConfig, mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The group joining this rank's copy of the tied weight with its twin on the other end of its
    pipeline (same coordinates in every other mesh dim), or None where the rank holds no copy.
    Built among the pairs only (`startup.own_group`: no group creation the whole world enters)."""
    pp_dim = mesh.mesh_dim_names.index("pp")
    pp = mesh.size(pp_dim)
    tied = tied_embedding_ranks(cfg, pp)
    if tied is None:
        return None
    pipelines = mesh.mesh.movedim(pp_dim, -1).reshape(-1, pp).tolist()
    return own_group([[pipeline[r] for r in tied] for pipeline in pipelines], "tied_embedding")


def sync_tied_grads(model: Transformer, group) -> None:
    """All-reduce the tied embedding/head gradient between the first and last stage's ranks."""
    weight = tied_weight(model)
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    grad = weight.grad
    # under data parallelism a shard: both ranks hold the same dp coordinates, so the same slice
    local = grad.to_local() if isinstance(grad, DTensor) else grad
    with spans.collective("all_reduce", group, local):
        dist.all_reduce(local, group=group)


def counted_elsewhere(model: Transformer, tied_group: dist.ProcessGroup | None) -> list[Tensor]:
    """Parameters of this rank that another pipeline rank also holds and counts (norms, parameter
    totals): the last stage's copy of a tied embedding/head weight."""
    if tied_group is None or model.tok_embeddings is not None:
        return []
    return [tied_weight(model)]


def tied_weight(model: Transformer) -> Tensor:
    """This rank's copy of the tied embedding/head weight."""
    return model.tok_embeddings.weight if model.tok_embeddings is not None else model.output.weight
