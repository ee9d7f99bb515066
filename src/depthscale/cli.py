"""depthscale command line: train, generate, convert, trace, diagnose.

depthscale train -c configs/tiny.toml --model.residual block --train.steps 100
depthscale generate --run runs/tiny --prompt "def main("
depthscale convert hf-to-ds --hf path/to/llama --out runs/llama
depthscale convert ds-to-hf --run runs/tiny --out exported/
depthscale trace depth --run runs/tiny
depthscale diagnose --nproc 4 --run runs/tiny
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import sys
import traceback
from pathlib import Path

from depthscale.errors import CheckpointError, ConfigError, DepthscaleError, PeersFailed
from depthscale.parallel.launcher import (
    BUG,
    INPUT,
    PEER_LOST,
    is_worker,
    peer_lost,
    record_worker_error,
)


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    cfg = _checked_config(args, overrides)  # bad input fails here, before any process starts
    if args.print_config:
        from depthscale.config import to_toml

        print(to_toml(cfg), end="")
        return 0
    p = cfg.parallel
    passthrough = [*(["-c", args.config] if args.config else []), *overrides]
    if (p.nproc > 1 or p.nnodes > 1) and not is_worker():
        if cfg.resilience.supervise != "false":
            from depthscale.resilience.supervisor import supervise

            return supervise(cfg, passthrough)
        from depthscale.parallel.launcher import launch

        return launch(cfg.parallel.nproc, passthrough)
    if cfg.resilience.supervise == "true" and not is_worker():
        from depthscale.resilience.supervisor import supervise

        return supervise(cfg, passthrough)
    from depthscale.parallel.mesh import destroy_distributed
    from depthscale.train.trainer import Trainer

    trainer = Trainer(cfg)
    trainer.fit()
    # Only on success: a collective in an error path would wait for a peer that already left.
    destroy_distributed()
    return 128 + trainer.stopped_by if trainer.stopped_by is not None else 0


def _checked_config(args: argparse.Namespace, overrides: list[str]):
    """The config, with every rule the launch and the workers would enforce checked in this
    process: `train` refuses before any work, and `--print-config` prints only what would run."""
    from depthscale.config import load_config
    from depthscale.resilience.faults import check_ranks, parse_faults

    cfg = load_config(args.config, overrides)
    check_ranks(parse_faults(cfg.resilience.faults), cfg.world_size)
    p = cfg.parallel
    if (p.nproc > 1 or p.nnodes > 1) and not is_worker():
        _check_launch(cfg)
    elif cfg.world_size > 1 and not is_worker():
        raise ConfigError(
            f"parallel layout needs {cfg.world_size} processes; add --nproc {cfg.world_size} "
            "(or start the workers with torchrun)"
        )
    return cfg


def _check_launch(cfg) -> None:
    """The processes launched match the layout, and every rule a worker would enforce holds."""
    from depthscale.parallel.parallelize import check_layout

    p = cfg.parallel
    if cfg.world_size != p.nproc * p.nnodes:
        launched = (
            f"--nproc is {p.nproc}"
            if p.nnodes == 1
            else f"--nproc × parallel.nnodes is {p.nproc} × {p.nnodes}"
        )
        raise ConfigError(
            f"parallel layout pp×dp_replicate×dp_shard×cp×tp = {cfg.world_size} "
            f"processes, but {launched}; allowed: equal numbers"
        )
    if p.nnodes > 1 and cfg.resilience.supervise == "false":
        raise ConfigError(
            "parallel.nnodes > 1 runs one supervisor per node; with "
            "resilience.supervise=false start the workers with torchrun instead "
            "(docs/fault-tolerance.md, Multi-node)"
        )
    check_layout(cfg)


def _generate(args: argparse.Namespace) -> int:
    import torch

    from depthscale.interop.run_dir import load_run
    from depthscale.model.generate import generate

    model, tokenizer = load_run(Path(args.run), args.checkpoint)
    if tokenizer is None:
        raise CheckpointError(f"{args.run} has no tokenizer/ directory; generation needs one")
    ids = [
        tokenizer.eos_id,
        *tokenizer.encode(args.prompt),
    ]  # training puts EOS before every document
    limit = model.cfg.max_seq_len
    if args.max_new_tokens >= limit:
        raise ConfigError(
            f"--max-new-tokens {args.max_new_tokens} exceeds the model's context of {limit} "
            f"tokens (model.max_seq_len), which also holds the prompt ({len(ids)} tokens); "
            f"allowed: at most {limit - len(ids)}"
        )
    if len(ids) + args.max_new_tokens > limit:
        raise ConfigError(
            f"the prompt is {len(ids)} tokens and --max-new-tokens is {args.max_new_tokens}: "
            f"together more than the model's max_seq_len={limit}; allowed: a prompt of at most "
            f"{limit - args.max_new_tokens} tokens, or a smaller --max-new-tokens"
        )
    prompt = torch.tensor([ids], dtype=torch.long)
    gen = torch.Generator().manual_seed(args.seed)
    out = generate(
        model,
        prompt,
        args.max_new_tokens,
        args.temperature,
        args.top_k,
        eos_id=tokenizer.eos_id,
        generator=gen,
    )
    print(tokenizer.decode(out[0, 1:].tolist()))
    return 0


def _convert(args: argparse.Namespace) -> int:
    from depthscale.interop.run_dir import hf_to_run, run_to_hf

    _check_output("--out", Path(args.out), directory=True)
    if args.direction == "hf-to-ds":
        out = hf_to_run(Path(args.hf), Path(args.out))
    else:
        out = run_to_hf(Path(args.run), Path(args.out), args.checkpoint)
    print(f"wrote {out}")
    return 0


def _trace(args: argparse.Namespace) -> int:
    if args.out:
        _check_output("--out", Path(args.out))
    if args.what == "schedule":
        return _trace_schedule(args)
    if args.what in ("timeline", "stragglers", "hang"):
        from depthscale.observe.report import run_report

        out = Path(args.out) if args.out else None
        return run_report(args.what, Path(args.run), out, args.step)
    import json

    from depthscale.data.loader import build_data
    from depthscale.interop.run_dir import load_run, run_config
    from depthscale.observe.depth_trace import plot_depth_trace, trace_depth

    run = Path(args.run)
    model, _ = load_run(run, args.checkpoint)
    cfg = run_config(run)
    data = build_data(cfg.data, cfg.train.seed, args.batch)
    split = data.val if data.val is not None else data.train
    tokens, _ = next(iter(split.iter_eval(1)))
    trace = trace_depth(model, tokens)
    out = Path(args.out) if args.out else run / "depth_trace.png"
    plot_depth_trace(trace, out)
    out.with_suffix(".json").write_text(json.dumps(vars(trace), indent=1))
    print(f"wrote {out} and {out.with_suffix('.json')}")
    return 0


def _trace_schedule(args: argparse.Namespace) -> int:
    from depthscale.observe.schedule_plot import plot_timeline
    from depthscale.parallel.pipeline.schedules import build_schedule, simulate

    try:
        schedule = build_schedule(args.schedule, args.pp, args.virtual, args.microbatches)
    except ValueError as err:
        raise ConfigError(f"trace schedule: {err}") from None
    timeline = simulate(schedule, forward_cost=1.0, backward_cost=2.0)
    bubble = timeline.bubble_ratio(1.0, 2.0)
    out = Path(
        args.out or f"schedule_{args.schedule}_p{args.pp}_v{args.virtual}_m{args.microbatches}.png"
    )
    title = (
        f"{args.schedule} P={args.pp} V={args.virtual} M={args.microbatches}: bubble {bubble:.3f} "
        f"(theory (P-1)/(V·M) = {(args.pp - 1) / (args.virtual * args.microbatches):.3f})"
    )
    plot_timeline(timeline, out, title)
    print(f"wrote {out}; bubble {bubble:.4f}; peak in-flight per rank {timeline.peak_in_flight}")
    return 0


def _diagnose(args: argparse.Namespace) -> int:
    from depthscale.resilience.diagnose import diagnose
    from depthscale.resilience.report import format_table

    ckpt_dir = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    _check_output("--run", Path(args.run), directory=True)
    if ckpt_dir is not None:
        _check_output("--checkpoint-dir", ckpt_dir, directory=True)
    report = diagnose(
        args.nproc,
        Path(args.run),
        ckpt_dir=ckpt_dir,
        size_mb=args.size_mb,
        timeout_s=args.timeout_s,
    )
    print(report.to_json() if args.json else format_table(report), flush=True)
    for node, reasons in report.bad_nodes.items():
        print(f"depthscale: diagnose: node {node} failed: {'; '.join(reasons)}", file=sys.stderr)
    return 0 if report.healthy else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="depthscale", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"depthscale {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

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
    plan.add_argument("--top", type=_positive_int, default=10, help="layouts to show")
    plan.add_argument(
        "--tokens", type=_positive_float, help="token budget: print the days it takes"
    )
    plan.add_argument("--json", action="store_true", help="print the report as JSON")

    conv = sub.add_parser("convert", help="convert between Hugging Face Llama and depthscale runs")
    conv.add_argument("direction", choices=["hf-to-ds", "ds-to-hf"])
    conv.add_argument(
        "--hf", help="hf-to-ds: Hugging Face model directory (config.json + safetensors)"
    )
    conv.add_argument("--run", help="ds-to-hf: depthscale run directory")
    conv.add_argument("--checkpoint", help="ds-to-hf: a step_* directory (default: the newest)")
    conv.add_argument("--out", required=True, help="output directory")
    return parser


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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    try:
        return _run(parser, args, rest)
    except PeersFailed as err:
        return _fail(f"depthscale: error: {err}", PEER_LOST, 1)
    except DepthscaleError as err:
        kind = "config error" if isinstance(err, ConfigError) else "error"
        return _fail(f"depthscale: {kind}: {err}", INPUT, 2)
    except FileNotFoundError as err:
        return _fail(f"depthscale: error: {err}", INPUT, 2)
    except OSError as err:
        if err.errno not in _ENVIRONMENT_ERRNOS:
            raise
        return _fail(f"depthscale: error: {_os_error(err)}", INPUT, 2)
    except KeyboardInterrupt:
        return _fail("depthscale: interrupted", INPUT, 130)
    except Exception as err:
        if not is_worker():
            raise  # a bug: the traceback is the report
        if peer_lost(err):
            return _fail(f"depthscale: rank {_rank()} lost a peer process ({err})", PEER_LOST, 1)
        return _fail(
            f"depthscale: rank {_rank()} failed:\n{traceback.format_exc().rstrip()}", BUG, 1
        )


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace, rest: list[str]) -> int:
    if args.command == "train":
        if args.nproc is not None:
            rest = [*rest, "--parallel.nproc", str(args.nproc)]
        if args.faults is not None:
            rest = [*rest, "--resilience.faults", args.faults]
        return _train(args, rest)
    if args.command == "plan":
        return _plan(args, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "generate":
        return _generate(args)
    if args.command == "trace":
        if args.what not in ("schedule",) and not args.run:
            parser.error(f"trace {args.what} needs --run DIR")
        return _trace(args)
    if args.command == "diagnose":
        return _diagnose(args)
    if args.direction == "hf-to-ds" and not args.hf:
        parser.error("convert hf-to-ds needs --hf DIR")
    if args.direction == "ds-to-hf" and not args.run:
        parser.error("convert ds-to-hf needs --run DIR")
    return _convert(args)


def _plan(args: argparse.Namespace, rest: list[str]) -> int:
    if args.calibrate:
        import json

        from depthscale.observe.calibrate import measure_cluster

        out = Path(args.calibrate)
        if not out.parent.is_dir():
            raise ConfigError(f"--calibrate {out}: directory {out.parent} does not exist")
        _check_output("--calibrate", out)
        out.write_text(json.dumps(measure_cluster(args.nproc), indent=1) + "\n")
        print(f"wrote {out}: use --cluster {out}")
        return 0
    if args.gpus is None:
        raise ConfigError("plan needs --gpus N (or --calibrate OUT.json)")
    from depthscale.config import load_config
    from depthscale.plan.report import PlanRequest, format_table, run, to_json
    from depthscale.plan.spec import ModelSpec

    cfg = load_config(args.config, rest)
    if cfg.model.vocab_size <= 0:  # as training resolves it: from the tokenizer the config names
        from depthscale.data.tokenizer import planned_vocab_size

        vocab, note = planned_vocab_size(cfg.data)
        cfg.resolve_vocab_size(vocab)
        if note:
            print(f"depthscale: note: {note}", file=sys.stderr, flush=True)
    name = Path(args.config).stem if args.config else "defaults"
    request = PlanRequest(
        spec=ModelSpec.from_config(cfg.model, name=name),
        gpus=args.gpus,
        cluster=args.cluster,
        seq=args.seq or cfg.data.seq_len,
        batch=args.batch or cfg.train.batch_size,
        dtype=args.dtype,
        framework=args.framework,
        layout=args.layout,
        top=args.top,
        tokens=args.tokens or 0.0,
    )
    try:
        report = run(request)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if args.framework == "depthscale":
        report["launch"] = _launch_command(args, rest, cfg, report)
    print(to_json(report) if args.json else format_table(report))
    return 0


def _launch_command(
    args: argparse.Namespace, rest: list[str], cfg, report: dict
) -> dict[str, str | int] | None:
    """The `depthscale train` command line that runs the first layout that fits, on nodes of the
    cluster's size (the same command on every node, each with its own node_rank)."""
    import shlex

    from depthscale.plan.hardware import cluster
    from depthscale.plan.layout import Layout, train_flags

    row = next((r for r in report["layouts"] if r["ok"]), None)
    if row is None:
        return None
    per_node = cluster(args.cluster).gpus_per_node
    per_node = args.gpus if args.gpus <= per_node else math.gcd(args.gpus, per_node)
    nodes = args.gpus // per_node
    cmd = ["depthscale", "train", *(["-c", args.config] if args.config else []), *rest]
    for key, value, ours in (
        ("data.seq_len", args.seq, cfg.data.seq_len),
        ("train.batch_size", args.batch, cfg.train.batch_size),
        ("train.dtype", args.dtype, cfg.train.dtype),
    ):
        if value is not None and value != ours:
            cmd += [f"--{key}", str(value)]
    cmd += ["--nproc", str(per_node)]
    if nodes > 1:
        cmd += ["--parallel.nnodes", str(nodes), "--parallel.node_rank", "RANK"]
        cmd += ["--parallel.master_addr", "HOST", "--parallel.master_port", "29500"]
    cmd += train_flags(Layout(**row["layout"]), cfg)
    return {"layout": row["label"], "nodes": nodes, "command": shlex.join(cmd)}


_ENVIRONMENT_ERRNOS = {
    errno.EACCES,
    errno.EPERM,
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EFBIG,
    errno.EROFS,
    errno.ENOTDIR,
    errno.EISDIR,
    errno.EEXIST,
    errno.ENAMETOOLONG,
}
"""Errors of the machine, not of depthscale: a path that cannot be made or written, a full disk.
Their report is one line naming the file, as for any other bad input."""


def _os_error(err: OSError) -> str:
    where = f"{err.filename}: " if err.filename else ""
    no_room = err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    full = " (a full disk, a quota or a file-size limit)" if no_room else ""
    return f"{where}{err.strerror} [{errno.errorcode.get(err.errno, err.errno)}]{full}"


def _check_output(flag: str, path: Path, directory: bool = False) -> None:
    """An output path that cannot be created is refused before any work, naming the flag: a
    regular file on its way, an unwritable parent, a directory where a file goes."""
    from depthscale.config.validation import check_dir_creatable

    if directory:
        check_dir_creatable(flag, path)
        return
    if path.is_dir():
        raise ConfigError(f"{flag} {str(path)!r} is a directory; allowed: a file path")
    ancestor = path.parent
    while not ancestor.exists() and ancestor.parent != ancestor:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError(
            f"{flag} {str(path)!r} cannot be created because {str(ancestor)!r} is a file; "
            "allowed: a path whose parents are directories"
        )
    check_dir_creatable(flag, path.parent)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _fail(message: str, kind: str, code: int) -> int:
    """Report an error once: a worker hands it to the launcher (which prints the root cause once
    for the whole group); a single process, or a worker under plain torchrun, prints it."""
    if not (is_worker() and record_worker_error(_rank(), kind, message)):
        print(message, file=sys.stderr, flush=True)
    return code


def _positive_int(text: str) -> int:
    return _number(text, int, lambda v: v >= 1, "an integer >= 1")


def _non_negative_int(text: str) -> int:
    return _number(text, int, lambda v: v >= 0, "an integer >= 0")


def _non_negative_float(text: str) -> float:
    return _number(text, float, lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")


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


if __name__ == "__main__":
    sys.exit(main())
