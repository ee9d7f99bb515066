"""`depthscale plan` with optim.name = "muon": states, redistribution bytes and Newton–Schulz
time from plan/muon_states (which tests/dist/test_muon_layouts.py checks against the optimizer);
AdamW's plan untouched; a layout Muon's model does not cover is one line, not a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from depthscale.cli import main
from depthscale.config import ModelConfig
from depthscale.plan.comm import wire_bytes
from depthscale.plan.hardware import PRESETS
from depthscale.plan.layout import parse_layout
from depthscale.plan.muon_states import MuonPlan, muon_plan, muon_state_bytes, muon_step_work
from depthscale.plan.report import PlanRequest, run
from depthscale.shape import ModelShape

H100 = PRESETS["h100"]
SPEC = ModelShape.from_config(
    ModelConfig(
        vocab_size=1000,
        dim=256,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        residual="block",
        attnres_n_blocks=2,
    )  # fmt: skip
)
LAYOUT = "tp=2,pp=2,fsdp=2,mb=2"  # tp, shard and both together split matrices; odd vocab: ragged


def _request(optimizer: str, layout: str = LAYOUT) -> PlanRequest:
    return PlanRequest(SPEC, gpus=8, cluster="h100", seq=256, batch=8, layout=layout,
                       optimizer=optimizer, muon_ns_steps=4)  # fmt: skip


def test_muon_plan_reports_muon_states_numbers():
    muon = run(_request("muon"))["layouts"][0]
    adamw = run(_request("adamw"))["layouts"][0]
    lay = parse_layout(LAYOUT)
    ranks = [(p, t, r) for p in range(lay.pp) for t in range(lay.tp) for r in range(lay.shard)]
    work = [muon_step_work(SPEC, lay, *rank, ns_bytes=2, ns_steps=4) for rank in ranks]
    states = max(muon_state_bytes(SPEC, lay, *rank).optimizer for rank in ranks)
    sent = max(w["to_owners"] + w["from_owners"] for w in work)
    flops = max(w["ns_flops"] for w in work)
    assert muon["ok"] and sent > 0 and flops > 0
    assert muon["muon"]["redistribution_bytes"] == sent
    assert muon["muon"]["ns_flops"] == flops
    assert muon["memory_gib"]["optimizer"] * 2**30 == pytest.approx(states, rel=1e-12)
    assert muon["comm_gb"]["muon"] * 1e9 == pytest.approx(sent, rel=1e-12)
    assert muon["bytes_per_group_gb"]["muon_all_to_all dp_shard+tp"] * 1e9 == pytest.approx(sent)
    # the all-to-all's payload is what leaves the rank: all of it on the wire
    assert (muon["wire_gb"] - adamw["wire_gb"]) * 1e9 == pytest.approx(sent, rel=1e-9)
    # Newton–Schulz at the bf16 GEMM rate and the two all-to-alls over the 4 ranks splitting the
    # matrices (tp 2 × fsdp 2, one node), added to AdamW's step (nothing else changes)
    ns_s = flops / (H100.peak("bfloat16") * H100.gemm_efficiency)
    a2a_s = H100.op_time("all_to_all", sent * 4 / 3, 4, False, calls=2)
    assert muon["times_s"]["muon_ns_s"] == pytest.approx(ns_s, rel=1e-12)
    assert muon["times_s"]["muon_all_to_all_s"] == pytest.approx(a2a_s, rel=1e-12) and a2a_s > 0
    assert muon["step_s"] == pytest.approx(adamw["step_s"] + ns_s + a2a_s, rel=1e-12)
    # one fp32 momentum per matrix, not two moments: fewer optimizer bytes than AdamW
    assert muon["memory_gib"]["optimizer"] < adamw["memory_gib"]["optimizer"]
    assert {k: v for k, v in muon["memory_gib"].items() if k != "optimizer"} == {
        k: v for k, v in adamw["memory_gib"].items() if k != "optimizer"
    }


def test_adamw_plan_is_unchanged():
    """The AdamW report carries no Muon key and its wire bytes are rank_payload's alone."""
    row = run(_request("adamw"))["layouts"][0]
    assert "muon" not in row and "muon" not in row["comm_gb"] and "muon_ns_s" not in row["times_s"]
    assert not any(k.startswith("muon") for k in row["bytes_per_group_gb"])
    sizes = {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2}
    payload = {tuple(k.split(" ")): gb * 1e9 for k, gb in row["bytes_per_group_gb"].items()}
    assert row["wire_gb"] * 1e9 == pytest.approx(wire_bytes(payload, sizes))


def test_cli_prints_muon_and_refuses_an_unmodelled_layout_in_one_line(tmp_path, capsys):
    cfg = tmp_path / "moe.toml"
    cfg.write_text(
        "[model]\nvocab_size = 1024\ndim = 256\nn_layers = 4\nn_heads = 4\nresidual = 'block'\n"
        "attnres_n_blocks = 2\nmoe_experts = 8\nmoe_top_k = 2\nmoe_ffn_dim = 128\n"
        "[optim]\nname = 'muon'\n"
    )
    args = ["plan", "-c", str(cfg), "--gpus", "8", "--seq", "256", "--batch", "16"]
    assert main([*args, "--layout", "fsdp=8,ep=8,mb=2"]) == 0
    out = capsys.readouterr().out
    assert "optimizer: muon, NS " in out and " ms, redistribution " in out
    # experts sharded over an expert-shard group (dp_shard 8 > ep 2): not modelled
    assert main([*args, "--layout", "fsdp=8,ep=2,mb=2"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "optim.name muon" in err and "expert-sharded experts" in err
    # the search keeps such layouts with AdamW's estimate and says so
    assert main([*args, "--json", "--top", "50"]) == 0
    rows = json.loads(capsys.readouterr().out)["layouts"]
    assert any("redistribution_bytes" in r["muon"] for r in rows)
    assert any("not_modelled" in r["muon"] for r in rows)
    assert all("not_modelled" in r["muon"] for r in rows if "ep=2," in r["label"] + ",")


def test_search_ranks_with_muons_states_and_time():
    """The search estimates every layout with Muon's plan: its smaller optimizer states fit
    layouts AdamW's run out of memory in (one such layout, asked for with --layout, fits too),
    and the rows are ranked by the step Muon takes."""
    spec = ModelShape.from_config(
        ModelConfig(
            vocab_size=32000,
            dim=4096,
            n_layers=24,
            n_heads=32,
            n_kv_heads=8,
            residual="block",
            attnres_n_blocks=4,
        )
    )

    def plan(optimizer: str, layout: str | None = None, top: int = 200) -> dict:
        return run(PlanRequest(spec, gpus=2, cluster="h100", seq=1024, batch=8, layout=layout,
                               optimizer=optimizer, top=top))  # fmt: skip

    muon, adamw = plan("muon"), plan("adamw")
    assert muon["fitting"] > adamw["fitting"]
    steps = [r["step_s"] for r in muon["layouts"]]
    assert steps == sorted(steps) and all("ns_s" in r["muon"] for r in muon["layouts"])
    only_muon = {r["label"] for r in muon["layouts"]} - {r["label"] for r in adamw["layouts"]}
    label = sorted(only_muon)[0]
    assert not plan("adamw", label)["layouts"][0]["ok"]
    assert plan("muon", label)["layouts"][0]["ok"]


@pytest.mark.parametrize(
    "layout", ["tp=4,fsdp=3,mb=1", "pp=3,fsdp=2,mb=1", "tp=2,pp=2,fsdp=2,mb=2"]
)
def test_muon_plan_is_the_per_rank_maximum(layout):
    """`muon_plan`'s sums by kind of parameter equal the per-rank functions' maxima (a vocabulary
    of 5 over tp = 4: shards of 2, 2, 1 and 0 rows)."""
    spec = ModelShape.from_config(ModelConfig(vocab_size=5, dim=64, n_layers=3, n_heads=4))
    lay = parse_layout(layout)
    ranks = [(p, t, r) for p in range(lay.pp) for t in range(lay.tp) for r in range(lay.shard)]
    work = [muon_step_work(spec, lay, *rank, ns_bytes=2) for rank in ranks]
    assert muon_plan(spec, lay) == MuonPlan(
        max(muon_state_bytes(spec, lay, *rank).optimizer for rank in ranks),
        max(w["to_owners"] + w["from_owners"] for w in work),
        max(w["ns_flops"] for w in work),
    )


def test_qk_clip_rejects_context_parallel_layouts(tmp_path, capsys):
    """optim.qk_clip_tau > 0: the trainer refuses cp > 1, so the planner neither ranks nor prints
    a command for such a layout (before: cp rows were recommended that the trainer refused)."""
    cfg = tmp_path / "qk.toml"
    cfg.write_text(
        "[model]\nvocab_size = 1024\ndim = 256\nn_layers = 4\nn_heads = 4\n"
        "[optim]\nname = 'muon'\nqk_clip_tau = 50.0\n"
    )
    args = ["plan", "-c", str(cfg), "--gpus", "8", "--seq", "8192", "--batch", "16"]
    assert main([*args, "--json", "--top", "500"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["layouts"] and all(r["layout"]["cp"] == 1 for r in report["layouts"])
    reason = "QK-clip (optim.qk_clip_tau) needs cp = 1, as the trainer does"
    assert reason in report["rejected_by_reason"]
    assert main([*args, "--layout", "cp=2,fsdp=4,mb=2"]) == 1
    assert reason in capsys.readouterr().err


def test_a_small_models_parameters_are_printed_in_millions(capsys):
    """The header printed 0.000779B params for configs/tiny.toml; now 0.779M, and 1B+ in B."""
    root = Path(__file__).resolve().parents[2] / "configs"
    assert main(["plan", "-c", str(root / "tiny.toml"), "--gpus", "1"]) == 0
    assert "tiny: 0.779M params," in capsys.readouterr().out
    assert main(["plan", "-c", str(root / "llama-1b.toml"), "--gpus", "8", "--top", "1"]) == 0
    assert "llama-1b: 1.04B params," in capsys.readouterr().out
