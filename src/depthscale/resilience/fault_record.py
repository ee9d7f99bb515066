"""A fault the supervisor found (`watch.Watch`, `peers`): what, where, since when, on what evidence."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Fault:
    kind: str
    """dead, hung, slow, error, bad_node (failed the diagnostics), peer (another node's fault,
    multi-node), lost (another node gone whole, multi-node), or stopped (a stop signal to the
    supervisor, not a fault)."""
    ranks: list[int]
    nodes: list[str]
    detail: str
    since: float
    """When it began (wall time; estimated from the last sign of life or progress)."""
    detected_at: float
    evidence: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        if self.kind == "lost":  # a node gone whole: named as its supervisor's peers know it
            ranks = ", ".join(map(str, self.ranks)) or "unknown"
            who = f"{self.evidence.get('node') or ', '.join(self.nodes)} (ranks {ranks})"
        elif len(self.nodes) == len(self.ranks):
            who = ", ".join(
                f"rank {r}{_where(self.evidence.get('coords', {}).get(str(r)))} on node {n}"
                for r, n in zip(self.ranks, self.nodes)
            )
        else:  # a node's ranks
            who = f"node(s) {', '.join(self.nodes)} (ranks {', '.join(map(str, self.ranks))})"

        return (
            f"{self.kind}: {who}: {self.detail} "
            f"(detected {self.detected_at - self.since:.2f} s after it began)"
        )


def _where(coords: dict | None) -> str:
    if not coords:
        return ""
    return " (" + " ".join(f"{k}{coords[k]}" for k in ("pp", "dp", "cp", "tp") if k in coords) + ")"
