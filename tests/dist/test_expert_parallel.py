"""Expert parallelism (`parallel.ep`, `parallel/expert_parallel.py`): a training step of an MoE
model through the trainer's `ParallelPlan` equals one process's — loss, every gradient (the
experts' gathered from their ep shards), the routing metrics and the aux-loss-free bias after the
step — with ep = 2 and ep = 4 over FSDP, ep = 2 inside dp_shard = 4 (the experts FSDP-sharded over
the other ep group; with HSDP, slow), ep = 2 beside replicas, ep = 2 × pp = 2 with block AttnRes,
ep = 2 × cp = 2 (FSDP over the cp ranks) and ep = 2 × tp = 2 (the auxiliary losses over whole
rows; under tp the shared experts sharded like a dense FFN, the routed ones whole on each tp rank).

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


def _config(dims_kw: dict, balance: str):
    cfg = small_config("block", dims_kw, batch=BATCH, seq=SEQ)
    m = cfg.model
    m.moe_experts, m.moe_top_k, m.moe_ffn_dim, m.moe_balance = 8, 2, 24, balance
    m.moe_z_loss, m.moe_first_dense, m.moe_shared_experts = 1e-3, 1, 1
    return cfg


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _step(dims_kw: dict, balance: str, recompute: str = "none"):
    dims = ParallelDims(**{k: v for k, v in dims_kw.items() if k != "ep"})
    dims = dims.validate(dist.get_world_size())
    cfg = _config(dims_kw, balance)
    one = _config({}, balance)
    torch.manual_seed(0)
    ref = Transformer(one.model)
    ref_plan = parallelize(ref, None, ParallelDims(), one)
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    model.set_recompute(recompute)
    plan = parallelize(model, cached_mesh(dims), dims, cfg)
    g = torch.Generator().manual_seed(1)
    tokens, labels = torch.randint(0, 64, (2, BATCH, SEQ), generator=g).unbind(0)
    rank, size = dp_rank_and_size(cached_mesh(dims), dims)
    rows = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
    ref_loss = ref_plan.forward_backward(ref, tokens, labels)
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
