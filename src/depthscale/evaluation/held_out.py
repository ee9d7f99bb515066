"""What `train.eval_every` runs: the held-out loss and the downstream tasks (`[[eval.tasks]]`),
both through the parallel plan, so every layout reports what one process would."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from depthscale.config import Config
from depthscale.data.eval_sets import bits_per_byte, bytes_per_token
from depthscale.data.loader import DataBundle
from depthscale.evaluation.downstream import DownstreamTasks
from depthscale.evaluation.multiple_choice import read_task
from depthscale.observe import spans
from depthscale.parallel.step import ContextFactory, ParallelPlan


class Evaluator:
    def __init__(
        self,
        cfg: Config,
        data: DataBundle,
        plan: ParallelPlan,
        world_size: int,
        dp_rank: int,
        dp_size: int,
        device: torch.device,
    ) -> None:
        self.cfg, self.plan = cfg, plan
        self.world_size, self.dp_rank, self.dp_size, self.device = (
            world_size,
            dp_rank,
            dp_size,
            device,
        )
        n = cfg.train.eval_batches
        self.held_out = {"val": data.val} if data.val is not None else {}
        self.held_out |= {f"val/{name}": b for name, b in data.eval_sets.items()}
        self.bytes_per_token = {
            k: bytes_per_token(b, n, data.tokenizer) for k, b in self.held_out.items()
        }
        tasks = [read_task(Path(t.path), t.label, t.limit) for t in cfg.eval.tasks]
        self.tasks = None
        if tasks:
            self.tasks = DownstreamTasks(
                tasks,
                data.tokenizer,
                cfg.model.max_seq_len,
                plan.sequence_multiple,
                rows_per_batch=cfg.micro_batch_size * cfg.grad_accum_steps,
                dp_rank=dp_rank,
                dp_size=dp_size,
            )

    @torch.no_grad()
    def run(
        self, model: torch.nn.Module, forward: Callable[..., Tensor], autocast: ContextFactory
    ) -> dict[str, dict[str, float]]:
        """{"val": {"loss": ..., "bpb": ...}, "val/<set>": {...}, "eval/<task>": {"acc": ...,
        "acc_norm": ...}} for what the run evaluates (the same on every rank)."""
        model.eval()
        try:
            out: dict[str, dict[str, float]] = {}
            for prefix, batches in self.held_out.items():
                loss = self._held_out_loss(batches, forward, autocast)
                if loss is not None:
                    bpb = bits_per_byte(loss, self.bytes_per_token[prefix])
                    out[prefix] = {"loss": loss, "bpb": bpb}
            if self.tasks is not None:
                with spans.span("eval_tasks"):
                    results = self.tasks.evaluate(
                        lambda x, y: self.plan.score_rows(forward, x, y, autocast),
                        self._sum_over_ranks,
                        holders=self.world_size // self.dp_size,
                        device=self.device,
                    )
                for r in results:
                    out[f"eval/{r['task']}"] = {"acc": r["acc"], "acc_norm": r["acc_norm"]}
            return out
        finally:
            model.train()

    def _held_out_loss(self, held_out, forward, autocast) -> float | None:
        batches = held_out.iter_eval(self.cfg.train.eval_batches, self.dp_rank, self.dp_size)
        losses = [
            self._mean_over_ranks(self.plan.evaluate(forward, x, y, autocast)) for x, y in batches
        ]
        return sum(losses) / len(losses) if losses else None

    def _sum_over_ranks(self, value: Tensor) -> Tensor:
        if self.world_size == 1:
            return value
        packed = value.detach().double().clone()
        with spans.collective("all_reduce", None, packed):
            dist.all_reduce(packed)
        return packed

    def _mean_over_ranks(self, value: Tensor) -> float:
        """The global mean of a per-rank share (off the hot path, read at once)."""
        return self._sum_over_ranks(value.reshape(1)).item() / self.world_size
