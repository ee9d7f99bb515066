"""An MoE run as a user makes one: trained on two processes with expert parallelism (ep = 2), its
checkpoint resumed on one process (ep = 1), on two (ep = 2), on four (ep = 4), and on four with
ep = 2 (the experts also FSDP-sharded over the other ep group): the experts' shards are resharded
by the checkpoint, and the resumed runs log the same losses, gradient
norms and routing metrics (the aux-loss-free balancing bias, checkpointed with the model, included:
it decides the routing).

Tolerance: as tests/e2e/test_cli.py's layouts (printed digits, then fp32 reordering carried
through three free-running AdamW steps)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from test_cli import cli

# four CLI runs, two of four processes (~65 s): CI runs it after the default suite
pytestmark = pytest.mark.slow

MOE = (
    "--model.moe_experts", "4", "--model.moe_top_k", "2", "--model.moe_ffn_dim", "64",
    "--model.moe_balance", "bias", "--model.moe_bias_rate", "0.01",
)  # fmt: skip


def _train(root: Path, run: str, steps: int, *layout: str) -> list[dict]:
    cli(
        "train", "-c", os.path.abspath("configs/tiny.toml"), *MOE, "--train.steps", str(steps),
        "--optim.warmup_steps", "1", "--logging.log_every", "1", "--logging.progress", "false",
        "--train.eval_every", "0", "--checkpoint.every", "3", "--train.run_dir", str(root / run),
        *layout, cwd=root,
    )  # fmt: skip
    lines = (root / run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("split") == "train"]


def test_an_expert_parallel_checkpoint_resumes_at_other_ep(tmp_path):
    ep2 = ("--nproc", "2", "--parallel.dp_shard", "2", "--parallel.ep", "2")
    # the uninterrupted ep = 2 run is the reference; its directory as it was after step 3 (the
    # step-6 checkpoint and the records after step 3 left out) is what the others resume
    straight = _train(tmp_path, "ep2", 6, *ep2)
    assert [r["step"] for r in straight] == [1, 2, 3, 4, 5, 6]
    assert {"moe/aux_loss", "moe/load_cv", "moe/layer0/load_max"} <= set(straight[-1])
    for name in ("ep1", "ep4", "ep2-fsdp4"):
        shutil.copytree(tmp_path / "ep2", tmp_path / name)
        shutil.rmtree(tmp_path / name / "checkpoints" / "step_00000006")
        metrics = tmp_path / name / "metrics.jsonl"
        kept = [ln for ln in metrics.read_text().splitlines() if json.loads(ln).get("step", 0) <= 3]
        metrics.write_text("".join(ln + "\n" for ln in kept))
    resumed = {
        "ep1": _train(tmp_path, "ep1", 6),
        "ep4": _train(tmp_path, "ep4", 6, "--nproc", "4", "--parallel.dp_shard", "4",
                      "--parallel.ep", "4"),
        "ep2-fsdp4": _train(tmp_path, "ep2-fsdp4", 6, "--nproc", "4", "--parallel.dp_shard", "4",
                            "--parallel.ep", "2"),
    }  # fmt: skip
    reference = [r for r in straight if r["step"] > 3]
    for name in ("ep1", "ep4", "ep2-fsdp4"):
        got = [r for r in resumed[name] if r["step"] > 3]
        for a, b in zip(got, reference, strict=True):
            assert a["loss"] == pytest.approx(b["loss"], abs=2e-4), name
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], abs=2e-3), name
            assert a["moe/load_cv"] == pytest.approx(b["moe/load_cv"], abs=1e-3), name
