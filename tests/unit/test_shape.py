"""shape/: the model's facts (blocks, MoE layers, parameters, FLOPs) and the layout's (degrees, rules,
meshes), read by the model, the runtime, the planner, the metrics and the config checks."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from depthscale.cli import main
from depthscale.config import load_config
from depthscale.observe.metrics import flops_per_token
from depthscale.shape import Degrees, ModelShape, block_assignment

SHAPE = Path(__file__).parents[2] / "src" / "depthscale" / "shape"

MODELS = {
    "dense": "",
    "moe": "moe_experts = 4\nmoe_top_k = 2\nmoe_ffn_dim = 96\nmoe_shared_experts = 1\n"
    "moe_first_dense = 1\n",
    "window": "sliding_window = 48\n",
    "attnres": "residual = 'block'\nattnres_n_blocks = 3\n",
}


@pytest.mark.parametrize("kind", MODELS)
def test_the_logged_mfu_counts_the_flops_the_planner_predicts_with(kind, tmp_path, capsys):
    """The FLOPs per token the trainer gives `Throughput` (`flops_per_token(cfg.model,
    cfg.data.seq_len)`, MFU's numerator) are `depthscale plan`'s for the same config: a logged MFU
    and a predicted one are the same quantity (the convention: shape/model.py)."""
    toml = tmp_path / f"{kind}.toml"
    toml.write_text(
        "[model]\nvocab_size = 256\ndim = 64\nn_layers = 4\nn_heads = 4\nn_kv_heads = 2\n"
        f"{MODELS[kind]}[data]\nseq_len = 128\n"
    )
    assert main(["plan", "-c", str(toml), "--gpus", "1", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["flops"]["model_flops_per_token"]
    cfg = load_config(str(toml), [])
    assert flops_per_token(cfg.model, cfg.data.seq_len) == pytest.approx(planned, rel=1e-12)
    # the FLOPs of one sequence, as the planner's MFU divides them: per token × tokens
    spec = ModelShape.from_config(cfg.model)
    assert spec.model_flops(128) == pytest.approx(planned * 128, rel=1e-12)


def test_one_convention_the_whole_score_matrix():
    """Attention counts every key of the causal score matrix (T per query), a window w < T counts
    w, AttnRes adds parameters but no FLOPs, and an MoE layer counts its k routed experts."""
    base = ModelShape(n_layers=2, dim=64, n_heads=4, kv_heads=4, ffn_dim=128, vocab=100)
    matmuls = 2 * (4 * 64 * 64 + 3 * 64 * 128) + 64 * 100
    attention = 2 * 4 * 64 * 32  # per token, T = 32 keys per query
    assert base.model_flops_per_token(32) == 3 * (2 * matmuls + attention)
    windowed = base.with_(sliding_window=8)
    assert windowed.model_flops_per_token(32) == 3 * (2 * matmuls + 2 * 4 * 64 * 8)
    assert base.with_(sliding_window=32).model_flops_per_token(32) == base.model_flops_per_token(32)
    attnres = base.with_(residual="block", blocks=(0, 0, 1, 1))
    assert attnres.model_flops_per_token(32) == base.model_flops_per_token(32)
    assert attnres.params() == base.params() + (4 + 1) * 2 * 64  # a query and a gain each
    moe = base.with_(n_experts=8, moe_top_k=2, moe_ffn=32, moe_layers=(1,))
    expert = 3 * 64 * 32
    assert moe.idle_params() == 6 * expert
    assert moe.active_params() == moe.params() - 6 * expert
    dense_ffn, moe_ffn = 3 * 64 * 128, 64 * 8 + 2 * expert
    assert moe.model_flops_per_token(32) == base.model_flops_per_token(32) + 6 * (
        moe_ffn - dense_ffn
    )
    assert moe.hardware_flops_per_token(32, "none") == moe.model_flops_per_token(32)
    assert moe.hardware_flops_per_token(32, "full") > moe.model_flops_per_token(32)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("full", 4, 0, 1), [0, 1, 2, 3]),
        (("standard", 4, 0, 1), [0, 0, 0, 0]),
        (("block", 6, 4, 1), [0, 0, 0, 0, 1, 1]),
        (("block", 8, 0, 3), [0, 0, 1, 1, 2, 2, 2, 2]),
    ],
)
def test_block_assignment(args, expected):
    assert block_assignment(*args) == expected


def test_block_assignment_refuses_more_blocks_than_sublayers():
    from depthscale.errors import ConfigError

    with pytest.raises(ConfigError, match=r"model.attnres_n_blocks=5 must be in 1..4"):
        block_assignment("block", 4, 0, 5)


def test_shape_imports_nothing_of_the_project_but_its_errors_and_no_torch():
    """The bottom room: the planner (no torch) and every other room can read it."""
    for path in SHAPE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                assert not name.startswith("torch"), f"{path.name} imports {name}"
                if name.startswith("depthscale"):
                    assert name in ("depthscale.errors",) or name.startswith("depthscale.shape"), (
                        f"{path.name} imports {name}"
                    )


def test_degrees_derive_the_world_the_shards_and_the_expert_mesh():
    d = Degrees(pp=2, dp_replicate=2, dp_shard=4, cp=2, tp=2, ep=2)
    assert d.world_size == 64 and d.dp == 8 and d.shard == 8
    assert d.mesh_shape == (2, 2, 4, 2, 2)
    assert d.expert_mesh_shape == (2, 2, 2, 2, 2, 2)
    assert d.expert_shard == 4  # (dp_shard / ep) × cp ranks hold the same experts
    assert Degrees(dp_shard=4, cp=2).expert_shard == 1  # no ep: nothing to shard over
    # the ep groups are consecutive dp_shard ranks: one of each group in an expert shard group
    ranks = [d.expert_shard_rank(r) for r in range(d.shard)]  # r = dp_shard_rank · cp + cp_rank
    assert ranks == [0, 1, 0, 1, 2, 3, 2, 3]
    # row-major over MESH_DIMS, tp innermost
    assert d.coordinates(0) == {"pp": 0, "dp": 0, "cp": 0, "tp": 0}
    assert d.coordinates(1) == {"pp": 0, "dp": 0, "cp": 0, "tp": 1}
    assert d.coordinates(2) == {"pp": 0, "dp": 0, "cp": 1, "tp": 0}
    assert d.coordinates(4) == {"pp": 0, "dp": 1, "cp": 0, "tp": 0}
    assert d.coordinates(63) == {"pp": 1, "dp": 7, "cp": 1, "tp": 1}
    assert Degrees(cp=3).seq_multiple == 6 and Degrees().seq_multiple == 1
    assert Degrees(cp=3).padded_seq(100) == 102 and Degrees().padded_seq(100) == 100


def test_the_runtime_and_the_planner_read_the_same_degrees():
    """The degrees, the expert shard and the shard dimension have one home: the runtime's
    `ParallelDims` and the planner's `Layout` derive theirs from it (so a planner/runtime
    agreement test has nothing left to compare)."""
    from depthscale.parallel import expert_parallel, parallelize
    from depthscale.parallel.mesh import ParallelDims
    from depthscale.plan import comm, states
    from depthscale.plan.layout import Layout
    from depthscale.shape import EXPERT_SHARD_DIM

    assert states.EXPERT_SHARD_DIM is comm.EXPERT_SHARD_DIM is EXPERT_SHARD_DIM
    assert parallelize.EXPERT_SHARD_DIM is EXPERT_SHARD_DIM
    assert not hasattr(expert_parallel, "EXPERT_SHARD_DIM")
    lay = Layout(tp=2, pp=2, cp=2, dp_shard=4, dp_replicate=2, ep=2)
    assert lay.degrees == Degrees(2, 2, 4, 2, 2, 2)
    assert (lay.world, lay.dp, lay.shard, lay.expert_shard) == (64, 8, 8, 4)
    assert issubclass(ParallelDims, Degrees)
    assert ParallelDims(dp_shard=4, ep=2).expert_shard == Layout(dp_shard=4, ep=2).expert_shard == 2


@pytest.mark.parametrize(
    ("degrees", "experts", "words"),
    [
        (
            Degrees(dp_shard=4, ep=2),
            0,
            r"parallel.ep=2 needs an MoE model \(model.moe_experts > 0\)",
        ),
        (Degrees(dp_shard=6, ep=4), 8, r"parallel.ep=4 must divide parallel.dp_shard=6"),
        (Degrees(dp_shard=4, ep=4), 6, r"parallel.ep=4 must divide model.moe_experts=6"),
    ],
)
def test_the_expert_rules_are_one_config_error_and_one_plan_reason(degrees, experts, words):
    """Config validation raises the rule; `depthscale plan` rejects a layout with the same words."""
    from depthscale.config import Config
    from depthscale.errors import ConfigError
    from depthscale.plan.estimate import Workload, check
    from depthscale.plan.frameworks import DEPTHSCALE
    from depthscale.plan.hardware import PRESETS
    from depthscale.plan.layout import Layout

    with pytest.raises(ConfigError, match=words):
        degrees.check_experts(experts)
    cfg = Config()
    cfg.model.moe_experts, cfg.model.moe_top_k = experts, min(experts, 2)
    cfg.parallel.dp_shard, cfg.parallel.ep = degrees.dp_shard, degrees.ep
    cfg.train.batch_size = 24
    with pytest.raises(ConfigError, match=words):
        cfg.validate()
    spec = ModelShape(n_layers=2, dim=64, n_heads=4, kv_heads=4, ffn_dim=128, vocab=128)
    if experts:
        spec = spec.with_(n_experts=experts, moe_top_k=2, moe_ffn=32, moe_layers=(0, 1))
    lay = Layout(dp_shard=degrees.dp_shard, ep=degrees.ep)
    reason = check(Workload(spec, 64, 24, "bfloat16"), PRESETS["h100"], lay, DEPTHSCALE, lay.world)
    assert re.search(words, reason), reason


def test_degrees_below_one_and_a_wrong_world_are_config_errors():
    from depthscale.errors import ConfigError

    with pytest.raises(ConfigError, match=r"parallel.ep=0 must be >= 1"):
        Degrees(ep=0).check()
    with pytest.raises(ConfigError, match=r"needs 4 processes but the world size is 2"):
        Degrees(dp_shard=2, tp=2).check(2)
    assert Degrees(dp_shard=2, tp=2).check(4) == Degrees(dp_shard=2, tp=2)
