"""`plan.comm` against the collectives and messages real ranks issue (gloo): every
`torch.distributed` call of one step's forward, backward and gradient reduction is counted per
operation and process group — tp, pp with the AttnRes cache, cp ring attention, FSDP, HSDP, with
gradients reduced in fp32 or bf16, MoE expert parallelism (with replicas, recompute, cp, tp) — and
must equal the planner's bytes exactly, on every rank (all-to-all bytes, which follow each rank's
routing, summed over the ranks). (DDP's all-reduce runs inside its C++
reducer, out of Python's sight; the planner's formula for it is not counted here.)"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from harness import cached_mesh

from depthscale.config import Config
from depthscale.model.transformer import Transformer
from depthscale.parallel.comm_count import counting_payloads
from depthscale.parallel.mesh import ParallelDims
from depthscale.parallel.parallelize import dp_rank_and_size, parallelize
from depthscale.plan.comm import DIMS, rank_payload
from depthscale.plan.layout import Layout
from depthscale.shape import ModelShape

BATCH, SEQ, VOCAB = 8, 16, 70


def _config(residual: str, dims_kw: dict, recompute: str) -> Config:
    """`residual` 'moe': block AttnRes with MoE FFNs after a dense first layer (4 experts, top 2,
    a shared expert, aux and z-loss)."""
    moe = residual == "moe"
    residual = "block" if moe else residual
    cfg = Config()
    m = cfg.model
    if moe:
        m.moe_experts, m.moe_top_k, m.moe_ffn_dim, m.moe_shared_experts = 4, 2, 24, 1
        m.moe_first_dense, m.moe_z_loss = 1, 1e-3
    m.vocab_size, m.dim, m.n_layers, m.n_heads, m.n_kv_heads = VOCAB, 40, 3, 4, 2
    m.ffn_dim, m.max_seq_len, m.residual, m.attnres_n_blocks = 42, SEQ, residual, 2
    cfg.data.seq_len = SEQ
    cfg.train.batch_size, cfg.train.micro_batch_size = BATCH, 1
    cfg.train.recompute = recompute
    for name, value in dims_kw.items():
        setattr(cfg.parallel, name, value)
    return cfg.validate()


def _measure(residual: str, dims_kw: dict, recompute: str) -> dict:
    cfg = _config(residual, dims_kw, recompute)
    dims = ParallelDims(**{k: v for k, v in dims_kw.items() if k in DIMS})
    mesh = cached_mesh(dims)
    coords = {int(r): c for c, r in zip(_coordinates(mesh.mesh.shape), mesh.mesh.flatten())}

    def label(group) -> str:
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        spans = [d for i, d in enumerate(mesh.mesh_dim_names)
                 if len({coords[r][i] for r in ranks}) > 1]  # fmt: skip
        return "+".join(d for d in DIMS if d in spans)

    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    model.set_recompute(recompute)
    plan = parallelize(model, mesh, dims, cfg, device=torch.device("cpu"))
    rank, size = dp_rank_and_size(mesh, dims)
    rows = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    plan.forward_backward(model, tokens[rows, :-1], tokens[rows, 1:])  # first step: set-up
    plan.reduce_gradients()
    for p in model.parameters():
        p.grad = None
    with counting_payloads(label) as log:
        plan.forward_backward(model, tokens[rows, :-1], tokens[rows, 1:])
        plan.reduce_gradients()
    return {
        "log": dict(log),
        "pp": mesh.get_local_rank("pp"),
        "cp": mesh.get_local_rank("cp"),
        "shard": mesh.get_local_rank("dp_shard") * dims.cp + mesh.get_local_rank("cp"),
        "micro_batch": BATCH // (dims.dp * plan.microbatches),
    }


def _coordinates(shape):
    import itertools

    return list(itertools.product(*(range(n) for n in shape)))


CASES = [
    ({"tp": 2}, 2, "block", "none"),
    ({"tp": 2}, 2, "standard", "selective"),
    ({"pp": 2}, 2, "block", "none"),
    ({"pp": 2, "pp_virtual": 2}, 2, "block", "none"),
    ({"pp": 2, "pp_virtual": 2}, 2, "full", "none"),
    ({"cp": 2}, 2, "block", "none"),
    ({"dp_shard": 2}, 2, "block", "none"),
    ({"cp": 4}, 4, "standard", "none"),
    ({"dp_replicate": 2, "dp_shard": 2}, 4, "block", "none"),
    ({"tp": 2, "pp": 2}, 4, "block", "full"),
    ({"pp": 2, "dp_shard": 2}, 4, "block", "none"),
    ({"pp": 2, "dp_shard": 2, "fsdp_reshard_after_forward": True}, 4, "block", "none"),
    ({"dp_shard": 2, "grad_reduce_dtype": "bfloat16"}, 2, "block", "none"),
    ({"dp_replicate": 2, "dp_shard": 2, "grad_reduce_dtype": "bfloat16"}, 4, "standard", "none"),
    ({"tp": 2, "dp_shard": 2}, 4, "block", "none"),
    ({"dp_shard": 2, "ep": 2}, 2, "moe", "none"),
    ({"dp_shard": 4, "ep": 2}, 4, "moe", "selective"),
    ({"dp_shard": 2, "ep": 2, "cp": 2}, 4, "moe", "none"),
    ({"dp_shard": 2, "ep": 2, "tp": 2}, 4, "moe", "none"),
    # Ulysses (its all-to-alls over the cp group) and hybrid (2 × 2: all-to-alls and a ring)
    ({"cp": 2, "cp_ulysses": 2}, 2, "block", "none"),
    ({"cp": 4, "cp_ulysses": 4}, 4, "standard", "none"),
    ({"cp": 4, "cp_ulysses": 2}, 4, "block", "none"),
    ({"cp": 2, "cp_ulysses": 2, "tp": 2}, 4, "block", "none"),
]


@pytest.mark.parametrize("dims_kw,world,residual,recompute", CASES, ids=str)
def test_bytes_per_group_are_predicted_exactly(dist_pool, dims_kw, world, residual, recompute):
    cfg = _config(residual, dims_kw, recompute)
    spec = ModelShape.from_config(cfg.model)
    p = cfg.parallel
    routed = Counter()  # all-to-all bytes depend on the routing per rank, not per ep group
    for r in dist_pool(world).run(_measure, residual, dims_kw, recompute):
        lay = Layout(tp=p.tp, pp=p.pp, v=p.pp_virtual, cp=p.cp, dp_shard=p.dp_shard,
                     dp_replicate=p.dp_replicate, micro_batch=r["micro_batch"],
                     recompute=recompute, zero3=p.fsdp_reshard_after_forward is True,
                     ep=p.ep, ulysses=p.cp_ulysses)  # fmt: skip
        reduce_bytes = 2 if p.grad_reduce_dtype == "bfloat16" else 4
        predicted = rank_payload(
            spec, lay, SEQ, BATCH, False, r["pp"], r["cp"], r["shard"], reduce_bytes
        )
        expected = {k: v for k, v in predicted.items() if k[0] != "all_reduce(ddp)" and v}
        for key in [k for k in expected if k[0] == "all_to_all" and k[1] != "cp"]:
            routed["predicted"] += expected.pop(key)
            routed["counted"] += r["log"].pop(key)
        assert r["log"] == expected, (r["pp"], r["cp"])
    assert routed["counted"] == routed["predicted"]
