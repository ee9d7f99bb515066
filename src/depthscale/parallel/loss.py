"""The token loss of every layout: mean cross-entropy over the non-ignored tokens of the global batch,
from logits that may be sharded along the vocabulary (tensor parallelism) and along the sequence
(context parallelism).

Vocabulary-parallel cross-entropy (Megatron): under tp the LM head is column-parallel, so each rank
holds logits [N, V/tp] for its slice of the vocabulary and never the full [N, V]. The loss of token i
is log Σ_v exp(z_iv) − z_i,y, and only per-token scalars cross ranks: the row maximum (for a stable
exp), then the sum of exponentials and the target logit (whichever rank holds the target's column),
in one summed all-reduce — 2 small all-reduces of N floats instead of gathering N·V logits. Backward
needs no communication: ∂ℓ_i/∂z_iv = softmax_iv − [v = y_i] on the rank holding column v.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import Function
from torch.distributed import ProcessGroup

from depthscale.model.transformer import cross_entropy
from depthscale.observe import spans
from depthscale.parallel.tp_comm import record_collective

IGNORE_INDEX = -100


class _VocabParallelCrossEntropy(Function):
    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, group: ProcessGroup) -> Tensor:
        z = logits.to(torch.promote_types(logits.dtype, torch.float32))
        local_v = z.shape[-1]
        start = dist.get_rank(group) * local_v
        row_max = z.max(dim=-1).values
        with spans.collective("all_reduce", group, row_max):
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        record_collective("all_reduce")
        z = z - row_max.unsqueeze(-1)
        local = labels - start
        mine = (local >= 0) & (local < local_v)  # ignored labels (-100) are never in range
        target = torch.where(
            mine, z.gather(-1, local.clamp(0, local_v - 1).unsqueeze(-1)).squeeze(-1), 0.0
        )
        exp = z.exp_()
        sums = torch.stack([exp.sum(dim=-1), target])
        with spans.collective("all_reduce", group, sums):
            dist.all_reduce(sums, group=group)
        record_collective("all_reduce")
        sum_exp, target = sums.unbind(0)
        loss = torch.where(labels != IGNORE_INDEX, sum_exp.log() - target, 0.0)
        exp.div_(sum_exp.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(exp, local, mine, labels != IGNORE_INDEX)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        softmax, local, mine, real = ctx.saved_tensors
        grad = softmax.clone()
        rows = mine.nonzero().squeeze(-1)
        grad[rows, local[rows]] -= 1.0
        grad.mul_((grad_loss * real).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None


def vocab_parallel_cross_entropy(logits: Tensor, labels: Tensor, group: ProcessGroup) -> Tensor:
    """Per-token cross-entropy [N] (0 where the label is ignored) from this rank's vocabulary slice
    of the logits, [N, V/tp] (rank r holds columns r·V/tp … (r+1)·V/tp − 1), with labels [N] in the
    full vocabulary; the same values on every rank of `group`. At least fp32 whatever the logits'
    dtype."""
    return _VocabParallelCrossEntropy.apply(logits, labels, group)


class TokenLoss:
    """Mean cross-entropy over the non-ignored tokens, for the logits of this rank's tokens.

    `vocab_group`: the logits are this rank's vocabulary slice (tensor parallelism).
    `sequence_group`: the tokens are this rank's slice of every sequence (context parallelism).

    Returns (loss to backpropagate, this rank's share of the reported loss). Without a sequence group
    both are the local mean. With one: the global loss is the mean over every non-ignored token of
    the group, L = Σ_r S_r / Σ_r n_r (S_r, n_r: rank r's loss sum and token count; a plain average of
    per-rank means is wrong once padding or masks make counts differ). The backward loss is
    S_r · cp / N, so that *averaging* gradients over the group (FSDP over dp_shard × cp) gives exactly
    ∇L, and a rank whose tokens are all ignored contributes 0, not NaN. One small all-reduce
    (count and loss sum, fp64)."""

    def __init__(
        self, vocab_group: ProcessGroup | None = None, sequence_group: ProcessGroup | None = None
    ) -> None:
        self.vocab_group, self.sequence_group = vocab_group, sequence_group

    def __call__(self, logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        if self.vocab_group is None and self.sequence_group is None:
            loss = cross_entropy(logits, labels)
            return loss, loss.detach()
        flat_labels = labels.flatten()
        loss_sum = self._per_token(logits, labels).sum()
        count = (flat_labels != IGNORE_INDEX).sum()
        if self.sequence_group is None:
            loss = loss_sum / count.clamp(min=1)
            return loss, loss.detach()
        totals = torch.stack([count.double(), loss_sum.detach().double()])
        with spans.collective("all_reduce", self.sequence_group, totals):
            dist.all_reduce(totals, group=self.sequence_group)
        n_total = totals[0].clamp(min=1)
        cp = dist.get_world_size(self.sequence_group)
        return loss_sum * (cp / n_total).to(loss_sum.dtype), (totals[1] / n_total).float()

    def _per_token(self, logits: Tensor, labels: Tensor) -> Tensor:
        """Each token's cross-entropy [N] (0 where ignored), at least fp32, from logits that may
        be this rank's vocabulary slice."""
        flat_logits, flat_labels = logits.flatten(0, -2), labels.flatten()
        if self.vocab_group is not None:
            return vocab_parallel_cross_entropy(flat_logits, flat_labels, self.vocab_group)
        upcast = flat_logits.to(torch.promote_types(flat_logits.dtype, torch.float32))
        return F.cross_entropy(upcast, flat_labels, ignore_index=IGNORE_INDEX, reduction="none")

    def row_sums(self, logits: Tensor, labels: Tensor) -> Tensor:
        """Σ cross-entropy over each row's non-ignored tokens, fp64 [rows], for scoring (the
        negative log-likelihood of a row's labelled continuation): the same on every rank of the
        vocabulary and sequence groups (a sequence shard's sums are added over the group)."""
        sums = self._per_token(logits, labels).double().view(labels.shape[0], -1).sum(dim=1)
        if self.sequence_group is not None:
            with spans.collective("all_reduce", self.sequence_group, sums):
                dist.all_reduce(sums, group=self.sequence_group)
        return sums
