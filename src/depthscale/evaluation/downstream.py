"""Downstream tasks during training (`[[eval.tasks]]`), scored in any parallel layout exactly as
`depthscale eval` scores them on one process.

Every rank encodes every task the same way (`multiple_choice.task_pairs`), so every rank knows
every row. The data-parallel ranks take the rows in turn, a batch of `rows_per_batch` (a training
step's rows per rank, so evaluation never needs more activation memory than a step) at a time,
padded to one width for the whole task, a multiple of what the layout needs; the layout's
`score_rows` returns each row's negative log-likelihood, the same on the ranks that share the rows
(tp, cp, pp). Each rank writes its sums into a vector of all the rows, zeros elsewhere; one summed
all-reduce over every rank, divided by how many ranks hold each row, gives every rank every row's
log-likelihood, from which `multiple_choice.tally` counts acc and acc_norm.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from depthscale.data.tokenizer import Tokenizer
from depthscale.evaluation.multiple_choice import (
    Task,
    padded_batch,
    scored_rows,
    tally,
    task_pairs,
)

ScoreRows = Callable[[Tensor, Tensor], Tensor]
"""(inputs, labels) [rows, width] → Σ cross-entropy of each row's labelled tokens, fp64 [rows]."""
SumOverRanks = Callable[[Tensor], Tensor]
"""A tensor summed over every rank of the job (the identity on one process)."""


@dataclass(frozen=True)
class _Encoded:
    task: Task
    rows: list[tuple[list[int], int]]
    width: int


class DownstreamTasks:
    """The run's tasks, encoded once; `evaluate` scores them all with the model as it is now."""

    def __init__(
        self,
        tasks: list[Task],
        tokenizer: Tokenizer,
        max_len: int,
        multiple: int,
        rows_per_batch: int,
        dp_rank: int = 0,
        dp_size: int = 1,
    ) -> None:
        """`max_len`: the model's context (model.max_seq_len); `multiple`: what the layout needs
        a row's width to be a multiple of. A row longer than the largest such width that fits
        `max_len` is cut from the left, keeping its scored tokens (one process: `max_len`)."""
        self.rows_per_batch, self.dp_rank, self.dp_size = rows_per_batch, dp_rank, dp_size
        limit = max(multiple, max_len // multiple * multiple)
        self.encoded = []
        for task in tasks:
            rows = scored_rows(task_pairs(tokenizer, task), limit)
            longest = max(len(ids) - 1 for ids, _ in rows)
            self.encoded.append(_Encoded(task, rows, -(-longest // multiple) * multiple))

    def evaluate(
        self, score_rows: ScoreRows, sum_over_ranks: SumOverRanks, holders: int, device
    ) -> list[dict[str, float | int | str]]:
        """acc / acc_norm of every task; `holders`: the ranks that score each row (every rank's
        count divided by the data-parallel degree), which the summed all-reduce divides out."""
        return [
            tally(e.task, self.loglikelihoods(i, score_rows, sum_over_ranks, holders, device))
            for i, e in enumerate(self.encoded)
        ]

    def loglikelihoods(
        self, index: int, score_rows: ScoreRows, sum_over_ranks: SumOverRanks, holders: int, device
    ) -> list[float]:
        """Every choice's log-likelihood of task `index`, question by question, on every rank."""
        e = self.encoded[index]
        n, per_batch = len(e.rows), self.rows_per_batch
        stride = per_batch * self.dp_size
        nll = torch.zeros(n, dtype=torch.float64, device=device)
        for start in range(0, n, stride):  # every rank runs the same number of batches
            first = start + self.dp_rank * per_batch
            mine = e.rows[first : first + per_batch]
            inputs, labels = padded_batch(mine, e.width)
            if len(mine) < per_batch:  # a last short batch: rows with nothing to score
                pad = per_batch - len(mine)
                inputs = torch.cat([inputs, inputs.new_zeros(pad, e.width)])
                labels = torch.cat([labels, labels.new_full((pad, e.width), -100)])
            sums = score_rows(inputs, labels)[: len(mine)]
            nll[first : first + len(mine)] = sums.to(device)
        return (-sum_over_ranks(nll) / holders).tolist()


__all__ = ["DownstreamTasks"]
