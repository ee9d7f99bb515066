"""The command line's grammar: `build_parser` (every command and flag, with its help), the argument
types that refuse a bad number with the values allowed, the config keys listed under
`train --help`, and `--version`. Parsing only: what each command does is in its own module."""

from __future__ import annotations

import argparse
import math

USAGE = """depthscale command line: train, tokenize, generate, eval, lm-eval, convert, trace, diagnose, plan.

depthscale train -c configs/tiny.toml --model.residual block --train.steps 100
depthscale generate --run runs/tiny --prompt "def main("
depthscale convert hf-to-ds --hf path/to/llama --out runs/llama
depthscale convert ds-to-hf --run runs/tiny --out exported/
depthscale eval --run runs/tiny --tasks my_task.jsonl
depthscale tokenize corpus/ --out shards/ --tokenizer tokenizer.json --workers 8
depthscale lm-eval --model depthscale --model_args run=runs/tiny --tasks my_task --include_path tasks/
depthscale trace depth --run runs/tiny
depthscale diagnose --nproc 4 --run runs/tiny
"""
"""What `depthscale --help` opens with."""


def build_parser() -> argparse.ArgumentParser:
    """The command line: one sub-parser per command, each built by its own function."""
    parser = argparse.ArgumentParser(
        prog="depthscale", description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"depthscale {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (
        _add_train,
        _add_generate,
        _add_trace,
        _add_diagnose,
        _add_plan,
        _add_eval,
        _add_tokenize,
        _add_lm_eval,
        _add_convert,
    ):
        add(sub)
    return parser


def _add_train(sub) -> None:
    """`depthscale train`: a config and its overrides, launch and fault options."""
    train = sub.add_parser(
        "train",
        help="train a model from a TOML config",
        description="Train a model. Any config field can be overridden as --section.key VALUE "
        "(e.g. --model.dim 256 --optim.name lamb --train.steps 500).",
        epilog=_config_keys(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("-c", "--config", help="TOML config file (defaults apply to missing keys)")
    train.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config (file, then overrides) as TOML and exit",
    )
    train.add_argument(
        "--nproc", type=_positive_int, help="local worker processes (same as --parallel.nproc)"
    )
    train.add_argument(
        "--faults",
        help="fault injection for drills, e.g. kill@1:5,nan@0:3 (same as --resilience.faults; "
        "docs/fault-tolerance.md)",
    )


def _add_generate(sub) -> None:
    """`depthscale generate`: sampling from a run."""
    gen = sub.add_parser("generate", help="sample text from a trained run (KV-cache decoding)")
    gen.add_argument(
        "--run", required=True, help="run directory (holds config.toml, tokenizer/, checkpoints/)"
    )
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=_positive_int, default=200)
    gen.add_argument("--temperature", type=_non_negative_float, default=0.8, help="0 = greedy")
    gen.add_argument("--top-k", type=_non_negative_int, default=50, help="0 = no top-k filtering")
    gen.add_argument("--seed", type=_non_negative_int, default=0)
    gen.add_argument("--checkpoint", help="a step_* directory (default: the newest in the run)")


def _add_trace(sub) -> None:
    """`depthscale trace`: timelines, stragglers, hangs, depth weights, schedules."""
    trace = sub.add_parser(
        "trace",
        help="diagnostics of a run: the merged timeline, stragglers, hangs; AttnRes depth "
        "weights; pipeline schedules",
    )
    trace.add_argument(
        "what",
        choices=["timeline", "stragglers", "hang", "depth", "schedule"],
        help="timeline: every rank's spans merged into one Perfetto/Chrome trace (with message "
        "arrows, clocks aligned); stragglers: ranks slower than their peers, and a heat map; "
        "hang: which rank the others wait for, from the hang dumps; depth: AttnRes "
        "depth-attention weights and output RMS per sublayer of a run; schedule: a pipeline "
        "schedule per rank (simulated, with its bubble)",
    )
    trace.add_argument("--run", help="timeline, stragglers, hang, depth: run directory")
    trace.add_argument("--checkpoint", help="depth: a step_* directory (default: the newest)")
    trace.add_argument(
        "--batch", type=_positive_int, default=4, help="depth: held-out sequences to average over"
    )
    trace.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    trace.add_argument("--pp", type=_positive_int, default=4, help="schedule: pipeline ranks")
    trace.add_argument(
        "--virtual", type=_positive_int, default=1, help="schedule: virtual stages per rank"
    )
    trace.add_argument(
        "--microbatches", type=_positive_int, default=8, help="schedule: microbatches per step"
    )
    trace.add_argument(
        "--step",
        type=_positive_int,
        help="timeline: the step drawn in RUN/trace/timeline.png (default: the last one every "
        "rank finished)",
    )
    trace.add_argument(
        "--out",
        help="output path (timeline: RUN/trace/timeline.json; stragglers: "
        "RUN/trace/stragglers.png; depth: RUN/depth_trace.png, with a .json beside it)",
    )


def _add_diagnose(sub) -> None:
    """`depthscale diagnose`: the node health checks."""
    diag = sub.add_parser(
        "diagnose",
        help="check collectives, neighbour links, memory copies and the checkpoint disk on N local "
        "ranks; name the bad nodes (exit 1) or say all are healthy (exit 0)",
        description="Run every diagnostic check on N local ranks, compare each rank with the "
        "median and with the baseline of the run's first healthy diagnosis, and name the nodes "
        "that fail (each check and how a node is judged: docs/fault-tolerance.md, section "
        "'Diagnostics'). Results: RUN/diagnostics/<time>.json.",
    )
    diag.add_argument("--nproc", type=_positive_int, required=True, help="local ranks")
    diag.add_argument("--run", required=True, help="run directory (results go to RUN/diagnostics/)")
    diag.add_argument(
        "--checkpoint-dir", help="directory probed with a write+fsync (default: RUN/checkpoints)"
    )
    diag.add_argument(
        "--size-mb",
        type=_positive_float,
        default=4.0,
        help="bytes per rank of each collective and exchange, in MB",
    )
    diag.add_argument(
        "--timeout-s",
        type=_positive_float,
        default=60.0,
        help="how long the checks may take once every rank has joined; a rank silent past it fails",
    )
    diag.add_argument("--json", action="store_true", help="print the report as JSON")


def _add_plan(sub) -> None:
    """`depthscale plan`: the layout search, calibration and goodput."""
    plan = sub.add_parser(
        "plan",
        help="predict memory, communication, step time and MFU of layouts; pick the fastest",
        description="Search every layout of a model on N GPUs (or evaluate one with --layout) and "
        "rank them by predicted step time; each rejected layout names the constraint it breaks. "
        "The model comes from a config (--section.key VALUE overrides apply); see docs/planning.md.",
    )
    plan.add_argument("-c", "--config", help="TOML config file (its model section is planned)")
    plan.add_argument("--gpus", type=_positive_int, help="GPUs in the job")
    plan.add_argument(
        "--calibrate",
        metavar="OUT.json",
        help="measure this machine as a cluster for jobs of --nproc local ranks and write it "
        "(then: --cluster OUT.json)",
    )
    plan.add_argument(
        "--nproc", type=_positive_int, default=1, help="--calibrate: local ranks per job"
    )
    plan.add_argument(
        "--cluster", default="h100", help="a100, h100, h200, or a calibration JSON file"
    )
    plan.add_argument(
        "--layout", help="evaluate one layout, e.g. tp=8,pp=8,v=6,fsdp=4,mb=1,recompute=selective"
    )
    plan.add_argument("--seq", type=_positive_int, help="sequence length (default: data.seq_len)")
    plan.add_argument(
        "--batch", type=_positive_int, help="global batch in sequences (default: train.batch_size)"
    )
    plan.add_argument(
        "--framework",
        default="depthscale",
        help="depthscale; megatron or megascale to model the published GPT runs",
    )
    plan.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="compute dtype"
    )
    plan.add_argument(
        "--grad-reduce-dtype",
        choices=["float32", "bfloat16"],
        help="dtype of the data-parallel gradient reduction (default: the config's "
        "parallel.grad_reduce_dtype; for megatron/megascale: float32)",
    )
    plan.add_argument("--top", type=_positive_int, default=10, help="layouts to show")
    plan.add_argument(
        "--tokens", type=_positive_float, help="token budget: print the days it takes"
    )
    plan.add_argument(
        "--failures-per-day",
        type=_positive_float,
        help="failures a day of the whole job, for the goodput and the snapshot and checkpoint "
        "intervals that maximise it (default: Llama 3's 419 in 54 days on 16,384 GPUs, scaled "
        "to --gpus)",
    )
    plan.add_argument(
        "--memory-recoverable",
        type=_fraction,
        help="the share of failures a node's memory tier survives (default 0.916: all but "
        "Llama 3's network switch and cable failures)",
    )
    plan.add_argument("--json", action="store_true", help="print the report as JSON")


def _add_eval(sub) -> None:
    """`depthscale eval`: multiple-choice tasks on a run."""
    ev = sub.add_parser(
        "eval", help="score multiple-choice tasks (local JSONL) on a run: acc, acc_norm"
    )
    ev.add_argument("--run", required=True, help="run directory")
    ev.add_argument(
        "--tasks", nargs="+", required=True,
        help='JSONL files, a question a line: {"context": ..., "choices": [...], "gold": index}',
    )  # fmt: skip
    ev.add_argument("--checkpoint", help="a step_* directory (default: the newest in the run)")
    ev.add_argument("--batch-size", type=_positive_int, default=16)
    ev.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default="auto",
        help="where the model runs (auto: the GPU when there is one)",
    )  # fmt: skip
    ev.add_argument("--json", help="also write the results to this file")


def _add_tokenize(sub) -> None:
    """`depthscale tokenize`: offline shards."""
    tok = sub.add_parser(
        "tokenize",
        help="tokenize text corpora offline into shards (parallel, resumable); train with "
        "--data.path OUT",
    )
    tok.add_argument("inputs", nargs="+", help="text files or folders (docs/data.md's formats)")
    tok.add_argument("--out", required=True, help="the shard directory (kept shards are reused)")
    tok.add_argument(
        "--tokenizer", required=True, help="'byte', a tokenizer.json, or a run's tokenizer/"
    )
    tok.add_argument("--field", default="text", help="the .jsonl field or .parquet column")
    tok.add_argument("--workers", type=_positive_int, default=1, help="processes (default 1)")
    tok.add_argument(
        "--progress", type=_bool, default=True, help="the progress bar (true/false; default true)"
    )


def _add_lm_eval(sub) -> None:
    """`depthscale lm-eval`: every argument is the harness's."""
    sub.add_parser(
        "lm-eval",
        add_help=False,  # --help is the harness's
        help="lm-evaluation-harness with `--model depthscale --model_args run=DIR` "
        "(pip install 'depthscale[lm-eval]'); every argument is the harness's",
    )


def _add_convert(sub) -> None:
    """`depthscale convert`: Hugging Face ⇄ depthscale."""
    conv = sub.add_parser("convert", help="convert between Hugging Face and depthscale runs")
    conv.add_argument("direction", choices=["hf-to-ds", "ds-to-hf"])
    conv.add_argument(
        "--hf", help="hf-to-ds: Hugging Face model directory (config.json + safetensors)"
    )
    conv.add_argument("--run", help="ds-to-hf: depthscale run directory")
    conv.add_argument("--checkpoint", help="ds-to-hf: a step_* directory (default: the newest)")
    conv.add_argument("--out", required=True, help="output directory")
    conv.add_argument(
        "--max-shard-size",
        default="5GB",
        help="ds-to-hf: weights past this size go into numbered shards and an index (default 5GB)",
    )


def _version() -> str:
    """The installed distribution's version (pyproject.toml), the one pip and bug reports see."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("depthscale")
    except PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def _config_keys() -> str:
    """Every config section and key with its default, for `train --help`: what can be set in a
    config file or as --section.key VALUE, without opening schema.py."""
    import textwrap

    from depthscale.config import Config, to_dict
    from depthscale.config.loading import toml_value

    lines = textwrap.wrap(
        "config keys (in a TOML file, or --section.key VALUE) and their defaults; "
        "--print-config prints the resolved config; configs/*.toml are examples and "
        "src/depthscale/config/schema.py says what each key means:",
        100,
    )
    for section, values in to_dict(Config()).items():
        items = " ".join(f"{k}={toml_value(v)}" for k, v in values.items())
        lines += textwrap.wrap(
            f"[{section}] {items}", 100, initial_indent="  ", subsequent_indent="      "
        )
    return "\n".join(lines)


def _bool(text: str) -> bool:
    value = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
    if text.lower() not in value:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed: true, false")
    return value[text.lower()]


def _positive_int(text: str) -> int:
    return _number(text, int, lambda v: v >= 1, "an integer >= 1")


def _non_negative_int(text: str) -> int:
    return _number(text, int, lambda v: v >= 0, "an integer >= 0")


def _non_negative_float(text: str) -> float:
    return _number(text, float, lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")


def _fraction(text: str) -> float:
    return _number(text, float, lambda v: 0 <= v < 1, "a fraction in [0, 1)")


def _positive_float(text: str) -> float:
    return _number(text, float, lambda v: math.isfinite(v) and v > 0, "a finite number > 0")


def _number(text: str, kind: type, ok, allowed: str):
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed: {allowed}")
    return value
