"""Sharded initialisation: a model built on the meta device and materialised by `parallelize` (each
rank draws only its own shards, what the trainer does) equals, bit for bit, the same layout built
from a fully materialised single-process model (the old path, kept as the oracle) — weights, tied
weights still one parameter, and the gradients of one step through the plan."""

from __future__ import annotations

import pytest
import torch
from harness import cached_mesh, small_config
from torch.distributed.tensor import DTensor

from depthscale.config import Config
from depthscale.model.transformer import Transformer
from depthscale.parallel.mesh import ParallelDims
from depthscale.parallel.parallelize import dp_rank_and_size, parallelize

BATCH, SEQ, VOCAB = 4, 16, 64


def _config(residual: str, dims_kw: dict, offload: bool) -> Config:
    cfg = small_config(residual, dims_kw, BATCH, SEQ, VOCAB)
    cfg.model.tie_embeddings = True
    cfg.train.offload_params = offload
    return cfg


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _build_both(residual: str, dims_kw: dict, offload: bool = False) -> dict:
    cfg = _config(residual, dims_kw, offload)
    dims = ParallelDims(**{k: v for k, v in dims_kw.items() if k != "pp_virtual"})
    mesh = cached_mesh(dims)
    torch.manual_seed(0)
    oracle = Transformer(cfg.model)
    oracle_plan = parallelize(oracle, mesh, dims, cfg)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    plan = parallelize(model, mesh, dims, cfg, device=torch.device("cpu"))
    out = {"weights": [], "grads": [], "tied": None, "meta_left": 0}
    out["meta_left"] = sum(p.is_meta for p in model.parameters()) + model.rope_cos.is_meta
    if model.tok_embeddings is not None and model.output is not None:
        out["tied"] = model.output.weight is model.tok_embeddings.weight
    rank, size = dp_rank_and_size(mesh, dims)
    rows = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    for m, p in ((oracle, oracle_plan), (model, plan)):
        p.forward_backward(m, tokens[rows, :-1], tokens[rows, 1:])
        p.reduce_gradients()
    names = [n for n, _ in oracle.named_parameters()]
    assert names == [n for n, _ in model.named_parameters()], "parameter names differ"
    for (name, a), b in zip(oracle.named_parameters(), model.parameters()):
        out["weights"].append((name, torch.equal(_local(a.detach()), _local(b.detach()))))
        same = (a.grad is None and b.grad is None) or torch.equal(_local(a.grad), _local(b.grad))
        out["grads"].append((name, same))
    return out


CASES = [
    ({"dp_shard": 2}, 2),
    ({"dp_replicate": 2}, 2),
    ({"tp": 2}, 2),
    ({"pp": 2}, 2),
    ({"cp": 2}, 2),
    ({"dp_replicate": 2, "dp_shard": 2}, 4),
    ({"tp": 2, "dp_shard": 2}, 4),
    ({"tp": 2, "dp_replicate": 2}, 4),
    ({"cp": 2, "dp_shard": 2}, 4),
    ({"pp": 2, "tp": 2}, 4),
    ({"pp": 2, "dp_shard": 2, "pp_virtual": 2}, 4),
]


@pytest.mark.parametrize("dims_kw,world", CASES, ids=lambda v: str(v))
def test_meta_device_init_equals_the_materialised_oracle(dist_pool, dims_kw, world):
    for r in dist_pool(world).run(_build_both, "block", dims_kw):
        assert r["meta_left"] == 0, "a parameter or buffer left on the meta device"
        assert [n for n, same in r["weights"] if not same] == [], "initial weights differ"
        assert [n for n, same in r["grads"] if not same] == [], "first-step gradients differ"
        assert r["tied"] in (None, True), "the tied embedding/head came out as two parameters"


def test_meta_device_init_with_parameter_offload(dist_pool):
    """FSDP2's CPU offload: parameters materialise in host memory, the rest on the device (here
    both are the CPU: the same values either way)."""
    for r in dist_pool(2).run(_build_both, "full", {"dp_shard": 2}, True):
        assert r["meta_left"] == 0
        assert all(same for _, same in r["weights"]) and all(same for _, same in r["grads"])


def test_one_process_meta_build_keeps_the_tie_and_the_values():
    """No mesh: `parallelize` materialises the whole model; it equals a model built directly."""
    cfg = _config("standard", {}, False)
    torch.manual_seed(0)
    ref = Transformer(cfg.model)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    parallelize(model, None, ParallelDims(), cfg, device=torch.device("cpu"))
    assert model.output.weight is model.tok_embeddings.weight
    for a, b in zip(ref.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)
    assert torch.equal(ref.rope_cos, model.rope_cos)
