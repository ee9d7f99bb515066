"""`depthscale trace timeline | stragglers | hang --run DIR`: a run's traces, read for people."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from depthscale.errors import DepthscaleError

if TYPE_CHECKING:
    from depthscale.observe.attempts import Launch


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

    folder = _timeline_folder(run)
    ranks = read_rank_files(run, folder)
    path, s = write_timeline(run, out or folder / "timeline.json", ranks)
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


def _timeline_folder(run: Path) -> Path:
    """RUN/trace, unless it holds no span (a start that stopped before its first step, or one
    that trained nothing, written by a version that still archived then): the newest archived
    attempt that does. Says which when the run has archived attempts."""
    from depthscale.observe.attempts import describe, has_spans, trace_folders

    folders = trace_folders(run)
    folder = next((f for f in folders if has_spans(f)), folders[0])
    if len(folders) > 1:
        print(
            f"reading {describe(run, folder)}: {folder} ({len(folders) - 1} archived attempt(s) "
            f"under {folders[0] / 'archive'})"
        )
    return folder


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
    from depthscale.observe.deaths import fates, trace_end
    from depthscale.observe.hang import analyze, format_report, read_dumps

    folder, launch = _failed_attempt(run)
    dumps, metas, world, problems = read_dumps(folder)
    report = analyze(dumps, world, metas)
    report.problems += problems
    report.nodes = dict(launch.node_of) if launch is not None else {}
    report.fates = fates(report.silent, dumps, launch)
    report.ends = {r: end for r in report.silent if (end := trace_end(folder, r)) is not None}
    text = _source_line(run, folder, launch) + "\n" + format_report(report, dumps)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    return 0


def _failed_attempt(run: Path) -> tuple[Path, Launch | None]:
    """(trace folder, its supervised launch or None) of the newest attempt with hang dumps or a
    rank the supervisor found dead or hung; a ValueError when no attempt has either."""
    from depthscale.observe.attempts import has_dumps, supervised_launch, trace_folders, trace_pids

    folders = trace_folders(run)
    for folder in folders:
        pids = trace_pids(folder)
        launch = supervised_launch(run, pids) if pids else None
        failed = launch is not None and any(
            f.get("kind") in ("dead", "hung") for f in launch.faults
        )
        if has_dumps(folder) or failed:
            return folder, launch
    archived = f" nor in the {len(folders) - 1} archived attempt(s)" if len(folders) > 1 else ""
    raise ValueError(
        f"{folders[0] / 'hang'} holds no hang dumps{archived}, and no supervisor recorded a dead "
        "or hung rank: ranks write them when a step stalls for logging.hang_dump_s or a "
        "collective times out (parallel.timeout_s)"
    )


def _source_line(run: Path, folder: Path, launch: Launch | None) -> str:
    """Which attempt the report reads, and when its dumps were written."""
    from depthscale.observe.attempts import describe, written_at

    which = describe(run, folder) + (f" ({launch.describe()})" if launch is not None else "")
    dumps = sorted((folder / "hang").glob("rank*.json"))
    if not dumps:
        return (
            f"{which}: no rank wrote a hang dump; read from the supervisor's records and {folder}"
        )
    return f"hang dumps of {which}, written {written_at(dumps)}: {folder / 'hang'}"
