"""`depthscale trace timeline | stragglers | hang --run DIR`: a run's traces, read for people."""

from __future__ import annotations

from pathlib import Path

from depthscale.errors import DepthscaleError


def run_report(what: str, run: Path, out: Path | None, step: int | None = None) -> int:
    if not run.is_dir():
        raise DepthscaleError(f"{run} is not a run directory")
    try:
        if what == "timeline":
            return _timeline(run, out, step)
        return {"stragglers": _stragglers, "hang": _hang}[what](run, out)
    except ValueError as err:  # a missing or damaged trace file, named by the reader
        raise DepthscaleError(f"trace {what}: {err}") from None


def _timeline(run: Path, out: Path | None, step: int | None) -> int:
    from depthscale.observe.timeline import read_rank_files, write_timeline
    from depthscale.observe.timeline_plot import last_common_step, plot_step

    ranks = read_rank_files(run)
    path, s = write_timeline(run, out, ranks)
    arrows = ", ".join(f"{n} {cat}" for cat, n in sorted(s.flows.items())) or "none"
    print(f"wrote {path}: {s.ranks} ranks, message arrows: {arrows}; open it in ui.perfetto.dev")
    last = last_common_step(ranks)
    if step is not None and (last is None or not 1 <= step <= last):
        raise ValueError(
            f"--step {step} is not a step every rank finished (1 to {last})"
            if last
            else f"--step {step}: no step was finished by every rank"
        )
    if step or last:
        picture = plot_step(ranks, s.offsets_ns, step or last, path.with_suffix(".png"))
        print(f"wrote {picture}: step {step or last} of every rank")
    offsets = ", ".join(f"r{r} {v / 1e6:+.3f}" for r, v in sorted(s.offsets_ns.items()))
    print(f"clock offsets to rank 0 (ms): {offsets}")
    for stage, b in s.bubble.items():
        print(
            f"pipeline stage {stage}: idle/compute {b['measured']:.3f} "
            f"(schedule's (p-1)/(v·m) = {b['theory']:.3f})"
        )
    if s.unmatched:
        print(f"{len(s.unmatched)} message ends without their other end, e.g. {s.unmatched[0]}")
    if s.backward_flows:
        print(f"warning: {s.backward_flows} arrows point back in time (inconsistent clocks)")
    if s.dropped:
        print(f"warning: {s.dropped} events were dropped by the ranks' writers (queue full)")
    return 0


def _stragglers(run: Path, out: Path | None) -> int:
    from depthscale.observe.stragglers import (
        compute_grid,
        hottest,
        plot_heatmap,
        read_step_records,
        replay,
        where,
    )

    records = read_step_records(run)
    if not any(records.busy.values()):
        raise ValueError(f"{run / 'trace'} has no step records yet")
    flags = replay(records)
    for flag in flags:
        print(flag.message())
    if not flags:
        print("no straggler: every rank's busy time is within the threshold of its peers'")
    path = plot_heatmap(records, out or run / "trace" / "stragglers.png")
    hot = hottest(records)
    print(
        f"wrote {path}; hottest: rank {hot} ({where(records.coords[hot])}), "
        f"{compute_grid(records)[hot]:.2f}× its stage's median compute time"
    )
    return 0


def _hang(run: Path, out: Path | None) -> int:
    from depthscale.observe.hang import analyze, format_report, load_dumps

    dumps, metas, world, problems = load_dumps(run)
    report = analyze(dumps, world, metas)
    report.problems += problems
    text = format_report(report, dumps)
    print(text)
    if out is not None:
        out.write_text(text + "\n")
    return 0
