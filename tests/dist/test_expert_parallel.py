"""Expert parallelism (`parallel.ep`, `parallel/expert_parallel.py`): a training step of an MoE
model through the trainer's `ParallelPlan` equals one process's — loss, every gradient (the
experts' gathered from their ep shards), the routing metrics and the aux-loss-free bias after the
step — with ep = 2 and ep = 4 over FSDP, ep = 2 inside dp_shard = 4 (the experts FSDP-sharded over
the other ep group; with HSDP, slow), ep = 2 beside replicas, ep = 2 × pp = 2 with block AttnRes,
ep = 2 × cp = 2 (FSDP over the cp ranks) and ep = 2 × tp = 2 (the auxiliary losses over whole
rows; under tp the shared experts sharded like a dense FFN, the routed ones whole on each tp rank).
With `moe_balance_scope = "global_batch"` the balance loss is one process's over the same
micro-batch steps at dp_shard = 2, ep = 2 with accumulation, × cp = 2, × pp = 2, and dp × tp.

fp32 tolerances (tests/tolerances.py): the layouts reorder sums (reduce-scatters, the experts'
gradient sums over the tokens other ranks sent, micro-batch accumulation), bounded by
`fp32_model_bound` of the model on the batch.
"""

import pytest
import torch
import torch.distributed as dist
from harness import cached_mesh, small_config
from torch.distributed.tensor import DTensor

from depthscale.model.moe import MoE
from depthscale.model.transformer import Transformer
from depthscale.parallel.expert_parallel import regroup
from depthscale.parallel.mesh import ParallelDims
from depthscale.parallel.parallelize import dp_rank_and_size, parallelize
from tolerances import check, fp32_model_bound, scaled_err

BATCH, SEQ = 8, 16


def _config(dims_kw: dict, balance: str, scope: str = "micro_batch", micro: int = 1):
    cfg = small_config("block", dims_kw, batch=BATCH, seq=SEQ)
    cfg.train.micro_batch_size = micro
    m = cfg.model
    m.moe_experts, m.moe_top_k, m.moe_ffn_dim, m.moe_balance = 8, 2, 24, balance
    m.moe_z_loss, m.moe_first_dense, m.moe_shared_experts = 1e-3, 1, 1
    m.moe_balance_scope = scope
    return cfg


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _micro_steps(dp: int, micro: int) -> torch.Tensor:
    """The batch's rows in the order one process must take them for its micro-batches of
    dp·micro rows to be the layout's micro-batch steps: step j = micro-batch j of every
    data-parallel rank (rank r trains rows [r·B/dp, (r+1)·B/dp), `micro` at a time)."""
    per_rank = BATCH // dp
    return torch.arange(BATCH).view(dp, per_rank // micro, micro).transpose(0, 1).flatten()


def _peaked(model: Transformer) -> Transformer:
    """Router weights × 20 and the balance loss at 0.5: at initialisation every expert scores
    about 1/E, and any counts give about the same loss; peaked scores make the loss depend on
    which tokens the counts are taken over, and weigh on the router's gradients."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, MoE):
                m.router.weight.mul_(20.0)
                m.router.aux_coef = 0.5
    return model


def _step(
    dims_kw: dict,
    balance: str,
    recompute: str = "none",
    scope: str = "micro_batch",
    micro: int = 1,
    peaked: bool = False,
):
    """One step of the layout and of one process on the same batch → (loss, one process's loss,
    worst gradient error, bias error, routing metrics error, the experts' placements). With
    `micro` > 1 rows per micro-batch, one process's micro-batches are the layout's micro-batch
    steps (`_micro_steps`: what global-batch balance counts over); with 1, single rows."""
    dims = ParallelDims(**{k: v for k, v in dims_kw.items() if k != "ep"})
    dims = dims.validate(dist.get_world_size())
    cfg = _config(dims_kw, balance, scope, micro)
    one = _config({}, balance, scope, micro * dims.dp if micro > 1 else 1)
    build = _peaked if peaked else lambda model: model
    torch.manual_seed(0)
    ref = build(Transformer(one.model))
    ref_plan = parallelize(ref, None, ParallelDims(), one)
    torch.manual_seed(0)
    model = build(Transformer(cfg.model))
    model.set_recompute(recompute)
    plan = parallelize(model, cached_mesh(dims), dims, cfg)
    g = torch.Generator().manual_seed(1)
    tokens, labels = torch.randint(0, 64, (2, BATCH, SEQ), generator=g).unbind(0)
    rank, size = dp_rank_and_size(cached_mesh(dims), dims)
    rows = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
    order = _micro_steps(size, micro) if micro > 1 else torch.arange(BATCH)
    ref_loss = ref_plan.forward_backward(ref, tokens[order], labels[order])
    ref_metrics = ref_plan.finish_step()
    share = plan.forward_backward(model, tokens[rows], labels[rows])
    plan.reduce_gradients()
    metrics = plan.finish_step()
    dist.all_reduce(share)
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    worst = max(
        scaled_err(_full(p.grad), ref_params[name].grad) for name, p in model.named_parameters()
    )
    biases = [
        scaled_err(
            layer.feed_forward.router.expert_bias, ref.layers[i].feed_forward.router.expert_bias
        )
        for i, layer in model.layers.items()
        if isinstance(layer.feed_forward, MoE)
    ]
    metric_err = max(
        abs(float(metrics[k]) - float(v)) / max(abs(float(v)), 1e-6) for k, v in ref_metrics.items()
    )
    expert = next(m.experts.w_up for m in model.modules() if isinstance(m, MoE))
    where = dict(zip(expert.device_mesh.mesh_dim_names, map(str, expert.placements)))
    errs = (worst, max(biases), metric_err)
    return share.item() / dist.get_world_size(), ref_loss.item(), *errs, where


EP = {"ep": "S(0)"}
FSDP_EP = {"expert_shard": "S(1)", **EP}


@pytest.mark.parametrize(
    "dims_kw,balance,world,placed",
    [
        ({"dp_shard": 2, "ep": 2}, "aux_loss", 2, EP),
        ({"dp_shard": 4, "ep": 4}, "bias", 4, EP),
        ({"dp_shard": 4, "ep": 2}, "aux_loss", 4, FSDP_EP),
        ({"dp_shard": 2, "ep": 2, "pp": 2}, "bias", 4, EP),
        ({"dp_shard": 2, "ep": 2, "cp": 2}, "aux_loss", 4, FSDP_EP),
        ({"dp_shard": 2, "ep": 2, "tp": 2}, "aux_loss", 4, EP),
        ({"dp_shard": 2, "ep": 2, "dp_replicate": 2}, "bias", 4, EP),
        pytest.param(
            {"dp_shard": 4, "ep": 2, "dp_replicate": 2},
            "aux_loss",
            8,
            {"expert_replicate": "R", **FSDP_EP},
            marks=pytest.mark.slow,
        ),
    ],
    ids=[
        "ep2",
        "ep4-bias",
        "ep2-in-dp4",
        "ep2-pp2-bias",
        "ep2-cp2",
        "ep2-tp2",
        "ep2-dp2",
        "ep2-in-dp4-hsdp2",
    ],  # fmt: skip
)
def test_an_expert_parallel_step_equals_one_process(dist_pool, dims_kw, balance, world, placed):
    """And the experts are placed as expected: split over ep, and sharded by FSDP over the other
    ranks holding the same experts where there are any (HSDP: replicated across replicas)."""
    bound = fp32_model_bound(_config(dims_kw, balance).model, SEQ, BATCH)
    for loss, ref_loss, worst, bias, metric_err, where in dist_pool(world).run(
        _step, dims_kw, balance
    ):
        check(abs(loss - ref_loss) / ref_loss, bound, "loss")
        check(worst, bound, "worst gradient")
        check(bias, bound, "balancing bias")
        check(metric_err, bound, "routing metrics")
        assert where == placed


@pytest.mark.parametrize(
    "dims_kw,micro,world",
    [
        ({"dp_shard": 2}, 4, 2),
        ({"dp_shard": 2, "ep": 2}, 2, 2),
        ({"dp_shard": 2, "ep": 2, "cp": 2}, 2, 4),
        ({"dp_shard": 2, "tp": 2}, 4, 4),
        ({"dp_shard": 2, "ep": 2, "pp": 2}, 2, 4),
    ],
    ids=["dp2", "ep2-accumulation2", "ep2-cp2-accumulation2", "dp2-tp2", "ep2-pp2"],
)
def test_global_batch_balance_is_one_process_on_the_same_micro_batch_steps(
    dist_pool, dims_kw, micro, world
):
    """`moe_balance_scope = "global_batch"`: the balance loss's expert counts summed over every
    rank of a micro-batch step — the data-parallel ranks (dp2: the issue's one process against
    dp_shard = 2, the whole batch one step), the ep group, the cp and tp sequence shards, within
    each pipeline stage — give one process's loss, gradients and routing metrics on the same
    steps, under gradient accumulation too. At dp2 the per-micro-batch default (each rank's 4
    rows balanced on their own) gives another auxiliary loss and router gradient: what the
    scope is for, and what the test tells apart."""
    bound = fp32_model_bound(_config(dims_kw, "aux_loss").model, SEQ, BATCH)
    scope = "global_batch"
    for loss, ref_loss, worst, _, metric_err, _ in dist_pool(world).run(
        _step, dims_kw, "aux_loss", "none", scope, micro, True
    ):
        check(abs(loss - ref_loss) / ref_loss, bound, "loss")
        check(worst, bound, "worst gradient")
        check(metric_err, bound, "routing metrics and auxiliary loss")
    if dims_kw == {"dp_shard": 2}:
        for _, _, worst, _, metric_err, _ in dist_pool(world).run(
            _step, dims_kw, "aux_loss", "none", "micro_batch", micro, True
        ):
            assert metric_err > 10 * bound and worst > 10 * bound


def test_rows_arriving_by_source_are_regrouped_by_expert():
    counts = torch.tensor([[2, 0, 1], [1, 3, 0]])  # from source 0: 2 rows for expert 0, 1 for 2
    # arrival: s0e0 s0e0 s0e2 | s1e0 s1e1 s1e1 s1e1 → by expert: e0 (s0, s0, s1), e1 (s1 ×3), e2
    assert regroup(counts).tolist() == [0, 1, 3, 4, 5, 6, 2]


def test_fsdp_sharded_experts_under_selective_recompute_equal_one_process(dist_pool):
    """The experts' FSDP unit runs its hooks inside the layer's selective checkpoint (it is
    nested in the layer): the recomputation replays the same model ops (the profiler's
    annotations, which FSDP's hooks issue a different number of times, are left out of the
    replay: `model/recompute.py`), and the step equals one process's."""
    dims_kw = {"dp_shard": 4, "ep": 2}
    bound = fp32_model_bound(_config(dims_kw, "aux_loss").model, SEQ, BATCH)
    for loss, ref_loss, worst, *_, where in dist_pool(4).run(
        _step, dims_kw, "aux_loss", "selective"
    ):
        check(abs(loss - ref_loss) / ref_loss, bound, "loss")
        check(worst, bound, "worst gradient")
        assert where == FSDP_EP
