"""`data.document_mask` from the command line, as a user turns it on: a corpus of short documents
(several in every row), trained with the mask in one process and in four (cp = 2 zigzag × pp = 2),
logs the same losses and gradient norms; the same run without the mask logs others (the rows'
documents then see each other).

Tolerance: as tests/e2e/test_cli.py's layouts (printed digits, then fp32 reordering carried
through four free-running AdamW steps)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_cli import cli

# three CLI runs, one of four processes (~25 s): CI runs it after the default suite
pytestmark = pytest.mark.slow


def _train(root: Path, name: str, *args: str) -> list[tuple[float, float]]:
    proc = cli(
        "train", "-c", os.path.abspath("configs/tiny.toml"), "--data.path",
        str(root / "docs.jsonl"), "--data.seq_len", "64", "--model.sliding_window", "24",
        "--train.steps", "4", "--optim.warmup_steps", "1", "--logging.log_every", "1",
        "--logging.progress", "false", "--train.eval_every", "0", "--checkpoint.every", "0",
        "--train.run_dir", str(root / name), *args, cwd=root,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("step") and "| loss" in ln]
    return [
        (float(ln.split("loss ")[1].split()[0]), float(ln.split("grad_norm ")[1].split()[0]))
        for ln in lines
    ]


def test_masked_runs_agree_across_layouts_and_differ_from_unmasked(tmp_path):
    words = ["the", "fox", "ran", "over", "a", "dog", "and", "sat", "under", "one", "tree"]
    (tmp_path / "docs.jsonl").write_text(
        "".join(
            json.dumps({"text": " ".join(words[(i * k) % len(words)] for k in range(3 + i % 9))})
            + "\n"
            for i in range(400)
        )
    )
    masked = _train(tmp_path, "one", "--data.document_mask", "true")
    layout = _train(
        tmp_path, "four", "--data.document_mask", "true", "--nproc", "4", "--parallel.cp", "2",
        "--parallel.pp", "2",
    )  # fmt: skip
    plain = _train(tmp_path, "plain")
    assert len(masked) == len(layout) == len(plain) == 4
    for (loss, norm), (ref_loss, ref_norm) in zip(layout, masked):
        assert loss == pytest.approx(ref_loss, abs=2e-4)
        assert norm == pytest.approx(ref_norm, abs=2e-3)
    assert all(abs(a[0] - b[0]) > 1e-2 for a, b in zip(masked[1:], plain[1:]))
