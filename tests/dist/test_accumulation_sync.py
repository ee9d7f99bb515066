"""Gradient accumulation does not multiply the gradient reductions: DDP's all-reduce and HSDP's
cross-replica all-reduce run once per step however many micro-batches it has (FSDP's reduce-scatter
too with `parallel.fsdp_defer_reduce_scatter`), and the gradients equal one micro-batch's. (FSDP's
parameter all-gathers run per micro-batch by design, that is what keeps parameters sharded — except
under pipelines, whose stages keep them gathered for the step by default.)

Collectives are counted from the profiler's record of the c10d operations each rank issued during
one step (after a warm-up step), so DDP's C++ reducer is counted as well as FSDP2's Python calls.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.distributed as dist
from harness import cached_mesh
from torch.distributed.tensor import DTensor

from depthscale.config import Config
from depthscale.model.transformer import Transformer
from depthscale.parallel.mesh import ParallelDims
from depthscale.parallel.parallelize import parallelize

ROWS, SEQ, VOCAB = 4, 16, 64  # rows per data-parallel rank


def _step(dims_kw: dict, accum: int, defer: bool, reshard: str | bool = "auto") -> dict:
    cfg = Config()
    m = cfg.model
    m.vocab_size, m.dim, m.n_layers, m.n_heads, m.max_seq_len = VOCAB, 32, 2, 4, SEQ
    m.residual, m.attnres_n_blocks = "block", 2
    for name, value in dims_kw.items():
        setattr(cfg.parallel, name, value)
    cfg.parallel.fsdp_defer_reduce_scatter = defer
    cfg.parallel.fsdp_reshard_after_forward = reshard
    dims = ParallelDims(**dims_kw)
    mesh = cached_mesh(dims)
    cfg.train.batch_size, cfg.train.micro_batch_size = ROWS * dims.dp, ROWS // accum
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    plan = parallelize(model, mesh, dims, cfg, device=torch.device("cpu"))
    assert plan.microbatches == accum
    g = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    for _ in range(2):  # the first step warms up (lazy init, DDP's first iteration)
        for p in model.parameters():
            p.grad = None
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            plan.forward_backward(model, x, y)
            plan.reduce_gradients()
    ops = collections.Counter(
        e.name.removeprefix("c10d::").removesuffix("_")
        for e in prof.events()
        if e.name.startswith("c10d::")
    )
    grads = {
        n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }
    return {"ops": dict(ops), "grads": grads}


def _compare(results_1, results_4, bound: float = 1e-5) -> None:
    """Accumulated gradients equal one micro-batch's up to fp32 reordering (4 partial sums of 4
    rows: a few ulps of the gradient's scale; 1e-5 is two orders above what this model shows)."""
    for one, four in zip(results_1, results_4):
        assert one["grads"].keys() == four["grads"].keys()
        for name, g in one["grads"].items():
            err = (four["grads"][name] - g).abs().max() / g.abs().max().clamp(min=1e-30)
            assert err < bound, f"{name}: accumulated gradient off by {err:.3g}"


@pytest.mark.parametrize(
    "dims_kw,world,defer",
    [
        ({"dp_replicate": 2}, 2, False),
        ({"dp_replicate": 2, "dp_shard": 2}, 4, True),
        ({"dp_replicate": 2, "pp": 2}, 4, False),  # FSDP2 replicas: a shard group of one
    ],
    ids=["ddp", "hsdp-deferred-reduce-scatter", "pp-replicated"],
)
def test_collectives_per_step_do_not_grow_with_accumulation(dist_pool, dims_kw, world, defer):
    pool = dist_pool(world)
    one, four = pool.run(_step, dims_kw, 1, defer), pool.run(_step, dims_kw, 4, defer)
    for a, b in zip(one, four):
        reductions = [_reductions(r["ops"]) for r in (a, b)]
        assert reductions[0] == reductions[1], f"accum 1: {a['ops']}, accum 4: {b['ops']}"
        assert reductions[0].get("allreduce", 0) > 0
        # FSDP gathers the parameters for every micro-batch's forward and backward (ZeRO-3: that
        # is what keeps them sharded in between); only gradient reductions may not grow
        assert _gathers(b["ops"]) == 4 * _gathers(a["ops"])
    _compare(one, four)


def _reductions(ops: dict) -> dict:
    """Everything but parameter all-gathers and pipeline hops (one per micro-batch by design)."""
    return {k: v for k, v in ops.items() if "allgather" not in k and k not in ("send", "recv")}


def _gathers(ops: dict) -> int:
    return sum(v for k, v in ops.items() if "allgather" in k)


def test_hsdp_defers_only_the_cross_replica_all_reduce(dist_pool):
    """Default HSDP: the reduce-scatter inside a replica runs per micro-batch (gradients stay
    sharded), the all-reduce across replicas once per step."""
    pool = dist_pool(4)
    kw = {"dp_replicate": 2, "dp_shard": 2}
    one, four = pool.run(_step, kw, 1, False), pool.run(_step, kw, 4, False)
    for a, b in zip(one, four):
        assert a["ops"]["allreduce"] == b["ops"]["allreduce"]
        scatters = [sum(v for k, v in r["ops"].items() if "reduce_scatter" in k) for r in (a, b)]
        assert scatters[0] > 0 and scatters[1] == 4 * scatters[0], scatters
    _compare(one, four)


@pytest.mark.parametrize("reshard", ["auto", True], ids=["auto-keeps", "zero3"])
def test_pipeline_stages_keep_gathered_parameters_for_the_step(dist_pool, reshard):
    """pp × dp_shard: by default a stage gathers each unit once per step however many micro-batches
    run through it (resharded after its last backward); `fsdp_reshard_after_forward = true`
    gathers twice per micro-batch (ZeRO-3). Gradients equal one micro-batch's either way."""
    pool = dist_pool(4)
    kw = {"pp": 2, "dp_shard": 2}
    one, four = pool.run(_step, kw, 1, False, reshard), pool.run(_step, kw, 4, False, reshard)
    for a, b in zip(one, four):
        assert _reductions(a["ops"]) == _reductions(b["ops"])
        assert _gathers(a["ops"]) > 0
        grows = 1 if reshard == "auto" else 4
        assert _gathers(b["ops"]) == grows * _gathers(a["ops"]), (a["ops"], b["ops"])
    _compare(one, four)
