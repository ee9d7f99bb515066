"""`depthscale plan`: the layouts of a config's model on N GPUs, ranked by predicted step time,
with the `depthscale train` command that launches the best; or `--calibrate`, which measures this
machine as a cluster. Imports no torch unless it calibrates."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from depthscale.cli.output_paths import check_output, write_output
from depthscale.errors import ConfigError


def run(args: argparse.Namespace, rest: list[str]) -> int:
    if args.calibrate:
        import json

        from depthscale.parallel.calibrate import measure_cluster

        out = Path(args.calibrate)
        check_output("--calibrate", out)
        write_output(out, json.dumps(measure_cluster(args.nproc), indent=1) + "\n")
        print(f"wrote {out}: use --cluster {out}")
        return 0
    if args.gpus is None:
        raise ConfigError("plan needs --gpus N (or --calibrate OUT.json)")
    from depthscale.config import load_config
    from depthscale.plan.report import PlanRequest, format_table, to_json
    from depthscale.plan.report import run as plan_layouts
    from depthscale.shape import ModelShape

    cfg = load_config(args.config, rest)
    if cfg.model.vocab_size <= 0:  # as training resolves it: from the tokenizer the config names
        from depthscale.data.tokenizer import planned_vocab_size

        vocab, note = planned_vocab_size(cfg.data)
        cfg.resolve_vocab_size(vocab)
        if note:
            print(f"depthscale: note: {note}", file=sys.stderr, flush=True)
    name = Path(args.config).stem if args.config else "defaults"
    request = PlanRequest(
        spec=ModelShape.from_config(cfg.model, name=name),
        gpus=args.gpus,
        cluster=args.cluster,
        seq=args.seq or cfg.data.seq_len,
        batch=args.batch or cfg.train.batch_size,
        dtype=args.dtype,
        framework=args.framework,
        layout=args.layout,
        top=args.top,
        tokens=args.tokens or 0.0,
        grad_reduce_dtype=args.grad_reduce_dtype
        or (cfg.parallel.grad_reduce_dtype if args.framework == "depthscale" else "float32"),
        failures_per_day=args.failures_per_day,
        intervals=(cfg.checkpoint.snapshot_every, cfg.checkpoint.every)
        if cfg.checkpoint.every
        else None,
        optimizer=cfg.optim.name,
        muon_ns_steps=cfg.optim.muon_ns_steps,
        qk_clip_tau=cfg.optim.qk_clip_tau,
    )
    if args.memory_recoverable is not None:
        request.memory_recoverable = args.memory_recoverable
    try:
        report = plan_layouts(request)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if args.framework == "depthscale":
        report["launch"] = _launch_command(args, rest, cfg, report)
    print(to_json(report) if args.json else format_table(report), flush=True)
    if args.layout and not any(r["ok"] for r in report["layouts"]):
        # the one layout asked for cannot run: a script (or CI) must not read the answer as yes
        reason = "; ".join(f"{r['label']}: {r['reason']}" for r in report["layouts"])
        print(f"depthscale: plan: --layout {args.layout} is rejected ({reason})", file=sys.stderr)
        return 1
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
        ("parallel.grad_reduce_dtype", args.grad_reduce_dtype, cfg.parallel.grad_reduce_dtype),
    ):
        if value is not None and value != ours:
            cmd += [f"--{key}", str(value)]
    cmd += ["--nproc", str(per_node)]
    if nodes > 1:
        cmd += ["--parallel.nnodes", str(nodes), "--parallel.node_rank", "RANK"]
        cmd += ["--parallel.master_addr", "HOST", "--parallel.master_port", "29500"]
    cmd += train_flags(Layout(**row["layout"]), cfg)
    return {"layout": row["label"], "nodes": nodes, "command": shlex.join(cmd)}
