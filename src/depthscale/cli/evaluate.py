"""`depthscale eval`: multiple-choice tasks (local JSONL) scored on a run's checkpoint, acc and
acc_norm per task as lm-evaluation-harness reports them (`evaluation/multiple_choice.py`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from depthscale.cli.output_paths import check_output
from depthscale.errors import CheckpointError, ConfigError, DepthscaleError


def run(args: argparse.Namespace) -> int:
    from depthscale.evaluation.multiple_choice import as_table, read_task, score
    from depthscale.interop.run_dir import load_run

    if args.json:
        check_output("--json", Path(args.json))
    tasks = [read_task(Path(t)) for t in args.tasks]  # every file checked before the model loads
    device = _device(args.device)
    model, tokenizer = load_run(Path(args.run), args.checkpoint)
    if tokenizer is None:
        raise CheckpointError(f"{args.run} has no tokenizer/ directory; evaluation needs one")
    model.to(device)
    results = [score(model, tokenizer, task, args.batch_size) for task in tasks]
    print(as_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


def _device(choice: str):
    import torch

    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device here; allowed: cpu, or auto")
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(choice)


def lm_eval(argv: list[str]) -> int:
    """`depthscale lm-eval ARGS`: lm-evaluation-harness's command line, `--model depthscale`
    registered (`interop/lm_eval_adapter.py`)."""
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        raise DepthscaleError(
            "depthscale lm-eval needs lm-evaluation-harness; pip install 'depthscale[lm-eval]'"
        )
    from depthscale.interop.lm_eval_adapter import main

    return main(argv)
