"""`plan.states` and `plan.pipeline` against real ranks (gloo): the parameter, gradient and
optimizer bytes each rank allocates under dp_shard, HSDP, DDP, tp, cp and pp layouts — with
dimensions that FSDP and tp split unevenly — and the pipeline runtime's peak of micro-batches in
flight, equal to what the planner predicts for every rank."""

from __future__ import annotations

import pytest
import torch
from harness import cached_mesh
from torch.distributed.tensor import DTensor

from depthscale.config import Config
from depthscale.model.transformer import Transformer
from depthscale.parallel.mesh import ParallelDims
from depthscale.parallel.parallelize import dp_rank_and_size, parallelize
from depthscale.plan.layout import Layout
from depthscale.plan.pipeline import peak_in_flight
from depthscale.plan.states import rank_state_bytes
from depthscale.shape import ModelShape
from depthscale.train.optim import build_optimizer

BATCH, SEQ, VOCAB = 8, 16, 70


def _config(residual: str, dims_kw: dict, tie: bool) -> Config:
    """`residual` 'moe': block AttnRes with MoE FFNs after a dense first layer (4 experts, top 2,
    a shared expert)."""
    moe = residual == "moe"
    residual = "block" if moe else residual
    cfg = Config()
    m = cfg.model
    if moe:
        m.moe_experts, m.moe_top_k, m.moe_ffn_dim, m.moe_shared_experts = 4, 2, 24, 1
        m.moe_first_dense = 1
    m.vocab_size, m.dim, m.n_layers, m.n_heads, m.n_kv_heads = VOCAB, 40, 3, 4, 2
    m.ffn_dim, m.max_seq_len, m.residual, m.attnres_n_blocks = 42, SEQ, residual, 2
    cfg.data.seq_len = SEQ
    m.tie_embeddings = tie
    cfg.train.batch_size, cfg.train.micro_batch_size = BATCH, 1
    for name, value in dims_kw.items():
        setattr(cfg.parallel, name, value)
    return cfg.validate()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _measure(residual: str, dims_kw: dict, tie: bool) -> dict:
    cfg = _config(residual, dims_kw, tie)
    dims = ParallelDims(**{k: v for k, v in dims_kw.items() if k not in ("pp_virtual", "ep")})
    mesh = cached_mesh(dims)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    plan = parallelize(model, mesh, dims, cfg, device=torch.device("cpu"))
    optimizer = build_optimizer(model, cfg.optim)
    rank, size = dp_rank_and_size(mesh, dims)
    rows = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    plan.forward_backward(model, tokens[rows, :-1], tokens[rows, 1:])
    plan.reduce_gradients()
    optimizer.step()
    params = list(model.parameters())
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    out = {
        "params": sum(_local(p).numel() * _local(p).element_size() for p in params),
        "grads": sum(_local(p.grad).numel() * 4 for p in params if p.grad is not None),
        "optimizer": sum(_local(t).numel() * _local(t).element_size() for t in state),
        "pp": mesh.get_local_rank("pp"),
        "tp": mesh.get_local_rank("tp"),
        "shard": mesh.get_local_rank("dp_shard") * dims.cp + mesh.get_local_rank("cp"),
        "microbatches": plan.microbatches,
        "peak_units": None,
    }
    if plan.pipeline is not None:
        out["peak_units"] = plan.pipeline.runtime(True, plan.microbatches).last_stats.peak_units
    return out


CASES = [
    ({"dp_shard": 2}, 2),
    ({"dp_replicate": 2}, 2),
    ({"tp": 2}, 2),
    ({"cp": 2}, 2),
    ({"pp": 2}, 2),
    ({"dp_replicate": 2, "dp_shard": 2}, 4),
    ({"tp": 2, "dp_shard": 2}, 4),
    ({"pp": 2, "tp": 2}, 4),
    ({"pp": 2, "dp_shard": 2, "pp_virtual": 2}, 4),
]


@pytest.mark.parametrize("dims_kw,world", CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("residual,tie", [("block", True), ("standard", False)])
def test_state_bytes_and_in_flight_are_predicted_exactly(dist_pool, dims_kw, world, residual, tie):
    cfg = _config(residual, dims_kw, tie)
    spec = ModelShape.from_config(cfg.model)
    p = cfg.parallel
    lay = Layout(tp=p.tp, pp=p.pp, v=p.pp_virtual, cp=p.cp, dp_shard=p.dp_shard,
                 dp_replicate=p.dp_replicate, ep=p.ep)  # fmt: skip
    for r in dist_pool(world).run(_measure, residual, dims_kw, tie):
        predicted = rank_state_bytes(spec, lay, r["pp"], r["tp"], r["shard"])
        measured = (r["params"], r["grads"], r["optimizer"])
        assert measured == (predicted.params, predicted.grads, predicted.optimizer), r
        if r["peak_units"] is not None:
            assert r["peak_units"] == peak_in_flight(lay.pp, lay.v, r["microbatches"])[r["pp"]]


@pytest.mark.parametrize(
    "dims_kw,world",
    [
        ({"dp_shard": 2, "ep": 2}, 2),
        ({"dp_shard": 4, "ep": 2}, 4),
        ({"dp_shard": 2, "ep": 2, "cp": 2}, 4),
        ({"dp_shard": 2}, 2),
    ],
    ids=str,
)
def test_moe_state_bytes_are_predicted_exactly(dist_pool, dims_kw, world):
    """MoE layers: the router and shared experts sharded by FSDP, the routed experts split over
    ep and FSDP-sharded on dim 1 over the other ranks holding the same experts (the other ep
    group of dp_shard = 4; the cp ranks) — or, without ep, FSDP-sharded like any weight."""
    test_state_bytes_and_in_flight_are_predicted_exactly(dist_pool, dims_kw, world, "moe", False)
