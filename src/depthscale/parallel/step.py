"""The parallel plan: everything dimension-specific a training step does, behind one object.

`parallelize()` returns it. The trainer asks it to run a step's forward and backward over the
micro-batches (`forward_backward`), to evaluate (`evaluate`), to finish and clip the gradients
(`reduce_gradients`, `clip_gradients`) and to count parameters — and never asks which dimensions
exist: adding one changes `parallel/`, not `train/`.

What each dimension contributes:

- dp: the rows of the global batch this rank trains on were chosen by the loader (`Layout.dp_rank`);
  FSDP2 / DDP reduce the gradients inside backward.
- cp: each sequence is cut into zigzag shards with their global positions (`SequenceShard`); the loss
  is a sum over this rank's tokens scaled by the token count of the whole cp group (`TokenLoss`), and
  gradients are averaged over cp by FSDP, which shards over dp_shard × cp.
- tp: the logits stay sharded over the vocabulary and the loss is vocabulary-parallel (`TokenLoss`);
  the replicated parameters' gradients (norms, AttnRes queries) are summed over tp.
- pp: a step runs as the pipeline schedule (`Pipeline`), the loss is computed on the last stage with
  the same `TokenLoss`; gradient norms are summed over the stages; tied embeddings are synced.

Loss reporting: `forward_backward` and `evaluate` return this rank's *share* of the global mean loss —
the mean over all ranks of the shares is the mean token loss of the global batch (ranks repeating a
value, tp or pp, repeat it the same number of times everywhere).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from depthscale.model.documents import DocumentPacking
from depthscale.model.transformer import Transformer
from depthscale.observe import spans
from depthscale.parallel.cp_balance import Balancing
from depthscale.parallel.data_parallel import average_replicated_grads, clip_grad_norm_
from depthscale.parallel.expert_load import ExpertLoad
from depthscale.parallel.expert_parallel import ExpertShards
from depthscale.parallel.loss import TokenLoss
from depthscale.parallel.mesh import ParallelDims, flat
from depthscale.parallel.pipeline.pipeline import Pipeline
from depthscale.parallel.sequence_layout import MicroBatch, SequenceShard
from depthscale.parallel.tensor_parallel import tp_sync_replicated_grads

ContextFactory = Callable[[], contextlib.AbstractContextManager]
Forward = Callable[..., Tensor]


def _null() -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


class ParallelPlan:
    """What a training step does on this rank, for the layout `dims` on `mesh` (None: one process).

    Built by `parallelize()`; `stages` are this rank's pipeline stages (empty without pp)."""

    def __init__(
        self,
        model: Transformer,
        mesh: DeviceMesh | None,
        dims: ParallelDims,
        stages: list,
        microbatches: int,
        dtype: torch.dtype,
        defer_reduce_scatter: bool = False,
        replicated: list[str] | None = None,
        tp_chunks: int = 1,
        experts: ExpertShards | None = None,
        balancing: Balancing | None = None,
    ) -> None:
        self.model, self.mesh, self.dims, self.stages = model, mesh, dims, stages
        self.tp_chunks = tp_chunks
        self.defer_reduce_scatter = defer_reduce_scatter
        """FSDP: reduce-scatter once per step instead of per micro-batch (`fsdp_defer_reduce_scatter`)."""
        self.replicated = replicated or []
        """Names of the parameters data parallelism left whole on every rank (the layers' AttnRes
        queries): their gradients are averaged over the data-parallel ranks in `reduce_gradients`."""
        self.microbatches = microbatches
        """Per training step on this rank (`Config.grad_accum_steps`): the pipeline schedule is
        built for this count, and evaluation batches are cut the same way."""
        self.dtype = dtype
        """What travels between pipeline stages under autocast (the receive buffers' dtype)."""
        self.sequence = SequenceShard()
        if dims.cp > 1:
            self.sequence = SequenceShard(mesh.get_local_rank("cp"), dims.cp, balancing=balancing)
        self.loss = TokenLoss(
            vocab_group=mesh["tp"].get_group() if dims.tp > 1 else None,
            sequence_group=mesh["cp"].get_group() if dims.cp > 1 else None,
        )
        self.experts = experts
        """Expert parallelism: which parameters are split over the ep groups, and how their
        gradients are reduced (None: experts, if any, are sharded like every other weight)."""
        groups = ()
        if mesh is not None:
            groups = (flat(mesh, "dp_cp").get_group(),) if dims.dp * dims.cp > 1 else ()
            groups += (mesh["pp"].get_group(),) if dims.pp > 1 else ()
            groups += (mesh["tp"].get_group(),) if dims.tp > 1 else ()  # sequence shards
        self.expert_load = ExpertLoad(model, model.cfg, groups, dims.dp)
        self.expert_load.set_aux_scale(1.0 / microbatches)
        self.pipeline = None
        if stages:
            self.pipeline = Pipeline(model.cfg, mesh, stages, microbatches)
            for stage in stages:
                stage.loss_fn = lambda logits, labels: self.loss(logits, labels)[0]

    # ------------------------------------------------------------------ forward and backward

    def forward_backward(
        self,
        forward: Forward,
        inputs: Tensor,
        labels: Tensor,
        autocast: ContextFactory = _null,
        around_forward: ContextFactory = _null,
    ) -> Tensor:
        """Forward and backward of this rank's rows of the batch in `self.microbatches` pieces,
        gradients accumulated; returns this rank's share of the mean loss (see the module doc).
        `forward` is the model or its compiled form; `around_forward` is entered around every
        micro-batch's forward (e.g. activation offloading)."""
        device, microbatches = self._device(), self.microbatches
        self.expert_load.reset()
        self.sequence.balancing.reset()  # the step's work only: not evaluation's, nor a retry's
        pieces = self._pieces(inputs, labels)
        if self.pipeline is not None:
            return self._pipeline_step(pieces, True, autocast, around_forward)
        total = torch.zeros((), device=device)
        for i, piece in enumerate(pieces):
            self._gradient_sync(last=i == microbatches - 1)
            with around_forward(), spans.span("forward", mb=i):
                loss, report = self._loss(forward, piece, autocast)
            with spans.span("backward", mb=i):
                (loss / microbatches).backward()
            total += report / microbatches
        return total

    def _gradient_sync(self, last: bool) -> None:
        """Gradient accumulation: reduce across data-parallel replicas only in the last
        micro-batch's backward — DDP's all-reduce and HSDP's cross-replica all-reduce run once per
        step, as with one micro-batch; FSDP's reduce-scatter runs per micro-batch (keeping
        gradients sharded) unless `defer_reduce_scatter`. Pipelines do this per stage."""
        dims, model = self.dims, self.model
        if self.mesh is None or self.microbatches == 1:
            return
        if dims.shard > 1:
            if self.defer_reduce_scatter:
                model.set_requires_gradient_sync(last)
            elif dims.dp_replicate > 1:
                model.set_requires_all_reduce(last)
        elif dims.dp_replicate > 1:
            model.set_requires_gradient_sync(last)

    @torch.no_grad()
    def evaluate(
        self,
        forward: Forward,
        inputs: Tensor,
        labels: Tensor,
        autocast: ContextFactory = _null,
    ) -> Tensor:
        """This rank's share of the mean loss of one evaluation batch (no gradients), run in
        `self.microbatches` pieces like a training step, so that evaluation never needs more
        activation memory than training (pieces of equal size: the mean of their means)."""
        pieces = self._pieces(inputs, labels)
        if self.pipeline is not None:
            return self._pipeline_step(pieces, False, autocast, None)
        reports = [self._loss(forward, piece, autocast)[1] for piece in pieces]
        return torch.stack(reports).mean()

    @torch.no_grad()
    def score_rows(
        self,
        forward: Forward,
        inputs: Tensor,
        labels: Tensor,
        autocast: ContextFactory = _null,
    ) -> Tensor:
        """Σ cross-entropy over each row's labelled tokens (the negative log-likelihood of what it
        scores), fp64 [rows], for this rank's rows, the same on the ranks that share them (tp, cp,
        pp). Run in `self.microbatches` pieces like `evaluate`; the rows' width must be a multiple
        of `sequence_multiple`."""
        pieces = self._pieces(inputs, labels)
        if self.pipeline is not None:
            with autocast():
                return self.pipeline.score(
                    pieces, self._hop(pieces), self.dtype, self.loss.row_sums
                )
        sums = []
        for piece in pieces:
            with autocast():
                logits = forward(piece.tokens, **piece.model_inputs())
            sums.append(self.loss.row_sums(logits, piece.labels))
        return torch.cat(sums)

    def pack_documents(self, packing: DocumentPacking | None) -> None:
        """Cut every row into its packed documents (`data.document_mask`): attention and RoPE
        positions stay within each, in every layout (see `model/documents.py`)."""
        self.sequence.packing = packing

    def _pieces(self, inputs: Tensor, labels: Tensor) -> list[MicroBatch]:
        """A batch in `self.microbatches` pieces as this rank's model takes them, on its device."""
        device = self._device()
        return [
            self.sequence(x, y, device)
            for x, y in zip(inputs.chunk(self.microbatches), labels.chunk(self.microbatches))
        ]

    @property
    def sequence_multiple(self) -> int:
        """What a sequence's length must be a multiple of in this layout: cp cuts it into 2·cp
        zigzag pieces, and each rank's share splits over tp (sequence parallelism) in
        `tp_chunks` overlap chunks."""
        shard = self.dims.tp * self.tp_chunks
        if self.dims.cp == 1:
            return shard
        return math.lcm(2 * self.dims.cp, self.dims.cp * shard)

    def _loss(
        self, forward: Forward, piece: MicroBatch, autocast: ContextFactory
    ) -> tuple[Tensor, Tensor]:
        with autocast():
            logits = forward(piece.tokens, **piece.model_inputs())
        return self.loss(logits, piece.labels)

    def _hop(self, pieces: list[MicroBatch]) -> tuple[int, int, int]:
        """The depth state between stages: micro-batch rows × this rank's tokens (a sequence
        shard under tp as well as cp) × model width."""
        rows, tokens = pieces[0].tokens.shape
        return rows, tokens // self.dims.tp, self.model.cfg.dim

    def _pipeline_step(self, pieces, train: bool, autocast, around_forward) -> Tensor:
        with autocast():
            return self.pipeline.step(
                pieces, self._hop(pieces), self.dtype, train=train, forward_context=around_forward
            )

    # ------------------------------------------------------------------ gradients

    def finish_step(self) -> dict[str, Tensor]:
        """After the optimizer step: the MoE layers' routing over the step's tokens, summed over
        the ranks, and the aux-loss-free bias update (`parallel/expert_load.py`); under cp, the
        max / mean attention work of the cp ranks over this rank's micro-batches
        (`cp/work_max_mean`, from the host: `cp_balance.py`)."""
        metrics = self.expert_load.finish_step(self._device())
        imbalance = self.sequence.balancing.take_imbalance() if self.dims.cp > 1 else None
        if imbalance is not None:
            metrics["cp/work_max_mean"] = imbalance
        return metrics

    def reduce_gradients(self) -> None:
        """What FSDP2 / DDP do not: once per optimizer step, after the last backward."""
        if self.experts is not None:
            self.experts.reduce_gradients(self.model)
        if self.replicated:
            params = dict(self.model.named_parameters())
            grads = [params[name] for name in self.replicated]
            average_replicated_grads(grads, flat(self.mesh, "dp_cp").get_group())
        if self.pipeline is not None:
            self.pipeline.sync_tied_grads(self.model)
        if self.dims.tp > 1:  # norms / AttnRes queries saw only this rank's tokens
            tp_sync_replicated_grads(self.model)

    def clip_gradients(self, max_norm: float) -> Tensor:
        """Scale the gradients so their global L2 norm is at most `max_norm` (<= 0: only measure);
        returns the norm before clipping, the same on every rank."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.mesh is None:
            if max_norm > 0:
                return nn.utils.clip_grad_norm_(params, max_norm)
            return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
        across, excludes = None, []
        if self.pipeline is not None:  # stages hold different parameters
            across, excludes = self.pipeline.group, self.pipeline.counted_elsewhere(self.model)
        return clip_grad_norm_(params, max_norm, across=across, norm_excludes=excludes)

    # ------------------------------------------------------------------ sizes

    def num_params(self) -> int:
        """The whole model's parameter count, whatever the layout: sharded (DTensor) parameters
        report their global shape; pipeline ranks hold disjoint parts."""
        if self.pipeline is None:
            return self.model.num_params()
        return self.pipeline.num_params(self.model, self._device())

    def _device(self) -> torch.device:
        return self.model.rope_cos.device
