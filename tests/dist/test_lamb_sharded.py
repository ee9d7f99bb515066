"""LAMB on sharded parameters (2 gloo ranks): one all-reduce per (mesh, sharded mesh dim) per step,
not one per tensor, and the same parameters as a single-process LAMB on the whole model.

The model mixes every layout a step meets: FSDP2 (`fully_shard`, Shard(0) on a `dp_shard` mesh,
with uneven shards and an empty one), Megatron-style TP on a separate `tp` mesh (Shard(0), Shard(1)
and a Replicate bias) and a plain parameter. All ranks see the same input, so the gradients equal the
single-process ones; the reference optimizer is handed exactly the gathered parallel gradients, so
only the optimizer differs between the two sides.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from depthscale.train.optim import LAMB
from tolerances import U32, gamma

WORLD, STEPS, LR, WD = 2, 3, 0.05, 0.1

_MESHES: dict = {}


def _meshes():
    """Two distinct 1-D meshes over the same ranks, built once per worker (they create groups)."""
    if not _MESHES:
        _MESHES["dp"] = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp_shard",))
        _MESHES["tp"] = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    return _MESHES["dp"], _MESHES["tp"]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tp_in = nn.Linear(8, 16)  # Colwise: weight and bias Shard(0)
        self.tp_out = nn.Linear(16, 8)  # Rowwise: weight Shard(1), bias Replicate
        # FSDP: [5, 8] splits 3/2 rows, [1, 5] leaves rank 1 an empty shard
        self.fsdp = nn.Sequential(nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 1))
        self.gain = nn.Parameter(torch.zeros(8))  # plain; ‖p‖ = 0 on the first step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tp_out(torch.relu(self.tp_in(x)))
        return self.fsdp(h * (1 + self.gain)).square().mean()


def _groups(model: nn.Module) -> list[dict]:
    """Everything adaptive with decay, except one non-adaptive vector (as build_optimizer's
    no-decay group)."""
    named = dict(model.named_parameters())
    plain = [p for n, p in named.items() if n != "fsdp.2.bias"]
    return [
        {"params": plain, "weight_decay": WD},
        {"params": [named["fsdp.2.bias"]], "weight_decay": 0.0, "adaptive": False},
    ]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _parallel(ref: nn.Module) -> nn.Module:
    dp_mesh, tp_mesh = _meshes()
    model = copy.deepcopy(ref)
    parallelize_module(model, tp_mesh, {"tp_in": ColwiseParallel(), "tp_out": RowwiseParallel()})
    fully_shard(model.fsdp, mesh=dp_mesh)
    return model


def _lamb_parity() -> dict:
    torch.manual_seed(0)
    ref = _Net()
    par = _parallel(ref)
    per_tensor = _parallel(ref)  # the same layout, norms through DTensor's vector_norm
    opt_ref = LAMB(_groups(ref), lr=LR)
    opt_par = LAMB(_groups(par), lr=LR)
    opt_per_tensor = LAMB(_groups(per_tensor), lr=LR, norm_fn=torch.linalg.vector_norm)

    adaptive = opt_par.param_groups[0]["params"]
    sharded = [p for p in adaptive if isinstance(p, DTensor) and p.placements[0].is_shard()]
    out = {
        "layouts": sorted({(p.device_mesh.mesh_dim_names, str(p.placements)) for p in sharded}),
        "n_sharded": len(sharded),
        "empty_shard": any(p.to_local().numel() == 0 for p in sharded),
        "counts": [],
        "per_tensor_counts": [],
        "err": 0.0,
        "per_tensor_err": 0.0,
        "bound": 0.0,
    }
    for step in range(STEPS):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        par(x).backward()
        for p, q, q1 in zip(par.parameters(), ref.parameters(), per_tensor.parameters()):
            q.grad = _full(p.grad).clone()
            q1.grad = p.grad.clone()
        before = [q.detach().clone() for q in ref.parameters()]
        opt_ref.step()
        with CommDebugMode() as comm:
            opt_par.step()
        out["counts"].append(comm.get_total_counts())
        with CommDebugMode() as comm:
            opt_per_tensor.step()
        out["per_tensor_counts"].append(comm.get_total_counts())
        for o in (opt_ref, opt_par, opt_per_tensor):
            o.zero_grad()
        # Both sides run the same elementwise fp32 operations (≤ 1 ulp apart where sharding moves
        # an element between a kernel's vector body and its scalar tail: ≤ 20u over ~10 operations);
        # only the norms differ: the root of the summed squared shard norms against one norm, each
        # within γ_n of the exact norm (n ≤ 128 elements) plus 2u for the square and root, so r
        # differs by ≤ 4(γ_n + 2u) + u relative and the step lr·r·u by that plus 20u. Plus one
        # rounding of p per step, and a factor 2 for the feedback of earlier differences through
        # ‖p‖ and wd·p over the steps. Seen: 3e-8 against a bound of ~1e-5.
        largest_step = max((q - b).abs().max().item() for q, b in zip(ref.parameters(), before))
        largest_p = max(q.abs().max().item() for q in ref.parameters())
        rel = 4 * (gamma(128) + 2 * U32) + 21 * U32
        out["bound"] += 2 * (rel * largest_step + U32 * largest_p)
        for p, p1, q in zip(par.parameters(), per_tensor.parameters(), ref.parameters()):
            out["err"] = max(out["err"], (_full(p) - q).abs().max().item())
            out["per_tensor_err"] = max(out["per_tensor_err"], (_full(p1) - q).abs().max().item())
    return out


def test_lamb_one_all_reduce_per_sharded_mesh_dim_and_parity(dist_pool):
    for rank, r in enumerate(dist_pool(WORLD).run(_lamb_parity)):
        # three sharded layouts on two meshes: Shard(0) and Shard(1) of the tp weights are both
        # split over the tp dim, so they share its all-reduce
        assert r["layouts"] == [
            (("dp_shard",), "(Shard(dim=0),)"),
            (("tp",), "(Shard(dim=0),)"),
            (("tp",), "(Shard(dim=1),)"),
        ]
        assert r["counts"] == [2] * STEPS, r
        # through DTensor's vector_norm: one all-reduce per norm, two per sharded tensor
        assert r["per_tensor_counts"] == [2 * r["n_sharded"]] * STEPS, r
        assert r["empty_shard"] == (rank == 1)  # the [1, 5] weight: no rows on rank 1
        assert r["err"] <= r["bound"], r
        assert r["per_tensor_err"] <= r["bound"], r
