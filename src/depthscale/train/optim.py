"""Optimizers: AdamW, LAMB for large batches (`train/lamb.py`) or Muon (`train/muon.py`), with weight
decay only where it belongs — the builder and its parameter groups."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication

from depthscale.config import OptimConfig
from depthscale.shape.muon import is_muon_matrix
from depthscale.train.lamb import LAMB, NormFn
from depthscale.train.muon import Muon
from depthscale.train.qk_clip import QKClip

__all__ = ["LAMB", "NormFn", "build_optimizer", "muon_groups", "param_groups"]

NO_DECAY_NAMES = ("pseudo_query", "attnres")
"""Name fragments of parameters never decayed: AttnRes queries are zero-initialised directions,
and decaying them would pull every depth read back toward a uniform average."""


def _no_decay(name: str, p: Tensor) -> bool:
    """Vectors (norm gains, biases) and AttnRes parameters; matrices decay."""
    return p.ndim < 2 or any(fragment in name for fragment in NO_DECAY_NAMES)


def _is_embedding(model: nn.Module, name: str) -> bool:
    """The token embedding, and a pipeline last stage's copy of it (`output.weight` when tied, see
    `Transformer._init_key`). Matched by whole name components, so a wrapper's prefix is allowed."""
    if _named(name, "tok_embeddings.weight"):
        return True
    cfg = getattr(model, "cfg", None)
    return bool(getattr(cfg, "tie_embeddings", False)) and _named(name, "output.weight")


def _named(name: str, tail: str) -> bool:
    return name == tail or name.endswith("." + tail)


def param_groups(
    model: nn.Module, weight_decay: float, decay_embeddings: bool = True
) -> list[dict[str, Any]]:
    """[decay, embeddings without decay, no-decay] groups of the trainable parameters (empty ones
    dropped; a tied weight appears once). The embedding group exists only with
    `decay_embeddings=False`; unlike the vectors, it keeps LAMB's trust ratio."""
    decay, embeddings, no_decay = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if _no_decay(name, p):
            no_decay.append(p)
        elif not decay_embeddings and _is_embedding(model, name):
            embeddings.append(p)
        else:
            decay.append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": embeddings, "weight_decay": 0.0},
        {"params": no_decay, "weight_decay": 0.0, "adaptive": False},
    ]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW, LAMB or Muon over the groups of `param_groups`: decay (matrices, and the embedding
    unless `optim.decay_embeddings = false`) and no-decay (vectors, AttnRes params); Muon takes
    the hidden matrices out of them (`muon_groups`).

    The group list depends only on the model's structure and the config, so a resumed run rebuilds
    the same groups and the checkpointed optimizer state maps back one to one.
    """
    groups = param_groups(model, cfg.weight_decay, cfg.decay_embeddings)
    if not groups:
        raise ValueError("build_optimizer: the model has no trainable parameters")
    betas = (cfg.beta1, cfg.beta2)
    if cfg.name == "lamb":
        return LAMB(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.name == "adamw":
        for g in groups:
            g.pop("adaptive", None)
        fused = _fused_adamw_applies(g["params"] for g in groups)
        sharded = any(isinstance(p, DTensor) for g in groups for p in g["params"])
        cls = ShardedFusedAdamW if fused and sharded else torch.optim.AdamW
        return cls(
            groups,
            lr=cfg.lr,
            betas=betas,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            fused=fused or None,
        )
    if cfg.name == "muon":
        return Muon(
            muon_groups(model, groups, cfg),
            lr=cfg.lr,
            momentum=cfg.muon_momentum,
            nesterov=cfg.muon_nesterov,
            ns_steps=cfg.muon_ns_steps,
            weight_decay=cfg.weight_decay,
            betas=betas,
            eps=cfg.eps,
            qk_clip=_qk_clip(model, cfg),
        )
    raise ValueError(f"optim.name={cfg.name!r} is not supported; allowed: 'adamw', 'lamb', 'muon'")


def muon_groups(
    model: nn.Module, groups: list[dict[str, Any]], cfg: OptimConfig
) -> list[dict[str, Any]]:
    """Muon's groups from `param_groups`' ones: the hidden matrices (`shape.muon.is_muon_matrix`)
    in one Muon group with the matrices' weight decay, the rest AdamW groups as before, at
    `optim.muon_adamw_lr` (0: optim.lr). Each group's `lr_scale` is its lr over optim.lr, which
    the schedule keeps (`schedule.set_lr`)."""
    names = {id(p): n for n, p in model.named_parameters()}
    matrices, adamw = [], []
    for g in groups:
        rest = []
        for p in g["params"]:
            (matrices if is_muon_matrix(names[id(p)], p.ndim) else rest).append(p)
        if rest:
            adamw.append({**g, "params": rest})
    adamw_scale = (cfg.muon_adamw_lr or cfg.lr) / cfg.lr
    out = [{"params": matrices, "muon": True, "weight_decay": cfg.weight_decay, "lr_scale": 1.0}]
    out += [{**g, "lr": cfg.lr * adamw_scale, "lr_scale": adamw_scale} for g in adamw]
    return [g for g in out if g["params"]]


def _qk_clip(model: nn.Module, cfg: OptimConfig) -> QKClip | None:
    """Muon's QK-clip at `optim.qk_clip_tau` (0: off), over the model's attention layers."""
    if cfg.qk_clip_tau <= 0:
        return None
    m = model.cfg
    return QKClip(model, cfg.qk_clip_tau, m.n_layers, m.n_heads, m.kv_heads)


class ShardedFusedAdamW(torch.optim.AdamW):
    """torch's fused AdamW over DTensor parameters. Its step counts (and `found_inf`, when the NaN
    guard sets it) are plain one-element tensors, and so are the parameters FSDP leaves whole
    (the AttnRes queries, replicated by hand); DTensor refuses to mix those with DTensors unless
    told to treat them as replicated, which they are (the same on every rank)."""

    def step(self, closure=None):  # type: ignore[override]
        with implicit_replication():
            return super().step(closure)


def _fused_adamw_applies(param_lists: Iterable[list[Tensor]]) -> bool:
    """torch's fused AdamW (one kernel over all tensors; on CPU ~4x faster than the per-tensor
    loop torch otherwise picks there), for floating-point parameters on CPU or CUDA, plain or
    DTensors (FSDP2, TP; see `ShardedFusedAdamW`). It is also what skips a non-finite update on
    the device (`nan_guard.skip_if_not_finite`)."""
    params = [p for ps in param_lists for p in ps]
    return all(
        (type(p) is nn.Parameter or isinstance(p, DTensor))
        and p.device.type in ("cpu", "cuda")
        and p.is_floating_point()
        for p in params
    )
