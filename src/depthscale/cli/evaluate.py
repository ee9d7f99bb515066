"""`depthscale eval`: multiple-choice tasks (local JSONL) scored on a run's checkpoint, acc and
acc_norm per task as lm-evaluation-harness reports them (`evaluation/multiple_choice.py`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from depthscale.cli.output_paths import check_output, write_output
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
        write_output(Path(args.json), json.dumps(results, indent=2) + "\n")
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
    output = _harness_output(argv)
    if output is not None:  # the harness writes its results last, after the whole evaluation
        path = Path(output)
        check_output("--output_path", path, directory=path.suffix != ".json")
    from depthscale.interop.lm_eval_adapter import main

    return main(argv)


def _harness_output(argv: list[str]) -> str | None:
    """The harness's `--output_path` / `-o` (as argparse reads it: `--output_path X`,
    `--output_path=X`, the last one winning): a directory, or a file when it ends in .json (the
    harness writes `NAME_<time>.json` beside it, and its samples in that directory)."""
    value = None
    for i, arg in enumerate(argv):
        if arg in ("--output_path", "-o") and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--output_path="):
            value = arg.partition("=")[2]
    return value
