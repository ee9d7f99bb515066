"""The planner's MoE layouts: model states per rank in closed form against the exact placement,
all-to-all bytes against the op-by-op count (itself checked on gloo), the expert GEMMs' efficiency,
expert parallelism in the search, and `depthscale plan` on an MoE config."""

from __future__ import annotations

import json

import pytest

from depthscale.cli import main
from depthscale.config import ModelConfig
from depthscale.plan import experts
from depthscale.plan.comm import rank_payload
from depthscale.plan.estimate import Workload, estimate
from depthscale.plan.frameworks import DEPTHSCALE
from depthscale.plan.hardware import PRESETS
from depthscale.plan.layout import Layout
from depthscale.plan.memory import rank_params
from depthscale.plan.report import PlanRequest, run
from depthscale.plan.search import search
from depthscale.plan.states import rank_state_bytes
from depthscale.shape import ModelShape

H100 = PRESETS["h100"]


def _spec(**kw) -> ModelShape:
    cfg = dict(
        vocab_size=1024, dim=256, n_layers=4, n_heads=4, n_kv_heads=2, residual="block",
        attnres_n_blocks=2, moe_experts=8, moe_top_k=2, moe_ffn_dim=128, moe_shared_experts=1,
        moe_first_dense=1, moe_balance="aux_loss",
    )  # fmt: skip
    return ModelShape.from_config(ModelConfig(**(cfg | kw)))


LAYOUTS = [
    Layout(dp_shard=4),
    Layout(dp_shard=4, ep=2),
    Layout(dp_shard=4, ep=4),
    Layout(pp=2, dp_shard=2, ep=2),
    Layout(tp=2, dp_shard=2, ep=2),
    Layout(cp=2, dp_shard=2, ep=2, dp_replicate=2),
]


@pytest.mark.parametrize("lay", LAYOUTS, ids=Layout.label)
def test_closed_form_states_are_the_exact_placement(lay):
    """What the search charges for model states (FSDP's share of the dense weights; under
    expert parallelism E/ep experts, FSDP-sharded over the (dp_shard / ep) × cp ranks holding the
    same ones) equals `plan/states.py`'s element-exact placement — which gloo ranks' allocations check — up to what the closed form rounds: FSDP's
    uneven chunks, and the router and norms it divides by tp though tp replicates them."""
    spec = _spec()
    closed = rank_params(spec, lay).states(lay)
    exact = rank_state_bytes(spec, lay, 0, 0, 0).params / 4
    assert closed == pytest.approx(exact, rel=0.01)


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("lay", [Layout(dp_shard=4, ep=2), Layout(tp=2, pp=2, dp_shard=2, ep=2)])
def test_all_to_all_bytes_are_the_op_by_op_count(lay, recompute):
    """The estimate's all-to-all bytes per step are `plan.comm`'s (counted on gloo by
    tests/dist/test_plan_comm.py), for every layout and recompute mode."""
    lay = lay.with_(recompute=recompute)
    spec, seq, batch = _spec(), 64, 16
    payload = rank_payload(spec, lay, seq, batch, bf16=True)
    est = estimate(Workload(spec, seq, batch), H100, lay, DEPTHSCALE, lay.world)
    assert est.ok, est.reason
    assert est.comm["ep"] == payload["all_to_all", "dp_shard"] > 0


def test_fine_grained_experts_cost_more_at_equal_flops():
    """Splitting experts finer (more of them, more per token, each narrower: the same FLOPs)
    shrinks every group of the grouped GEMM, and the GEMM efficiency follows the smallest
    dimension: the FFN takes longer."""
    coarse = _spec(moe_experts=8, moe_top_k=2, moe_ffn_dim=1024, dim=2048, moe_shared_experts=0)
    fine = coarse.with_(n_experts=64, moe_top_k=16, moe_ffn=128)
    lay = Layout()
    t_coarse = experts.ffn_gemm_seconds(coarse, H100, lay, 8192, "bfloat16")
    t_fine = experts.ffn_gemm_seconds(fine, H100, lay, 8192, "bfloat16")
    assert fine.layer_matmul_flops(1, 1) == coarse.layer_matmul_flops(1, 1) + 2 * 2048 * 56
    assert t_fine > 1.5 * t_coarse


@pytest.mark.parametrize("ep", [2, 8])
def test_expert_parallelism_trades_fsdp_gathers_for_all_to_alls(ep):
    """Under ep a rank keeps the same share of the experts' states as FSDP alone gives it (E/ep
    experts over dp_shard / ep ranks), but gathers them over dp_shard / ep ranks (at ep =
    dp_shard not at all): fewer data-parallel bytes, and the rows travel instead; the exchanges
    are on the critical path (the layers take at least their time)."""
    spec, seq, batch = _spec(dim=1024, moe_ffn_dim=512), 2048, 64
    w = Workload(spec, seq, batch)
    fsdp = estimate(w, H100, Layout(dp_shard=8, micro_batch=2), DEPTHSCALE, 8)
    split = estimate(w, H100, Layout(dp_shard=8, micro_batch=2, ep=ep), DEPTHSCALE, 8)
    assert fsdp.ok and split.ok
    assert split.memory["weights"] == pytest.approx(fsdp.memory["weights"], rel=1e-9)
    assert split.comm["dp"] < fsdp.comm["dp"] and split.comm["ep"] > 0 == fsdp.comm["ep"]
    a2a_f, a2a_b = experts.all_to_all_seconds(spec, H100, split.layout, 2 * seq, 2)
    per_layer = (a2a_f + a2a_b) * len(spec.moe_layers) / spec.n_layers
    assert split.times["layer_forward_s"] + split.times["layer_backward_s"] >= per_layer


def test_search_tries_every_expert_split():
    """The search tries every ep that divides dp_shard and the experts (fitting layouts at each);
    an ep that divides neither is named when asked for."""
    spec = _spec(dim=2048, n_layers=8, moe_experts=64, moe_top_k=4, moe_ffn_dim=1408)
    w = Workload(spec, 4096, 256)
    result = search(w, H100, DEPTHSCALE, 16)
    eps = {e.layout.ep for e in result.ranked}
    assert eps >= {1, 2, 4, 8, 16}
    bad = estimate(w, H100, Layout(dp_shard=16, ep=3), DEPTHSCALE, 16)
    assert not bad.ok and "parallel.ep=3 must divide parallel.dp_shard=16" in bad.reason


def test_cli_plans_an_moe_config(tmp_path, capsys):
    """`depthscale plan` on an MoE config: total and active parameters in the header, ep in the
    layouts and in the printed train command, all-to-all bytes per group in --json; the
    published-GPT frameworks refuse an MoE model in one line."""
    cfg = tmp_path / "moe.toml"
    cfg.write_text(
        "[model]\nvocab_size = 32000\ndim = 1024\nn_layers = 8\nn_heads = 16\nresidual = 'block'\n"
        "attnres_n_blocks = 4\nmoe_experts = 16\nmoe_top_k = 2\nmoe_ffn_dim = 704\n"
    )
    args = ["plan", "-c", str(cfg), "--gpus", "16", "--seq", "2048", "--batch", "64"]
    assert main([*args, "--layout", "fsdp=16,ep=4,mb=2"]) == 0
    out = capsys.readouterr().out
    assert "active: top-2 of 16 experts in 8 layers" in out and "--parallel.ep 4" in out
    assert main([*args, "--layout", "fsdp=16,ep=4,mb=2", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["layouts"][0]
    assert row["ok"] and row["comm_gb"]["ep"] > 0
    assert row["bytes_per_group_gb"]["all_to_all dp_shard"] == pytest.approx(row["comm_gb"]["ep"])
    assert main([*args, "--framework", "megatron"]) == 2
    err = capsys.readouterr().err
    assert "not an MoE model" in err and "allowed: --framework depthscale" in err


def test_plan_request_on_an_moe_model_is_planned():
    report = run(PlanRequest(spec=_spec(), gpus=8, cluster="h100", seq=256, batch=32, top=3))
    assert report["model"]["active_params"] < report["model"]["params"]
    assert report["layouts"] and all(r["ok"] for r in report["layouts"])
