"""Stragglers, named online: which rank is slower than the ranks doing the same work, in which phase.

Every step each rank reports its busy time per phase (`observe.spans.take_busy`: the time it worked
itself, waits for peers excluded; `data` is its wait for the next batch), and the trainer hands all
ranks' rows to `StragglerDetector.update` — on every rank, so the verdict needs no extra message.

The rules, and why:
- **Peers are the ranks of one pipeline stage.** Stages do different work (the last one computes the
  loss), so a rank is only ever compared with ranks holding the same layers. A stage of one rank
  (pure pipeline parallelism) is compared with its own history instead.
- **Two verdicts per rank: compute and data.** Compute is the sum of the forward, backward and
  optimizer busy times (their jitter partly cancels; a slow device slows all three); a flag names
  the part that grew most against the peers. Data is the wait for the next batch.
- **Robust, sustained.** A rank's recent value is the median of its last `window` steps (one
  slow step — a page fault, a preempted core — moves no median); it is flagged once that value
  exceeds the reference by `threshold`, by `floor_ns` and by `min_share` (5 %) of the peers'
  whole step, for `sustain` steps in a row, and flagged once until it recovers. A rank that costs
  the group under 5 % of a step is no straggler worth a line: short phases cannot flag on jitter
  (a data wait of 0.05 → 0.57 ms in a 200 ms step named a false straggler in a clean 1,000-step
  run; 0.04 → 1.6 ms in a ~70 ms step beside rank 0's background checkpoint writer on a loaded box,
  "4273 % slower", in another).
- **The reference is the lower median of the peers' recent values** (of two peers: the faster), so
  one slow rank of two stands out instead of pulling the reference up with it.
- **Waiting is not blamed.** A rank that waits for a slow peer is not busy while it waits, so its
  numbers do not grow; a slow data loader shows in that rank's `data` phase only.

`read_step_records` and `plot_heatmap` run the same data offline (`depthscale trace stragglers`).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from depthscale.observe.spans import BUSY_PHASES, read_trace_file, trace_files

VERDICTS = ("compute", "data")
_COMPUTE = tuple(BUSY_PHASES.index(p) for p in ("forward", "backward", "optimizer"))
_DATA = BUSY_PHASES.index("data")


def where(coords: dict[str, int]) -> str:
    """A rank's coordinates as people read them: "pp1 dp0 cp0 tp1"."""
    return " ".join(f"{k}{coords[k]}" for k in ("pp", "dp", "cp", "tp") if k in coords)


@dataclass(frozen=True)
class Flag:
    step: int
    rank: int
    coords: dict[str, int]
    phase: str
    ms: float
    """The rank's recent busy time in the phase, per step."""
    reference_ms: float
    """What it is compared with: its peers' lower median, or its own best (`against`)."""
    against: str
    """"peers" or "own history"."""
    since: int
    """The first step of the sustained slowdown."""
    recovered: bool = False

    @property
    def ratio(self) -> float:
        return self.ms / self.reference_ms if self.reference_ms > 0 else float("inf")

    def message(self) -> str:
        who = f"rank {self.rank} ({where(self.coords)})"
        if self.recovered:
            return f"straggler recovered at step {self.step}: {who} in {self.phase}"
        return (
            f"straggler at step {self.step}: {who} is {self.ratio - 1:.0%} slower than its "
            f"{self.against} in {self.phase} ({self.ms:.2f} ms vs {self.reference_ms:.2f} ms per "
            f"step, since step {self.since})"
        )

    def as_record(self) -> dict:
        return {
            "step": self.step,
            "rank": self.rank,
            "coords": self.coords,
            "phase": self.phase,
            "ratio": round(self.ratio, 4),
            "ms": round(self.ms, 4),
            "reference_ms": round(self.reference_ms, 4),
            "against": self.against,
            "since": self.since,
            "recovered": self.recovered,
        }


class StragglerDetector:
    """Fed every rank's busy row per step (`update`); returns the flags raised or cleared."""

    def __init__(
        self,
        coords: list[dict[str, int]],
        threshold: float = 0.12,
        window: int = 8,
        sustain: int = 2,
        floor_ns: float = 0.5e6,
        warmup: int = 3,
        min_share: float = 0.05,
    ) -> None:
        self.coords, self.threshold, self.window = coords, threshold, window
        self.sustain, self.floor_ns, self.warmup = sustain, floor_ns, warmup
        self.min_share = min_share
        self.phases = VERDICTS
        self.seen = 0
        self.history: list[deque[list[float]]] = [deque(maxlen=window) for _ in coords]
        stages: dict[int, list[int]] = {}
        for rank, c in enumerate(coords):
            stages.setdefault(c.get("pp", 0), []).append(rank)
        self.peers = [stages[c.get("pp", 0)] for c in coords]
        n = len(VERDICTS)
        self.best = [[float("inf")] * n for _ in coords]
        self.slow_for = [[0] * n for _ in coords]
        self.flagged = [[False] * n for _ in coords]

    def update(self, step: int, busy: list[list[float]]) -> list[Flag]:
        """`busy[rank][i]`: ns the rank worked in BUSY_PHASES[i] during `step`."""
        self.seen += 1
        if self.seen <= self.warmup:  # first steps: allocation, compilation, kernel builds
            return []
        for rank, row in enumerate(busy):
            self.history[rank].append(list(row))
        if len(self.history[0]) < self.window:
            return []
        parts = [[statistics.median(h[i] for h in hist) for i in _COMPUTE] for hist in self.history]
        recent = [
            [statistics.median(sum(h[i] for i in _COMPUTE) for h in hist),
             statistics.median(h[_DATA] for h in hist)]
            for hist in self.history
        ]  # fmt: skip
        self._parts = parts
        flags = []
        for rank in range(len(self.coords)):
            for i, phase in enumerate(self.phases):
                flag = self._judge(step, rank, i, phase, recent)
                if flag is not None:
                    flags.append(flag)
        for rank, values in enumerate(recent):
            self.best[rank] = [min(b, v) for b, v in zip(self.best[rank], values)]
        return flags

    def _judge(self, step: int, rank: int, i: int, phase: str, recent) -> Flag | None:
        value = recent[rank][i]
        peers = self.peers[rank]
        if len(peers) > 1:
            values = sorted(recent[p][i] for p in peers)
            reference, against = values[(len(values) - 1) // 2], "peers"
            steps = sorted(sum(recent[p]) for p in peers)
            step_ns = steps[(len(steps) - 1) // 2]
        else:
            reference, against = self.best[rank][i], "own history"
            step_ns = sum(self.best[rank])
        if phase == "compute" and len(peers) > 1:
            grown = [
                self._parts[rank][j]
                - sorted(self._parts[p][j] for p in peers)[(len(peers) - 1) // 2]
                for j in range(len(_COMPUTE))
            ]
            phase = f"compute ({BUSY_PHASES[_COMPUTE[grown.index(max(grown))]]})"
        slow = (
            reference != float("inf")
            and value >= (1 + self.threshold) * reference
            and value - reference >= max(self.floor_ns, self.min_share * step_ns)
        )
        self.slow_for[rank][i] = self.slow_for[rank][i] + 1 if slow else 0
        flagged = self.flagged[rank][i]
        if slow and not flagged and self.slow_for[rank][i] >= self.sustain:
            self.flagged[rank][i] = True
            since = step - self.slow_for[rank][i] - self.window // 2 + 1
            return Flag(step, rank, self.coords[rank], phase, value / 1e6, reference / 1e6,
                        against, max(1, since))  # fmt: skip
        if flagged and not slow:
            self.flagged[rank][i] = False
            return Flag(step, rank, self.coords[rank], phase, value / 1e6, reference / 1e6,
                        against, step, recovered=True)  # fmt: skip
        return None


# ------------------------------------------------------------------------------ offline


@dataclass
class StepRecords:
    """What a run's trace files say per rank: coordinates, busy ns per phase per step, flags."""

    coords: dict[int, dict[str, int]]
    busy: dict[int, dict[int, dict[str, int]]]
    """rank → step → phase → ns."""
    flags: list[dict]


def read_step_records(run_dir: Path) -> StepRecords:
    coords, busy, flags = {}, {}, []
    for path in trace_files(run_dir):
        meta, records = read_trace_file(path)
        rank = meta["rank"]
        coords[rank], busy[rank] = meta.get("coords", {}), {}
        for n, record in records:
            if record.get("kind") == "step":
                phases = record.get("busy")
                if not isinstance(record.get("step"), int) or not isinstance(phases, dict):
                    raise ValueError(f"{path}:{n}: a step record needs step and busy")
                busy[rank][record["step"]] = phases
            elif record.get("kind") == "straggler":
                flags.append(record)
    return StepRecords(coords, busy, flags)


def replay(records: StepRecords, threshold: float = 0.12) -> list[Flag]:
    """The detector run over a run's recorded steps (steps every rank recorded)."""
    ranks = sorted(records.coords)
    detector = StragglerDetector([records.coords[r] for r in ranks], threshold=threshold)
    common = set.intersection(*(set(records.busy[r]) for r in ranks))
    flags = []
    for step in sorted(common):
        rows = [[records.busy[r][step].get(p, 0) for p in BUSY_PHASES] for r in ranks]
        flags += detector.update(step, rows)
    return flags


def compute_grid(records: StepRecords) -> dict[int, float]:
    """Per rank: mean busy forward + backward per step over the stage's median (1.0 = typical)."""
    mean = {
        r: statistics.fmean(s.get("forward", 0) + s.get("backward", 0) for s in steps.values())
        for r, steps in records.busy.items()
        if steps
    }
    stage_median = {}
    for r, value in mean.items():
        stage_median.setdefault(records.coords[r].get("pp", 0), []).append(value)
    stage_median = {pp: statistics.median(v) for pp, v in stage_median.items()}
    return {
        r: v / stage_median[records.coords[r].get("pp", 0)] if v else 0.0 for r, v in mean.items()
    }


def hottest(records: StepRecords) -> int:
    """The rank whose compute is slowest relative to its stage."""
    grid = compute_grid(records)
    return max(grid, key=grid.get)


def plot_heatmap(records: StepRecords, out: Path) -> Path:
    """Left: the rank grid (rows: pipeline stages; columns: dp × cp × tp) coloured by compute time
    relative to the stage's median. Right: rank × step, each step's compute time over the step's
    median across the rank's stage. The title names the hottest cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    grid = compute_grid(records)
    ranks = sorted(grid)
    stages = sorted({records.coords[r].get("pp", 0) for r in ranks})
    columns = sorted({_column(records.coords[r]) for r in ranks})
    cells = np.full((len(stages), len(columns)), np.nan)
    for r in ranks:
        c = records.coords[r]
        cells[stages.index(c.get("pp", 0)), columns.index(_column(c))] = grid[r]
    steps = sorted(set.intersection(*(set(records.busy[r]) for r in ranks)))
    per_step = np.array(
        [[records.busy[r][s].get("forward", 0) + records.busy[r][s].get("backward", 0)
          for s in steps] for r in ranks], dtype=float,
    )  # fmt: skip
    for pp in stages:  # relative to the stage's median rank at each step
        rows = [i for i, r in enumerate(ranks) if records.coords[r].get("pp", 0) == pp]
        per_step[rows] /= np.maximum(np.median(per_step[rows], axis=0), 1e-9)
    hot = hottest(records)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4), width_ratios=[1, 2])
    image = left.imshow(cells, cmap="inferno", vmin=min(0.9, np.nanmin(cells)))
    left.set_xticks(range(len(columns)), [f"dp{d} cp{c} tp{t}" for d, c, t in columns],
                    rotation=45, ha="right", fontsize=7)  # fmt: skip
    left.set_yticks(range(len(stages)), [f"pp{p}" for p in stages])
    for (i, j), v in np.ndenumerate(cells):
        if not np.isnan(v):
            left.text(j, i, f"{v:.2f}", ha="center", va="center", color="cyan", fontsize=8)
    fig.colorbar(image, ax=left, label="compute / stage median")
    right.imshow(per_step, aspect="auto", cmap="inferno", interpolation="nearest",
                 extent=(steps[0] - 0.5, steps[-1] + 0.5, len(ranks) - 0.5, -0.5))  # fmt: skip
    right.set_yticks(range(len(ranks)), [f"r{r}" for r in ranks], fontsize=7)
    right.set_xlabel("step")
    fig.suptitle(
        f"forward+backward busy time per rank; hottest: rank {hot} "
        f"({where(records.coords[hot])}), {grid[hot]:.2f}× its stage's median"
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _column(c: dict[str, int]) -> tuple[int, int, int]:
    return (c.get("dp", 0), c.get("cp", 0), c.get("tp", 0))
