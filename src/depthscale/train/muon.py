"""Muon (Jordan et al. 2024; Moonlight, Kimi K2): momentum orthogonalised by Newton–Schulz for the
hidden matrices, AdamW for everything else, in one optimizer — and, when FSDP or tensor
parallelism splits a matrix over ranks, each matrix orthogonalised once, by one owner rank.

Per matrix W (m×n) with gradient G, as `torch.optim.Muon`:

    B ← μ·B + (1-μ)·G                    (fp32 momentum buffer, laid out as W)
    U = (1-μ)·G + μ·B  (Nesterov) or B
    O = NS₅(U)                           (quintic Newton–Schulz: ≈ the orthogonal factor of U)
    W ← W·(1 - lr·wd) - lr·0.2·√max(m, n)·O

The 0.2·√max(m, n) scale (Moonlight's RMS matching, `shape.muon.update_scale`) gives O the RMS of
an AdamW update, so AdamW's learning rate and weight decay carry over. Newton–Schulz runs in bf16
on CUDA (as torch's) and fp32 on CPU, tall matrices transposed. A 3-D expert stack is a batch of
matrices, each expert orthogonalised on its own (one batched iteration). Q, K and V are separate
parameters of the model, so each is its own matrix (as in torch, Moonlight and Kimi K2); a fused
QKV would mix three maps' spectra. The other parameters (`shape.muon.is_muon_matrix`) take the
non-adaptive groups of `LAMB`, which are AdamW.

Distributed (FSDP2, HSDP, TP, cp, EP; PP per stage, its optimizer holding the stage's
parameters): a matrix whose DTensor is split over mesh dimensions needs all of it, and
all-gathering every matrix on every rank repeats the Newton–Schulz work once per shard. Instead
the matrices split over the same mesh dimensions (one *shard group*, replicas excluded: HSDP's
replicas each orthogonalise their own copy) get owners balanced by Newton–Schulz FLOPs
(`shape.muon.assign_owners`); each step one all-to-all brings every rank's shards of the momentum
updates to their owners (in the Newton–Schulz dtype), the owners orthogonalise, and one all-to-all
returns each rank its shard of every update (`_Redistribution`). Where each local element sits in
the whole matrix comes from DTensor itself (a local shard of the global indices), so any
placement — Shard, FSDP×TP's strided shards — is reassembled exactly.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from depthscale.observe import spans
from depthscale.shape.muon import (
    MAX_NS_STEPS,
    NS_COEFFICIENTS,
    NS_STEPS,
    assign_owners,
    ns_flops,
    update_scale,
)
from depthscale.train.lamb import LAMB, _fp32, _grad_like_param, _local

if TYPE_CHECKING:
    from depthscale.train.qk_clip import QKClip

__all__ = ["Muon", "newton_schulz"]

EPS = 1e-7
"""Floor of the Frobenius norm U is divided by (torch's), so a zero update stays zero."""


def newton_schulz(x: Tensor, steps: int = NS_STEPS, eps: float = EPS) -> Tensor:
    """≈ the orthogonal factor of each matrix in the last two dims of `x`, computed in x's dtype
    with torch.optim.Muon's operations (so a 2-D bf16 input gives torch's bits). Leading dims are a
    batch: each matrix is normalised and iterated on its own. Does not modify `x`."""
    a, b, c = NS_COEFFICIENTS
    lead = x.shape[:-2]
    y = x.reshape(-1, *x.shape[-2:]) if x.ndim != 2 else x
    tall = y.size(-2) > y.size(-1)
    if tall:
        y = y.mT
    if y.ndim == 2:
        y = y / y.norm().clamp(min=eps)
        for _ in range(steps):
            gram = y @ y.T
            y = torch.addmm(y, torch.addmm(gram, gram, gram, beta=b, alpha=c), y, beta=a)
    else:
        y = y / y.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
        for _ in range(steps):
            gram = y @ y.mT
            y = torch.baddbmm(y, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), y, beta=a)
    if tall:
        y = y.mT
    return y.reshape(*lead, *y.shape[-2:]) if x.ndim != 2 else y


def ns_dtype_for(device: torch.device) -> torch.dtype:
    """bf16 on CUDA (tensor cores; Newton–Schulz tolerates it by design), fp32 elsewhere (CPUs
    without bf16 units run it slower than fp32)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class Muon(LAMB):
    """Muon for the groups with `muon=True` (matrices: momentum, nesterov, ns_steps, lr,
    weight_decay), AdamW for the others (betas, eps, lr, weight_decay): see the module docstring.

    `orthogonalised` lists, after each step, the indices (into `muon_params`) of the matrices this
    rank ran Newton–Schulz on; `moved` counts the bytes this rank sent to other ranks in the
    redistribution, per direction ("to_owners", "from_owners"), over all steps.
    """

    FP32_STATE = ("exp_avg", "exp_avg_sq", "momentum_buffer")

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        lr: float = 1e-3,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = NS_STEPS,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        ns_dtype: torch.dtype | None = None,
        qk_clip: QKClip | None = None,
    ) -> None:
        if lr < 0.0 or weight_decay < 0.0 or eps < 0.0:
            raise ValueError(f"Muon: lr={lr}, weight_decay={weight_decay}, eps={eps} must be >= 0")
        if not 0.0 <= momentum < 1.0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Muon: momentum={momentum} and betas={betas} must be in [0, 1)")
        if not 1 <= ns_steps <= MAX_NS_STEPS:
            raise ValueError(f"Muon: ns_steps={ns_steps} must be in [1, {MAX_NS_STEPS}]")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "max_trust_ratio": None,
            "adaptive": False,
            "muon": False,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_steps": ns_steps,
        }
        torch.optim.Optimizer.__init__(self, params, defaults)
        self.norm_fn = None
        known = {"params", "lr_scale", *defaults}  # lr_scale: the schedule's (`schedule.set_lr`)
        for i, group in enumerate(self.param_groups):
            unknown = sorted(set(group) - known)
            if unknown:
                raise ValueError(
                    f"Muon: parameter group {i} has unknown key {unknown[0]!r}; "
                    f"allowed: {', '.join(sorted(known))}"
                )
            group["adaptive"] = False  # AdamW groups: LAMB without the trust ratio
            if group["muon"]:
                for p in group["params"]:
                    if p.ndim < 2:
                        raise ValueError(f"Muon: a muon group holds a {p.ndim}-D parameter")
        self.muon_params = [p for g in self.param_groups if g["muon"] for p in g["params"]]
        self.ns_dtype = ns_dtype
        self.qk_clip = qk_clip
        """MuonClip (`train/qk_clip.py`): W_q, W_k rescaled after each step; None: off."""
        self.orthogonalised: list[int] = []
        self.moved: Counter = Counter()
        self._routes: dict[tuple, _Redistribution] = {}
        self._groups = {key: _shard_group(key) for key in _shard_keys(self.muon_params)}

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One update: AdamW for the non-matrix groups, Muon for the matrices."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        adamw = [
            w for g in self.param_groups if not g["muon"] and (w := self._update(g)) is not None
        ]
        self._muon_step()
        for w in adamw:
            w.apply()
        if self.qk_clip is not None:
            self.qk_clip.apply()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Also forgets QK-clip's recorded logits: a try the NaN guard abandons zeroes the
        gradients without stepping, and its forward must not count in the next step's clip."""
        super().zero_grad(set_to_none)
        if self.qk_clip is not None:
            self.qk_clip.reset()

    def _muon_step(self) -> None:
        index = {id(p): i for i, p in enumerate(self.muon_params)}
        items, updates = [], []
        for group in self.param_groups:
            if not group["muon"]:
                continue
            mu = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
                grad = _fp32(_local(_grad_like_param(p)))
                buf = _local(state["momentum_buffer"])
                buf.lerp_(grad, 1.0 - mu)
                updates.append(grad.lerp(buf, mu) if group["nesterov"] else buf)
                items.append((index[id(p)], p, group))
        self.orthogonalised = []
        ortho = self._orthogonalise(items, updates)
        for (_, p, group), o in zip(items, ortho):
            local = _local(p)
            p32 = _fp32(local)
            p32.mul_(1.0 - group["lr"] * group["weight_decay"])
            p32.add_(o.to(p32.dtype), alpha=-group["lr"] * update_scale(p.shape))
            if p32 is not local:
                local.copy_(p32)

    def _orthogonalise(self, items: list[tuple], updates: list[Tensor]) -> list[Tensor]:
        """NS of each update (local shapes in, local shapes out): whole matrices here, split ones
        through their shard group's owners."""
        out: list[Tensor | None] = [None] * len(items)
        routed: dict[tuple, list[int]] = {}
        for k, ((i, p, group), u) in enumerate(zip(items, updates)):
            key = _shard_key(p)
            if key is None:
                dtype = self.ns_dtype or ns_dtype_for(u.device)
                out[k] = newton_schulz(u.to(dtype), group["ns_steps"])
                self.orthogonalised.append(i)
            else:
                routed.setdefault(key, []).append(k)
        for key, ks in routed.items():  # same keys, same order on every rank of a group
            ids = tuple(items[k][0] for k in ks)
            route = self._routes.get((key, ids))
            if route is None:
                params = [items[k][1] for k in ks]
                steps = [items[k][2]["ns_steps"] for k in ks]
                dtype = self.ns_dtype or ns_dtype_for(updates[ks[0]].device)
                route = _Redistribution(params, steps, self._groups[key], dtype)
                self._routes[(key, ids)] = route
            results = route.run([updates[k] for k in ks], self.moved)
            self.orthogonalised += [ids[j] for j in route.owned]
            for k, o in zip(ks, results):
                out[k] = o
        return out  # type: ignore[return-value]


def _shard_key(p: Tensor) -> tuple | None:
    """(mesh, mesh dims that split p's matrices) of a DTensor; None when every rank has its
    matrices whole. A shard of an expert stack's leading dim (expert parallelism's ep, or FSDP
    without it) splits no matrix: each rank keeps its experts and orthogonalises them itself."""
    if not isinstance(p, DTensor):
        return None
    mesh, batch = p.device_mesh, p.ndim - 2
    dims = tuple(
        d
        for d, pl in enumerate(p.placements)
        if not pl.is_replicate() and mesh.size(d) > 1 and not (pl.is_shard() and pl.dim < batch)
    )
    return (mesh, dims) if dims else None


def _shard_keys(params: Sequence[Tensor]) -> list[tuple]:
    keys: list[tuple] = []
    for p in params:
        key = _shard_key(p)
        if key is not None and key not in keys:
            keys.append(key)
    return keys


def _shard_group(key: tuple) -> dist.ProcessGroup:
    """The process group over the mesh dims a matrix is split over. Two dims (FSDP × TP) are
    flattened into one group once, at construction (a collective on every rank)."""
    mesh, dims = key
    if len(dims) == 1:
        return mesh.get_group(dims[0])
    names = tuple(mesh.mesh_dim_names[d] for d in dims)
    return mesh[names]._flatten("muon_" + "_".join(names)).get_group()


class _Redistribution:
    """The matrices of one shard group: owners, and the two all-to-alls of each step.

    Layout, fixed at the first step: rank r sends, to each owner in group order, its shards of that
    owner's matrices (in matrix order), flattened. The owner received, once, where each element
    sits (`positions`: the offset of its matrix among the owner's matrices plus the element's index
    in the whole matrix, a local shard of `arange` made by DTensor from p's own placements), so
    one `index_copy_` assembles every owned matrix and one `index_select` returns the results in
    the order they arrived; the reverse all-to-all then hands each rank exactly what it sent.
    """

    def __init__(
        self,
        params: list[Tensor],
        steps: list[int],
        group: dist.ProcessGroup,
        dtype: torch.dtype,
    ) -> None:
        self.group, self.dtype, self.steps = group, dtype, steps
        size, me = group.size(), group.rank()
        self.shapes = [_matrix_shape(p) for p in params]
        self.owners = assign_owners([ns_flops(s, n) for s, n in zip(self.shapes, steps)], size)
        self.owned = [i for i, o in enumerate(self.owners) if o == me]
        self.local_shapes = [tuple(_local(p).shape) for p in params]
        self.send_order = [i for r in range(size) for i, o in enumerate(self.owners) if o == r]
        numel = [_numel(s) for s in self.local_shapes]
        per_owner = [sum(1 for o in self.owners if o == r) for r in range(size)]
        self.send_splits = [
            sum(numel[i] for i, o in enumerate(self.owners) if o == r) for r in range(size)
        ]
        device = _local(params[0]).device
        counts = torch.tensor([numel[i] for i in self.send_order], dtype=torch.int64, device=device)
        arriving = torch.empty(size * len(self.owned), dtype=torch.int64, device=device)
        self._all_to_all(arriving, counts, [len(self.owned)] * size, per_owner)
        arriving = arriving.view(size, len(self.owned))
        self.recv_splits = arriving.sum(1).tolist()
        where = torch.cat(
            [_global_index(params[i], self.shapes[i]).reshape(-1) for i in self.send_order]
        )
        index = torch.empty(sum(self.recv_splits), dtype=torch.int64, device=device)
        self._all_to_all(index, where, self.recv_splits, self.send_splits)
        sizes = [_numel(self.shapes[i]) for i in self.owned]
        offsets = torch.tensor([0, *sizes[:-1]], dtype=torch.int64, device=device).cumsum(0)
        self.owned_numel = sum(sizes)
        self.positions = index + offsets[: len(sizes)].repeat(size).repeat_interleave(
            arriving.reshape(-1)
        )
        self._numel = numel

    def _all_to_all(self, out: Tensor, inp: Tensor, out_splits: list, in_splits: list) -> None:
        with spans.collective("all_to_all", self.group, inp):
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)

    def run(self, updates: list[Tensor], moved: Counter) -> list[Tensor]:
        """The orthogonalised update of each matrix, as this rank's shard of it."""
        me = self.group.rank()
        device = updates[0].device
        send = torch.cat([updates[i].reshape(-1).to(self.dtype) for i in self.send_order])
        received = torch.empty(sum(self.recv_splits), dtype=self.dtype, device=device)
        self._all_to_all(received, send, self.recv_splits, self.send_splits)
        moved["to_owners"] += (send.numel() - self.send_splits[me]) * send.element_size()
        whole = torch.empty(self.owned_numel, dtype=self.dtype, device=device)
        whole.index_copy_(0, self.positions, received)
        start = 0
        for i in self.owned:
            n = _numel(self.shapes[i])
            view = whole[start : start + n].view(self.shapes[i])
            view.copy_(newton_schulz(view, self.steps[i]))
            start += n
        back = whole.index_select(0, self.positions)
        returned = torch.empty(send.numel(), dtype=self.dtype, device=device)
        self._all_to_all(returned, back, self.send_splits, self.recv_splits)
        moved["from_owners"] += (back.numel() - self.recv_splits[me]) * back.element_size()
        out: list[Tensor | None] = [None] * len(updates)
        for i, piece in zip(
            self.send_order, returned.split([self._numel[i] for i in self.send_order])
        ):
            out[i] = piece.view(self.local_shapes[i])
        return out  # type: ignore[return-value]


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _matrix_shape(p: DTensor) -> tuple[int, ...]:
    """What p's owner assembles: p's whole matrices, of the experts this rank holds (a leading
    dim keeps its local size)."""
    batch = p.ndim - 2
    return tuple(_local(p).shape[:batch]) + tuple(p.shape[batch:])


def _global_index(p: DTensor, shape: tuple[int, ...]) -> Tensor:
    """The flat index in `_matrix_shape(p)` of each element of p's local shard: DTensor cuts an
    `arange` of that shape with the placements that split p's matrices (the others, which only
    pick this rank's experts, replaced by Replicate) on this rank, no communication."""
    _, dims = _shard_key(p)
    placements = [pl if d in dims else Replicate() for d, pl in enumerate(p.placements)]
    whole = torch.arange(math.prod(shape), dtype=torch.int64, device=_local(p).device)
    index = distribute_tensor(whole.view(shape), p.device_mesh, placements, src_data_rank=None)
    local = index.to_local()
    if local.shape != _local(p).shape:
        raise AssertionError(f"Muon: a {tuple(local.shape)} index for a {_local(p).shape} shard")
    return local
