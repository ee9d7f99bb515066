"""From the rows of every rank to a verdict per node: `flag_outliers(rows, baseline) -> Report`,
pure (no processes), and `format_table(report)` for people; `Report.to_json()` for programs.

A node fails when any of its ranks fails a check:
- correctness: the rank whose *data* was wrong is blamed (every receiver names its sources);
- a local bandwidth (memcpy, host↔device, checkpoint write) below the median of the ranks /
  `slow_factor`, or below the baseline's median / `slow_factor`;
- neighbour exchanges: a pair below the median of the pairs / `slow_factor` (or the baseline's);
  a rank all of whose pairs are slow is the slow one; a slow pair that no slow rank explains is a
  slow link, and both its ends are named;
- a collective whose bandwidth on one rank is below the median of the ranks / `slow_factor`;
- a checkpoint directory that cannot be written, or free disk below `min_free_bytes`;
- (from `diagnose`) a rank that crashed, or stayed silent past the timeout.
A collective slower than the baseline on every rank is a warning: a slow rank delays all its peers
in a collective, so it names no node (the exchanges and local checks do that).

SLOW_FACTOR = 5: on this 2-core box, 4 diagnostic ranks beside other engineers' jobs (load 4–9),
30 healthy runs put a rank or exchange at most 2.7× below the median (3.3× once, before the
exchanges took the best of 8 runs) and a collective at most 3.9× below the first run's baseline
(a warning only); an injected `slow` fault reads ≥ 10× lower. A write+fsync races other
processes' I/O, so the checkpoint write is flagged only when DISK_SLOW_FACTOR slower. The median
catches a minority of slow nodes; when half the ranks or more are slow, the median is slow too
and only the baseline tells: keep the first healthy run's baseline.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field

SLOW_FACTOR = 5.0
DISK_SLOW_FACTOR = 10.0
MIN_FREE_BYTES = 2**30
"""Free-disk floor when the run has no checkpoint yet; with one, twice its size if larger."""
COLLECTIVES = ("all_reduce", "all_to_all", "reduce_scatter")
LOCAL = ("memcpy", "h2d", "d2h", "ckpt_write")
PAIRS = "send_recv"


@dataclass(frozen=True)
class Failure:
    node: str
    rank: int
    check: str
    detail: str


@dataclass
class Report:
    rows: list[dict]
    failures: list[Failure] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    pairs: dict[str, float] = field(default_factory=dict)
    """Bandwidth of each neighbour exchange "a-b", MB/s each way (the lower of its two ends)."""
    baseline: dict[str, float] | None = None
    info: dict = field(default_factory=dict)
    """Where the report came from: nproc, size_mb, checkpoint directory, time, wall seconds."""

    @property
    def healthy(self) -> bool:
        return not self.failures

    @property
    def bad_nodes(self) -> dict[str, list[str]]:
        """Each failing node → "rank(s) R check: detail" lines (ranks with the same failure
        together), nodes sorted."""
        ranks: dict[tuple[str, str, str], list[int]] = {}
        for f in sorted(self.failures, key=lambda f: (f.node, f.rank, f.check)):
            ranks.setdefault((f.node, f.check, f.detail), []).append(f.rank)
        bad: dict[str, list[str]] = {}
        for (node, check, detail), rs in ranks.items():
            who = f"rank {rs[0]}" if len(rs) == 1 else f"ranks {','.join(map(str, rs))}"
            bad.setdefault(node, []).append(f"{who} {check}: {detail}")
        return bad

    def to_json(self) -> str:
        data = asdict(self)
        data.update(healthy=self.healthy, bad_nodes=self.bad_nodes)
        return json.dumps(data, indent=1)


def flag_outliers(
    rows: list[dict],
    baseline: dict[str, float] | None,
    slow_factor: float = SLOW_FACTOR,
    min_free_bytes: int = MIN_FREE_BYTES,
) -> Report:
    """The verdict on one diagnostics run (rows as `diagnostics.run_checks` returns them, one per
    rank); `baseline`: `baseline_values` of an earlier healthy run of the same shape, or None."""
    report = Report(rows=rows, baseline=baseline)
    node = {row["rank"]: row["node"] for row in rows}

    def fail(rank: int, check: str, detail: str) -> None:
        report.failures.append(Failure(node.get(rank, "?"), rank, check, detail))

    def slow(value: float, reference: float | None, factor: float = slow_factor) -> bool:
        return reference is not None and value < reference / factor

    _correctness(rows, fail)
    for check in (*LOCAL, *COLLECTIVES):
        values = {r["rank"]: r["checks"][check].get("value") for r in rows if check in r["checks"]}
        values = {rank: v for rank, v in values.items() if v is not None}
        if not values:
            continue
        med = statistics.median(values.values())
        base = (baseline or {}).get(check)
        factor = DISK_SLOW_FACTOR if check == "ckpt_write" else slow_factor
        for rank, value in values.items():
            if slow(value, med, factor):
                fail(rank, check, f"{value:.0f} MB/s < median {med:.0f} / {factor:g}")
            elif check in LOCAL and slow(value, base, factor):
                fail(rank, check, f"{value:.0f} MB/s < baseline {base:.0f} / {factor:g}")
        if check in COLLECTIVES and slow(med, base):
            report.warnings.append(
                f"{check}: {med:.0f} MB/s on the median rank < baseline {base:.0f} / "
                f"{slow_factor:g} (a collective names no node: see the exchanges)"
            )
    report.pairs = _pair_bandwidths(rows)
    _slow_pairs(report.pairs, (baseline or {}).get(PAIRS), slow, slow_factor, fail)
    _disk(rows, min_free_bytes, fail)
    return report


def _correctness(rows: list[dict], fail) -> None:
    """Blame the source of wrong data once per (check, source), naming who saw it."""
    seen: dict[tuple[str, int], list[int]] = {}
    for row in rows:
        for check, result in row["checks"].items():
            if result["ok"] or check in ("ckpt_write", "free_disk"):
                continue
            for source in result.get("bad_sources") or [row["rank"]]:
                seen.setdefault((check, source), []).append(row["rank"])
    for (check, source), observers in sorted(seen.items()):
        fail(source, check, f"wrong data from rank {source} (seen by rank(s) {observers})")


def _pair_bandwidths(rows: list[dict]) -> dict[str, float]:
    pairs: dict[str, float] = {}
    for row in rows:
        for pair, value in row["checks"].get(PAIRS, {}).get("pairs", {}).items():
            pairs[pair] = min(value, pairs.get(pair, value))
    return dict(sorted(pairs.items(), key=lambda kv: tuple(map(int, kv[0].split("-")))))


def _slow_pairs(pairs: dict[str, float], base: float | None, slow, factor: float, fail) -> None:
    if not pairs:
        return
    med = statistics.median(pairs.values())
    flagged = {p: v for p, v in pairs.items() if slow(v, med) or slow(v, base)}
    if not flagged:
        return
    reference = f"median {med:.0f}" + (f", baseline {base:.0f}" if base is not None else "")
    ends = {p: tuple(map(int, p.split("-"))) for p in pairs}
    ranks = {r for e in ends.values() for r in e}
    slow_ranks = {r for r in ranks if all(p in flagged for p, e in ends.items() if r in e)}
    for rank in sorted(slow_ranks):
        mine = ", ".join(f"{p} {flagged[p]:.0f}" for p, e in ends.items() if rank in e)
        fail(rank, PAIRS, f"every exchange slow: {mine} MB/s ({reference}; / {factor:g})")
    for pair, value in flagged.items():
        if not slow_ranks & set(ends[pair]):
            for rank in ends[pair]:
                fail(rank, PAIRS, f"slow link {pair}: {value:.0f} MB/s ({reference}; / {factor:g})")


def _disk(rows: list[dict], min_free_bytes: int, fail) -> None:
    for row in rows:
        checks = row["checks"]
        write = checks.get("ckpt_write")
        if write is not None and not write["ok"]:
            fail(row["rank"], "ckpt_write", write["detail"])
        free = checks.get("free_disk")
        if free is None:
            continue
        if not free["ok"]:
            fail(row["rank"], "free_disk", free["detail"])
        elif free["value"] < min_free_bytes:
            fail(
                row["rank"],
                "free_disk",
                f"{free['value'] / 2**30:.2f} GiB free in {free['detail']} < floor "
                f"{min_free_bytes / 2**30:.2f} GiB",
            )


def baseline_values(report: Report) -> dict[str, float]:
    """What a later run is compared with: the median of each bandwidth over ranks (pairs: over
    pairs) of this healthy run."""
    base: dict[str, float] = {}
    for check in (*LOCAL, *COLLECTIVES):
        values = [
            r["checks"][check]["value"]
            for r in report.rows
            if r["checks"].get(check, {}).get("value") is not None
        ]
        if values:
            base[check] = statistics.median(values)
    if report.pairs:
        base[PAIRS] = statistics.median(report.pairs.values())
    return base


def format_table(report: Report) -> str:
    """One line per rank under headers that carry their unit (`!` marks a flagged value, `x` a
    failed check), the exchanges, then the verdict. Collectives are bus bandwidth (nccl-tests'
    convention), the local checks bytes copied or written per second."""
    flagged = {(f.rank, f.check) for f in report.failures}
    checks = [c for c in (*COLLECTIVES, *LOCAL) if any(c in r["checks"] for r in report.rows)]
    has_disk = any("free_disk" in r["checks"] for r in report.rows)
    units = [f"{c} {'bus MB/s' if c in COLLECTIVES else 'MB/s'}" for c in checks]
    header = ["rank", "node", *units, *(["free_disk GiB"] if has_disk else [])]
    lines = [header]
    for row in sorted(report.rows, key=lambda r: r["rank"]):
        cells = [str(row["rank"]), row["node"]]
        for check in checks:
            result = row["checks"].get(check, {})
            value = result.get("value")
            text = "-" if value is None else f"{value:.0f}"
            if not result.get("ok", True):
                text = "x"
            cells.append(text + ("!" if (row["rank"], check) in flagged else ""))
        if has_disk:
            free = row["checks"].get("free_disk", {})
            text = "x" if not free.get("ok", True) else f"{free.get('value', 0) / 2**30:.1f}"
            cells.append(text + ("!" if (row["rank"], "free_disk") in flagged else ""))
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = ["  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
    if report.pairs:
        out.append(
            "exchanges (MB/s each way): "
            + "  ".join(f"{p} {v:.0f}" for p, v in report.pairs.items())
        )
    out += [f"warning: {w}" for w in report.warnings]
    if report.healthy:
        out.append("healthy: every node passed")
    for node, reasons in report.bad_nodes.items():
        out.append(f"FAILED node {node}: " + "; ".join(reasons))
    return "\n".join(out)
