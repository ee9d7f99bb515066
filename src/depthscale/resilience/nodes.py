"""Which nodes the supervisor may run on: the pool, and the exclusion list kept in the run directory.

A node that fails diagnostics is excluded for the rest of the job (MegaScale evicts it and takes a
healthy one): the list lives in `RUN/supervisor/excluded_nodes.json`, so a supervisor restarted on
the same run directory keeps away from it too. On one host, `resilience.local_nodes` splits the
workers into that many simulated nodes and `resilience.spare_nodes` holds more in reserve, which is
how the exclusion path is drilled without a cluster.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class NodePool:
    def __init__(self, directory: Path, host: str, needed: int, spares: int) -> None:
        self.file = Path(directory) / "excluded_nodes.json"
        self.needed = needed
        total = needed + spares
        self.pool = [host] if total == 1 else [f"{host}/n{i}" for i in range(total)]
        self.records: dict[str, Any] = self._read()

    @property
    def excluded(self) -> list[str]:
        return sorted(self.records)

    def active(self) -> list[str] | None:
        """The nodes to launch on, or None when too few healthy ones are left."""
        healthy = [n for n in self.pool if n not in self.records]
        return healthy[: self.needed] if len(healthy) >= self.needed else None

    def exclude(self, node: str, evidence: dict[str, Any]) -> None:
        self.records[node] = {"evidence": evidence}
        self.file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.records, indent=1, default=str))
        tmp.replace(self.file)

    def _read(self) -> dict[str, Any]:
        try:
            records = json.loads(self.file.read_text())
        except FileNotFoundError:
            return {}
        except ValueError:  # damaged: keep it for a person, start from an empty list
            self.file.replace(self.file.with_suffix(".damaged"))
            return {}
        return records if isinstance(records, dict) else {}
