"""What a step's routing did, summed over every rank that trained tokens, and the aux-loss-free
balancing that follows from it (`model/moe.py`).

After each optimizer step (`ParallelPlan.finish_step`) every MoE layer hands over the slots it
routed to each expert during the step's training forwards (and the auxiliary loss it added). They
are summed over the data-parallel and sequence-parallel ranks (different tokens) and the pipeline
stages (each layer lives on one; the others add zeros), so every rank sees the whole batch's load, moves the
balancing bias by the same amount, and logs the same numbers:

    moe/layer{i}/load_cv   coefficient of variation of the experts' loads (0 = balanced)
    moe/layer{i}/load_max  the busiest expert's load over the mean load (1 = balanced)
    moe/layer{i}/load_min  the idlest expert's load over the mean load
    moe/aux_loss           the auxiliary loss in the step's loss (balance + z-loss, all layers)
    moe/load_cv            the mean of the layers' load_cv
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from depthscale.config import ModelConfig
from depthscale.model.moe import MoE, update_bias
from depthscale.observe import spans
from depthscale.shape import ModelShape


class ExpertLoad:
    """The MoE layers of this rank's model (none: a no-op) and the groups that sum their loads
    (none: one process). `holders`: how many ranks each train a share of the batch's tokens
    (the data-parallel degree): each one's auxiliary loss is its micro-batches', and the step's
    is their mean — except with `moe_balance_scope = "global_batch"`, where every rank's is
    already its share of the one loss of all of them (`apply_balance_scope`), summed here."""

    def __init__(
        self, model: nn.Module, cfg: ModelConfig, groups: tuple = (), holders: int = 1
    ) -> None:
        facts = ModelShape.from_config(cfg)
        self.ids = list(facts.moe_layers)
        self.layers = {
            int(name): layer.feed_forward
            for name, layer in model.layers.items()
            if isinstance(layer.feed_forward, MoE)
        }
        self.groups = groups
        self.holders = 1 if cfg.moe_balance_scope == "global_batch" else holders
        self.experts, self.balance, self.rate = facts.n_experts, cfg.moe_balance, cfg.moe_bias_rate

    def set_aux_scale(self, scale: float) -> None:
        """d(loss)/d(aux) of every layer: what the step's loss is scaled by (1 / micro-batches)."""
        for layer in self.layers.values():
            layer.aux_scale = scale

    def reset(self) -> None:
        """Forget what was counted (a step tried again counts once)."""
        for layer in self.layers.values():
            layer.take_load()

    def finish_step(self, device: torch.device) -> dict[str, Tensor]:
        """Sum the step's loads over the ranks (`groups`), update the balancing biases, return the
        metrics (device scalars, read when the step is logged)."""
        if not self.ids:
            return {}
        loads = torch.zeros(len(self.ids), self.experts + 1, device=device)
        for k, i in enumerate(self.ids):
            if i in self.layers:
                loads[k] = self.layers[i].take_load().to(device)
        for group in self.groups:
            with spans.collective("all_reduce", group, loads):
                dist.all_reduce(loads, group=group)
        slots, aux = loads[:, :-1], loads[:, -1]
        if self.balance == "bias":
            for k, i in enumerate(self.ids):
                if i in self.layers:
                    update_bias(self.layers[i].router, slots[k], self.rate)
        mean = slots.mean(1).clamp(min=1e-9)
        cv = slots.std(1, correction=0) / mean
        metrics = {"moe/aux_loss": aux.sum() / self.holders, "moe/load_cv": cv.mean()}
        for k, i in enumerate(self.ids):
            metrics[f"moe/layer{i}/load_cv"] = cv[k]
            metrics[f"moe/layer{i}/load_max"] = slots[k].max() / mean[k]
            metrics[f"moe/layer{i}/load_min"] = slots[k].min() / mean[k]
        return metrics
