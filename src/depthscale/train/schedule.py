"""Learning-rate schedules as a pure function of the step, so resuming needs only the step count.

Every schedule starts with a linear warmup; then `cosine` decays to lr·min_lr_ratio at the last step,
`wsd` (warmup-stable-decay) holds lr and decays linearly to lr·min_lr_ratio over the last
`decay_fraction` of the steps, and `constant` holds lr.
"""

from __future__ import annotations

import math

import torch

from depthscale.config import OptimConfig

__all__ = ["lr_at", "set_lr"]


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """The learning rate of update number step+1 (step is 0-based) in a run of total_steps updates.

    Warmup: lr·(step+1)/warmup_steps for step < warmup_steps, so the first update is not at lr=0
    and step warmup_steps-1 reaches lr. Cosine runs from lr at step warmup_steps to the floor at step
    total_steps-1; WSD decays over its last D = round(decay_fraction·total_steps) steps (never
    starting inside warmup), the k-th of them at lr - k/D·(lr - floor), so the last step is at the
    floor. Steps past the end stay at the floor.
    """
    if total_steps <= 0:
        raise ValueError(f"lr_at: total_steps={total_steps} must be > 0")
    if step < 0:
        raise ValueError(f"lr_at: step={step} must be >= 0")
    lr, warmup = cfg.lr, cfg.warmup_steps
    if step < warmup:
        return lr * (step + 1) / warmup
    if cfg.schedule == "constant":
        return lr
    floor = lr * cfg.min_lr_ratio
    last = total_steps - 1
    if cfg.schedule == "cosine":
        span = last - warmup
        progress = 1.0 if span <= 0 else min(1.0, (step - warmup) / span)
        return floor + (lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if cfg.schedule == "wsd":
        decay_start = max(warmup, total_steps - max(1, round(cfg.decay_fraction * total_steps)))
        if step < decay_start:
            return lr
        decay_steps = max(1, total_steps - decay_start)
        progress = min(1.0, (step - decay_start + 1) / decay_steps)
        return lr - (lr - floor) * progress
    raise ValueError(
        f"optim.schedule={cfg.schedule!r} is not supported; allowed: 'cosine', 'wsd', 'constant'"
    )


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every param group's lr (called before each step with lr_at's value), times the group's
    `lr_scale` where it has one (Muon's AdamW groups, `optim.muon_adamw_lr`)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
