"""LAMB (MegaScale's optimizer for large batches), multi-tensor over plain and DTensor parameters,
and the local/fp32 tensor helpers the optimizers built on it share (`train/muon.py`).

MegaScale trains with LAMB to grow the batch 4x without losing accuracy: its per-tensor trust ratio
rescales each update to the size of the weights it changes, which keeps large-lr steps stable.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from depthscale.observe import spans

__all__ = ["LAMB", "NormFn"]

NormFn = Callable[[Tensor], Tensor]
"""Maps a tensor to the L2 norm of the *whole* logical tensor, as a 0-d tensor."""


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

    Multi-tensor step: every group's update runs as `torch._foreach_*` ops over the *local* tensors
    (a DTensor's shard), so the cost does not grow with a Python loop over parameters. The trust
    ratio is defined on the whole tensor, so a sharded tensor needs its norms summed over the mesh;
    DTensor's own `vector_norm` would issue one all-reduce per norm (two per parameter). Instead the
    local squared norms of all parameters that share a mesh and the mesh dimensions they are split
    over are stacked into one [2, n] tensor and all-reduced once per such dimension, over all groups
    together: one collective per (mesh, sharded dimension) per step. Plain and replicated tensors are
    whole on every rank and need none. No host sync (`step` lives on the CPU, as before).

    `norm_fn`, if given, replaces that reduction: it is called on each whole p and u (a DTensor for
    DTensor parameters), one call each, for sharding the optimizer cannot see: parameters that are
    plain local shards need a norm that all-reduces the squared local norms over their shard group.

    State (`step`, `exp_avg`, `exp_avg_sq`) is fp32 whatever the parameter dtype, and stays fp32
    across `load_state_dict` (the base class would cast it to the parameter's dtype).
    """

    FP32_STATE: tuple[str, ...] = ("exp_avg", "exp_avg_sq")
    """State tensors kept fp32 across `load_state_dict`."""

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
        self.norm_fn: NormFn | None = norm_fn

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One LAMB update of every parameter that has a gradient; returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [w for group in self.param_groups if (w := self._update(group)) is not None]
        adaptive = [w for w in work if w.group["adaptive"]]
        if self.norm_fn is not None:
            self._scales_per_tensor(adaptive)
        else:
            self._scales_multi_tensor(adaptive)
        for w in work:
            w.apply()
        return loss

    def _update(self, group: dict[str, Any]) -> _GroupUpdate | None:
        """Moments and u = m̂/(sqrt(v̂)+eps) + wd·p of one group's parameters with a gradient."""
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return None
        beta1, beta2 = group["betas"]
        grads = []
        for p in params:
            if p.grad.is_sparse:
                raise RuntimeError("LAMB does not support sparse gradients")
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            grads.append(_fp32(_local(_grad_like_param(p))))
        states = [self.state[p] for p in params]
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1.0)
        step_values = [float(s) for s in steps]  # CPU tensors: no device sync
        exp_avgs = [_local(s["exp_avg"]) for s in states]
        exp_avg_sqs = [_local(s["exp_avg_sq"]) for s in states]
        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
        del grads
        update = list(torch._foreach_div(exp_avgs, [1.0 - beta1**t for t in step_values]))
        denom = torch._foreach_div(exp_avg_sqs, [1.0 - beta2**t for t in step_values])
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, group["eps"])
        torch._foreach_div_(update, denom)
        del denom
        local = [_local(p) for p in params]
        p32 = [_fp32(t) for t in local]
        if group["weight_decay"] != 0.0:
            torch._foreach_add_(update, p32, alpha=group["weight_decay"])
        return _GroupUpdate(group, params, local, p32, update)

    def _scales_multi_tensor(self, work: list[_GroupUpdate]) -> None:
        """lr·r for every adaptive parameter, with one all-reduce per (mesh, sharded dim)."""
        buckets: dict[tuple, list[tuple[_GroupUpdate, int]]] = {}
        for w in work:
            w.scales = [None] * len(w.params)
            for i, p in enumerate(w.params):
                buckets.setdefault(_norm_key(p, w.local[i]), []).append((w, i))
        for (mesh, dims, _), members in buckets.items():  # same order on every rank
            n = len(members)
            shards = [w.p32[i] for w, i in members] + [w.update[i] for w, i in members]
            norms = torch.stack(torch._foreach_norm(shards, 2.0)).view(2, n)
            if dims:  # the whole norm is the root of the summed squared shard norms
                sq = norms.square()
                if mesh.device_type != sq.device.type:  # CPU-offloaded shards, NCCL mesh
                    sq = sq.to(mesh.device_type)
                for dim in dims:
                    with spans.collective("all_reduce", mesh.get_group(dim), sq):
                        dist.all_reduce(sq, group=mesh.get_group(dim))
                norms = sq.to(norms.device).sqrt()
            # members come group by group, so each group's columns are one contiguous run
            start = 0
            for w, run in itertools.groupby(members, key=lambda m: m[0]):
                idx = [i for _, i in run]
                cols = slice(start, start + len(idx))
                start += len(idx)
                r = _trust_ratio(norms[0, cols], norms[1, cols], w.group["max_trust_ratio"])
                for i, s in zip(idx, (r * w.group["lr"]).unbind(0)):
                    w.scales[i] = s

    def _scales_per_tensor(self, work: list[_GroupUpdate]) -> None:
        """lr·r with the user's `norm_fn`, called on each whole p and u."""
        assert self.norm_fn is not None
        for w in work:
            w.scales = []
            for p, p32, u in zip(w.params, w.p32, w.update):
                w_norm = _whole(self.norm_fn(_like_param(p32, p)))
                u_norm = _whole(self.norm_fn(_like_param(u, p)))
                r = _trust_ratio(w_norm, u_norm, w.group["max_trust_ratio"])
                w.scales.append(r * w.group["lr"])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load as the base class does, then put back the fp32 moments it cast to the param dtype."""
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        originals = {i: state_dict["state"].get(i, {}) for i in saved_ids}
        super().load_state_dict(state_dict)
        for saved_id, p in zip(saved_ids, params):
            for key in self.FP32_STATE:
                value = originals[saved_id].get(key)
                if isinstance(value, Tensor):
                    self.state[p][key] = value.to(device=p.device, dtype=torch.float32, copy=True)
            if "step" in self.state[p]:
                self.state[p]["step"] = torch.as_tensor(self.state[p]["step"], dtype=torch.float32)


@dataclass(eq=False)
class _GroupUpdate:
    """One group's step between computing u and applying it: parameters with a gradient, their
    local tensors (written in place), fp32 values of those (the same tensors when fp32), u, and
    the per-parameter lr·r (None: a non-adaptive group, lr alone)."""

    group: dict[str, Any]
    params: list[Tensor]
    local: list[Tensor]
    p32: list[Tensor]
    update: list[Tensor]
    scales: list[Any] | None = None

    def apply(self) -> None:
        """p ← p - scale·u, rounded once to the parameter dtype."""
        if self.scales is None:
            torch._foreach_mul_(self.update, self.group["lr"])
        else:
            torch._foreach_mul_(self.update, self.scales)
        torch._foreach_sub_(self.p32, self.update)
        low = [(t, t32) for t, t32 in zip(self.local, self.p32) if t is not t32]
        if low:
            torch._foreach_copy_([t for t, _ in low], [t32 for _, t32 in low])


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _fp32(t: Tensor) -> Tensor:
    return t if t.dtype == torch.float32 else t.float()


def _whole(t: Tensor) -> Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _grad_like_param(p: Tensor) -> Tensor:
    """p.grad laid out as p, so that its local tensor lines up with p's shard."""
    g = p.grad
    if isinstance(p, DTensor) and isinstance(g, DTensor) and g.placements != p.placements:
        g = g.redistribute(p.device_mesh, p.placements)
    return g


def _like_param(local: Tensor, p: Tensor) -> Tensor:
    """A local tensor of p's layout as the whole logical tensor (a DTensor when p is one)."""
    if not isinstance(p, DTensor):
        return local
    return DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def _norm_key(p: Tensor, local: Tensor) -> tuple:
    """(mesh, mesh dims whose shards must be summed, device) of a parameter's norms. As in
    `parallel.data_parallel.grad_norm`: every dim that is not Replicate, because FSDP's
    (_StridedShard, Shard) placement of FSDP×TP weights answers is_shard() == False. Plain and
    replicated tensors are whole: (None, (), device)."""
    if isinstance(p, DTensor):
        mesh = p.device_mesh
        dims = tuple(
            d for d, pl in enumerate(p.placements) if not pl.is_replicate() and mesh.size(d) > 1
        )
        if dims:
            return (mesh, dims, local.device)
    return (None, (), local.device)


def _trust_ratio(w_norm: Tensor, u_norm: Tensor, max_trust: float | None) -> Tensor:
    """‖p‖/‖u‖ elementwise (no host sync), 1 where either norm is 0, clamped above."""
    ok = (w_norm > 0) & (u_norm > 0)
    trust = torch.where(ok, w_norm / torch.where(ok, u_norm, 1.0), 1.0)
    return trust.clamp(max=max_trust) if max_trust is not None else trust
