"""Draw a pipeline schedule: time on x, rank on y, forward / backward boxes per (microbatch, stage),
idle time left white. Works on a simulated timeline (`schedules.simulate`) or measured events."""

from __future__ import annotations

from pathlib import Path

from depthscale.parallel.pipeline.schedules import Kind, Timeline


def plot_timeline(timeline: Timeline, path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = len(timeline.events)
    fig, ax = plt.subplots(figsize=(max(8.0, timeline.makespan * 0.35), 0.7 * ranks + 1.4))
    n_stages = 1 + max((a.stage for ev in timeline.events for _, _, a in ev), default=0)
    cmap_f, cmap_b = plt.get_cmap("Blues"), plt.get_cmap("Oranges")
    for r, events in enumerate(timeline.events):
        for start, end, a in events:
            shade = 0.35 + 0.55 * (a.stage // ranks) / max(1, (n_stages - 1) // ranks or 1)
            color = cmap_f(shade) if a.kind == Kind.F else cmap_b(shade)
            ax.barh(r, end - start, left=start, color=color, edgecolor="black", linewidth=0.4)
            ax.text((start + end) / 2, r, str(a.microbatch), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.invert_yaxis()
    ax.set_xlabel("time (forward = 1 unit)")
    ax.set_title(
        title + "   (blue: forward, orange: backward; darker: later virtual stage; white: idle)",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
