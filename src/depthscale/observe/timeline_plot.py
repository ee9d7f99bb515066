"""One step of the merged timeline as a picture: a row per rank, its work as bars, its messages as
arrows — for a report, a doc or a terminal without a browser (`depthscale trace timeline` writes it
beside the Perfetto trace, which is the one to explore)."""

from __future__ import annotations

from pathlib import Path

from depthscale.observe.timeline import MESSAGE_CATS, RankTrace, _coord_key, match_messages

COLORS = {
    "forward": "#4c78a8",
    "backward": "#54a24b",
    "optimizer": "#e45756",
    "data": "#b279a2",
    "checkpoint": "#9d755d",
    "eval": "#bab0ac",
    "gc": "#000000",
}
COLLECTIVE = "#f58518"


def last_common_step(ranks: dict[int, RankTrace]) -> int | None:
    """The newest step every rank finished (its `step` span ended)."""
    finished = [{s["step"] for s in t.spans if s["name"] == "step"} for t in ranks.values()]
    common = set.intersection(*finished) if finished else set()
    return max(common) if common else None


def plot_step(ranks: dict[int, RankTrace], offsets: dict[int, int], step: int, out: Path) -> Path:
    """Draw `step` of every rank on rank 0's clock (`offsets` from `timeline.align_clocks`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    order = sorted(ranks, key=lambda r: _coord_key(ranks[r].meta))
    row = {rank: i for i, rank in enumerate(order)}
    chosen = [(r, s) for r, t in ranks.items() for s in t.spans if s["step"] == step]
    if not chosen:
        raise ValueError(f"no rank recorded step {step}")
    t0 = min(s["ts"] + offsets[r] for r, s in chosen)

    def ms(rank: int, ns: int) -> float:
        return (ns + offsets[rank] - t0) / 1e6

    fig, ax = plt.subplots(figsize=(13, 0.6 * len(order) + 1.6))
    for rank, s in chosen:
        y, start, width = row[rank], ms(rank, s["ts"]), s["dur"] / 1e6
        if s["cat"] == "collective":
            ax.barh(y + 0.3, width, left=start, height=0.2, color=COLLECTIVE)
        elif s["name"] in COLORS and s["cat"] not in MESSAGE_CATS:
            ax.barh(y, width, left=start, height=0.5, color=COLORS[s["name"]])
    pairs, _ = match_messages({r: _only_step(t, step) for r, t in ranks.items()})
    for src, send, dst, recv in pairs:
        x0, x1 = ms(src, send["ts"]), ms(dst, recv["ts"] + recv["dur"])
        ax.annotate("", xy=(x1, row[dst]), xytext=(x0, row[src]),
                    arrowprops={"arrowstyle": "->", "color": "#555555", "lw": 0.6})  # fmt: skip
    ax.set_yticks(range(len(order)), [_label(ranks[r].meta) for r in order], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step's first event (rank 0's clock)")
    legend = [Patch(color=c, label=n) for n, c in COLORS.items()]
    legend.append(Patch(color=COLLECTIVE, label="collective"))
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.005, 1), fontsize=8)
    ax.set_title(f"step {step}: {len(pairs)} messages drawn as arrows (send start → receive end)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _only_step(t: RankTrace, step: int) -> RankTrace:
    return RankTrace(t.rank, t.meta, t.clock, [s for s in t.spans if s["step"] == step])


def _label(meta: dict) -> str:
    c = meta.get("coords", {})
    return f"r{meta['rank']} " + " ".join(f"{k}{c[k]}" for k in ("pp", "dp", "cp", "tp") if k in c)
