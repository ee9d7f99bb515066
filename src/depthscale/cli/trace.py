"""`depthscale trace`: what a run's traces say (the merged timeline, stragglers, a hang), its
AttnRes depth weights, or a pipeline schedule simulated and drawn."""

from __future__ import annotations

import argparse
from pathlib import Path

from depthscale.cli.output_paths import check_output
from depthscale.errors import ConfigError


def run(args: argparse.Namespace) -> int:
    if args.out:  # and the file written beside it (depth: its numbers; timeline: one step's PNG)
        out = Path(args.out)
        beside = {"depth": ".json", "timeline": ".png"}.get(args.what)
        for path in (out, out.with_suffix(beside)) if beside else (out,):
            check_output("--out", path)
    if args.what == "schedule":
        return _schedule(args)
    if args.what in ("timeline", "stragglers", "hang"):
        from depthscale.observe.trace_report import run_report

        out = Path(args.out) if args.out else None
        return run_report(args.what, Path(args.run), out, args.step)
    return _depth(args)


def _depth(args: argparse.Namespace) -> int:
    import json

    from depthscale.data.loader import build_data
    from depthscale.interop.run_dir import load_run, run_config
    from depthscale.observe.depth_trace import plot_depth_trace, trace_depth

    run_dir = Path(args.run)
    model, _ = load_run(run_dir, args.checkpoint)
    cfg = run_config(run_dir)
    data = build_data(cfg.data, cfg.train.seed, args.batch)
    split = data.val if data.val is not None else data.train
    tokens, _ = next(iter(split.iter_eval(1)))
    trace = trace_depth(model, tokens)
    out = Path(args.out) if args.out else run_dir / "depth_trace.png"
    plot_depth_trace(trace, out)
    out.with_suffix(".json").write_text(json.dumps(vars(trace), indent=1))
    print(f"wrote {out} and {out.with_suffix('.json')}")
    return 0


def _schedule(args: argparse.Namespace) -> int:
    from depthscale.parallel.pipeline.schedule_plot import plot_timeline
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
