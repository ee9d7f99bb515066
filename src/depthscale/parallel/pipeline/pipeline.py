"""This rank's part of the pipeline: its stages, the runtimes that run a step over them, and the
groups a step's loss and tied-weight gradients travel on.

One runtime runs the training schedule (interleaved 1F1B); evaluation runs a forward-only schedule,
one runtime per micro-batch count (building one simulates its schedule, so they are kept).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from depthscale.config import ModelConfig
from depthscale.model.transformer import Transformer
from depthscale.observe import spans
from depthscale.parallel.pipeline.depth_cache import DepthCache
from depthscale.parallel.pipeline.runtime import PipelineRuntime
from depthscale.parallel.pipeline.schedules import forward_only, interleaved_1f1b
from depthscale.parallel.pipeline.stage import (
    PipelineStage,
    counted_elsewhere,
    sync_tied_grads,
    tied_embedding_group,
)
from depthscale.parallel.sequence_layout import MicroBatch


class Pipeline:
    def __init__(
        self, cfg: ModelConfig, mesh: DeviceMesh, stages: list[PipelineStage], microbatches: int
    ) -> None:
        """`microbatches`: per training step (a multiple of pp under interleaving, see
        `parallelize.check_layout`)."""
        self.stages = stages
        self.group = mesh["pp"].get_group()
        self.ranks, virtual = mesh.size(mesh.mesh_dim_names.index("pp")), len(stages)
        self.cache = DepthCache(cfg, list(stages[0].spec.split), self.ranks, enabled=True)
        self.train = PipelineRuntime(
            stages, interleaved_1f1b(self.ranks, virtual, microbatches), self.group, self.cache
        )
        self.tied_group = tied_embedding_group(cfg, mesh)
        self._evaluations: dict[int, PipelineRuntime] = {}

    def runtime(self, train: bool, microbatches: int) -> PipelineRuntime:
        if train:
            return self.train
        if microbatches not in self._evaluations:
            schedule = forward_only(self.ranks, len(self.stages), microbatches)
            self._evaluations[microbatches] = PipelineRuntime(
                self.stages, schedule, self.group, self.cache, name=f"eval/{microbatches}"
            )
        return self._evaluations[microbatches]

    def step(
        self,
        pieces: list[MicroBatch],
        hop_shape: tuple[int, int, int],
        dtype: torch.dtype,
        train: bool = True,
        forward_context: Callable[[], contextlib.AbstractContextManager] | None = None,
    ) -> Tensor:
        """Run one step's schedule over the micro-batches; returns, on every pipeline rank, the
        last stage's summed micro-batch losses / micro-batches (the stage's `loss_fn`: the mean loss,
        or this rank's share of it under cp), fp32, summed over the pipeline group."""
        runtime = self.runtime(train, len(pieces))
        runtime.forward_context = forward_context
        device = pieces[0].tokens.device
        loss, _ = runtime.step(*_unzip(pieces), hop_shape, dtype, device, **_where(pieces))
        # every rank of the group must reduce the same dtype (an fp64 model's loss is fp64)
        total = loss.float() if loss is not None else torch.zeros((), device=device)
        with spans.collective("all_reduce", self.group, total):
            dist.all_reduce(total, group=self.group)
        return total

    def score(
        self,
        pieces: list[MicroBatch],
        hop_shape: tuple[int, int, int],
        dtype: torch.dtype,
        row_sums: Callable[[Tensor, Tensor], Tensor],
    ) -> Tensor:
        """A forward-only pass whose last stage returns `row_sums(logits, labels)` per row instead
        of the mean loss: [micro-batches × rows] fp64 on every pipeline rank, in micro-batch
        order (each micro-batch's sums land in its own slice, found by its labels tensor)."""
        runtime = self.runtime(False, len(pieces))
        runtime.forward_context = None
        inputs, labels = _unzip(pieces)
        device, rows = inputs[0].device, inputs[0].shape[0]
        slot = {id(y): k for k, y in enumerate(labels)}

        def per_row(logits: Tensor, y: Tensor) -> Tensor:
            out = torch.zeros(len(labels) * rows, dtype=torch.float64, device=device)
            k = slot[id(y)]
            out[k * rows : (k + 1) * rows] = row_sums(logits, y)
            return out

        kept = [stage.loss_fn for stage in self.stages]
        for stage in self.stages:
            stage.loss_fn = per_row
        try:
            total, _ = runtime.step(inputs, labels, hop_shape, dtype, device, **_where(pieces))
        finally:
            for stage, loss_fn in zip(self.stages, kept):
                stage.loss_fn = loss_fn
        if total is None:  # not the last stage
            total = torch.zeros(len(labels) * rows, dtype=torch.float64, device=device)
        else:  # the runtime divides each micro-batch's loss by their count (fp64: exact enough)
            total = total * len(labels)
        with spans.collective("all_reduce", self.group, total):
            dist.all_reduce(total, group=self.group)
        return total

    def sync_tied_grads(self, model: Transformer) -> None:
        if self.tied_group is not None:
            sync_tied_grads(model, self.tied_group)

    def counted_elsewhere(self, model: Transformer) -> list[Tensor]:
        return counted_elsewhere(model, self.tied_group)

    def num_params(self, model: Transformer, device: torch.device) -> int:
        """The whole model's parameter count: stages hold disjoint parts (the tied head once)."""
        n = model.num_params() - sum(p.numel() for p in self.counted_elsewhere(model))
        total = torch.tensor(n, dtype=torch.int64, device=device)
        with spans.collective("all_reduce", self.group, total):
            dist.all_reduce(total, group=self.group)
        return int(total)


def _unzip(pieces: list[MicroBatch]) -> tuple[list[Tensor], list[Tensor]]:
    return [p.tokens for p in pieces], [p.labels for p in pieces]


def _where(pieces: list[MicroBatch]) -> dict:
    """The runtime's `positions` and `documents`, each micro-batch's own (chunks balanced over
    packed documents give each micro-batch its own layout; zigzag gives them all the same)."""
    positions = [p.positions for p in pieces]
    documents = [p.documents for p in pieces]
    return {
        "positions": None if all(q is None for q in positions) else positions,
        "documents": None if all(d is None for d in documents) else documents,
    }
