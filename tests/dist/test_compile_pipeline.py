"""`train.compile` under pipeline parallelism: every block a stage runs is compiled
(`setup.compile_blocks`), and the losses equal the uncompiled run's within fp32 tolerance."""

from __future__ import annotations

import pytest
import torch.distributed as dist

STEPS = 2


def _losses(root: str, compile_: bool) -> dict:
    from pathlib import Path

    from depthscale.config import load_config
    from depthscale.train.trainer import Trainer

    corpus = Path(root) / "corpus.txt"
    if dist.get_rank() == 0:
        corpus.parent.mkdir(parents=True, exist_ok=True)
        corpus.write_text("".join(f"line {i}: the quick brown fox jumps\n" for i in range(300)))
    dist.barrier()
    args = [
        *("--data.path", str(corpus), "--data.seq_len", "16", "--train.batch_size", "4"),
        *("--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4"),
        *("--train.steps", str(STEPS), "--logging.log_every", "1", "--parallel.pp", "2"),
        *("--train.eval_every", "0", "--checkpoint.every", "0", "--optim.warmup_steps", "1"),
        *("--logging.progress", "false", "--logging.tensorboard", "false"),
        *("--logging.peak_tflops", "1", "--train.run_dir", f"{root}/run{int(compile_)}"),
        *("--train.compile", str(compile_).lower(), "--checkpoint.resume", "none"),
    ]
    trainer = Trainer(load_config(None, args))
    history = trainer.fit()
    compiled = [layer._compiled_call_impl is not None for layer in trainer.model.layers.values()]
    return {"losses": [m["loss"] for m in history], "compiled": compiled}


def test_pipeline_stages_run_their_blocks_compiled(dist_pool, tmp_path):
    eager = dist_pool(2).run(_losses, str(tmp_path / "eager"), False)
    compiled = dist_pool(2).run(_losses, str(tmp_path / "compiled"), True)
    for rank in range(2):
        assert eager[rank]["compiled"] == [False]  # each stage holds one of the two blocks
        assert compiled[rank]["compiled"] == [True]
        for a, b in zip(eager[rank]["losses"], compiled[rank]["losses"]):
            # the compiler fuses and reorders fp32 reductions: the loss (~ln 64 ≈ 4) moves by
            # rounding only, a few ulps of each of the step's ~10^4 accumulations
            assert abs(a - b) <= 1e-4 * abs(a), (a, b)
