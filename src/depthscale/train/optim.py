"""Optimizers: AdamW, or LAMB for large batches, with weight decay only where it belongs.

MegaScale trains with LAMB to grow the batch 4x without losing accuracy: its per-tensor trust ratio
rescales each update to the size of the weights it changes, which keeps large-lr steps stable.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from depthscale.config import OptimConfig

__all__ = ["LAMB", "NormFn", "build_optimizer", "param_groups"]

NormFn = Callable[[Tensor], Tensor]
"""Maps a tensor to the L2 norm of the *whole* logical tensor, as a 0-d tensor."""

NO_DECAY_NAMES = ("pseudo_query", "attnres")
"""Name fragments of parameters never decayed: AttnRes queries are zero-initialised directions,
and decaying them would pull every depth read back toward a uniform average."""


class LAMB(torch.optim.Optimizer):
    """LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning"), per parameter tensor:

        m = β1·m + (1-β1)·g,  v = β2·v + (1-β2)·g²          (fp32 state)
        u = m̂ / (sqrt(v̂) + eps) + wd·p                      (m̂, v̂ bias-corrected; decoupled decay)
        r = ‖p‖ / ‖u‖   (1 when either norm is 0), r = min(r, max_trust_ratio)
        p ← p - lr·r·u

    `max_trust_ratio` (default 10, as in NVIDIA's BERT LAMB) bounds the step of a tensor whose
    update is tiny relative to its weights (e.g. right after warmup on a large matrix), where an
    unbounded ratio would turn numerical noise into a large step; None disables the clamp.

    A group with `adaptive=False` skips the trust ratio (r = 1, a plain AdamW step). `build_optimizer`
    uses that for the no-decay group, as NVIDIA's LAMB (`use_nvlamb=False`) and timm
    (`always_adapt=False`) do: for a zero-initialised vector such as an AttnRes pseudo-query, r is
    1 on the first step and ≈ lr afterwards (‖p‖ ≈ lr·‖u‖), so the vector would stay frozen at ~0.

    `norm_fn` computes ‖p‖ and ‖u‖. It defaults to `torch.linalg.vector_norm`, right for whole
    tensors (and for DTensors, whose norm reduces over the mesh). Code that shards parameters as
    plain local tensors (FSDP/TP-style) must pass a norm that all-reduces the squared local norms
    over the shard group, because the trust ratio is defined on the full tensor, not on one shard.

    State (`step`, `exp_avg`, `exp_avg_sq`) is fp32 whatever the parameter dtype, and stays fp32
    across `load_state_dict` (the base class would cast it to the parameter's dtype).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        max_trust_ratio: float | None = 10.0,
        adaptive: bool = True,
        norm_fn: NormFn | None = None,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"LAMB: lr={lr} must be >= 0")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"LAMB: betas={betas} must be in [0, 1)")
        if eps < 0.0 or weight_decay < 0.0:
            raise ValueError(f"LAMB: eps={eps} and weight_decay={weight_decay} must be >= 0")
        if max_trust_ratio is not None and max_trust_ratio <= 0.0:
            raise ValueError(f"LAMB: max_trust_ratio={max_trust_ratio} must be > 0 (or None)")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "max_trust_ratio": max_trust_ratio,
            "adaptive": adaptive,
        }
        super().__init__(params, defaults)
        # Not a group option: a callable in param_groups would end up in every state_dict.
        self.norm_fn: NormFn = norm_fn or torch.linalg.vector_norm

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One LAMB update of every parameter that has a gradient; returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            max_trust, adaptive = group["max_trust_ratio"], group["adaptive"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("LAMB does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                step = float(state["step"])
                grad = p.grad.float()
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.lerp_(grad, 1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)

                m_hat = exp_avg / (1.0 - beta1**step)
                v_hat = exp_avg_sq / (1.0 - beta2**step)
                p32 = p.float()
                update = m_hat / (v_hat.sqrt() + eps)
                if wd != 0.0:
                    update.add_(p32, alpha=wd)
                if adaptive:
                    trust = self._trust_ratio(p32, update, max_trust)
                    p.copy_(p32 - (lr * trust) * update)
                else:
                    p.copy_(p32 - lr * update)
        return loss

    def _trust_ratio(self, p: Tensor, update: Tensor, max_trust: float | None) -> Tensor:
        """‖p‖/‖u‖ as a 0-d tensor (no host sync), 1 where either norm is 0, clamped above."""
        w_norm, u_norm = self.norm_fn(p), self.norm_fn(update)
        ok = (w_norm > 0) & (u_norm > 0)
        trust = torch.where(ok, w_norm / torch.where(ok, u_norm, 1.0), 1.0)
        return trust.clamp(max=max_trust) if max_trust is not None else trust

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load as the base class does, then put back the fp32 moments it cast to the param dtype."""
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        originals = {i: state_dict["state"].get(i, {}) for i in saved_ids}
        super().load_state_dict(state_dict)
        for saved_id, p in zip(saved_ids, params):
            for key in ("exp_avg", "exp_avg_sq"):
                value = originals[saved_id].get(key)
                if isinstance(value, Tensor):
                    self.state[p][key] = value.to(device=p.device, dtype=torch.float32, copy=True)
            if "step" in self.state[p]:
                self.state[p]["step"] = torch.as_tensor(self.state[p]["step"], dtype=torch.float32)


def _no_decay(name: str, p: Tensor) -> bool:
    """Vectors (norm gains, biases) and AttnRes parameters; matrices and embeddings decay."""
    return p.ndim < 2 or any(fragment in name for fragment in NO_DECAY_NAMES)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """[decay, no-decay] groups of the trainable parameters (a tied weight appears once)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if _no_decay(name, p) else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0, "adaptive": False},
    ]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW or LAMB over two groups: decay (ndim >= 2) and no-decay (vectors, AttnRes params).

    The group list depends only on the model's structure, so a resumed run rebuilds the same groups
    and the checkpointed optimizer state maps back one to one.
    """
    groups = param_groups(model, cfg.weight_decay)
    if not groups:
        raise ValueError("build_optimizer: the model has no trainable parameters")
    betas = (cfg.beta1, cfg.beta2)
    if cfg.name == "lamb":
        return LAMB(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.name == "adamw":
        for g in groups:
            g.pop("adaptive", None)
        return torch.optim.AdamW(
            groups,
            lr=cfg.lr,
            betas=betas,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            fused=_fused_adamw_applies(g["params"] for g in groups) or None,
        )
    raise ValueError(f"optim.name={cfg.name!r} is not supported; allowed: 'adamw', 'lamb'")


def _fused_adamw_applies(param_lists: Iterable[list[Tensor]]) -> bool:
    """torch's fused AdamW (one kernel over all tensors; on CPU ~4x faster than the per-tensor
    loop torch otherwise picks there): for plain floating-point parameters on CPU or CUDA. DTensor
    parameters (FSDP2, TP) keep torch's default (foreach on CUDA)."""
    params = [p for ps in param_lists for p in ps]
    return all(
        type(p) is nn.Parameter and p.device.type in ("cpu", "cuda") and p.is_floating_point()
        for p in params
    )
