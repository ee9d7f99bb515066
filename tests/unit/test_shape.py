"""shape/: the model's facts (blocks, MoE layers, parameters, FLOPs) and the layout's (degrees, rules,
meshes), read by the model, the runtime, the planner, the metrics and the config checks."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from depthscale.cli import main
from depthscale.config import load_config
from depthscale.observe.metrics import flops_per_token
from depthscale.shape import ModelShape, block_assignment

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
                    assert name in ("depthscale.errors",) or name.startswith(
                        "depthscale.shape"
                    ), f"{path.name} imports {name}"
