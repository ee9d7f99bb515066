"""What torch's Flight Recorder knows about this rank's collectives, reduced for the hang analysis.

The Flight Recorder (on by default in torch 2.13 for gloo and for NCCL; `TORCH_FR_BUFFER_SIZE=0`
turns it off) keeps a ring buffer of the collectives each process group issued — also the ones
FSDP issues inside torch, which depthscale's own spans never see. A hang dump stores, per group
this rank used: its global ranks and how many collectives it has enqueued, and the collectives not
yet retired, oldest first. `observe/hang.py` then finds, for a rank blocked in collective k of a
group, the members that never enqueued it.

Private torch APIs (pinned by tests/unit/test_private_torch_apis.py):
`torch._C._distributed_c10d._dump_fr_trace` and `distributed_c10d._resolve_process_group`.
A torch without them gives no record, and the analysis falls back to the spans.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist


def snapshot() -> dict[str, Any] | None:
    """{"groups": {name: {"ranks", "desc", "enqueued"}}, "in_flight": [{"group", "seq", "op"}]}
    — or None without a Flight Recorder, or {"error": ...} when reading it failed."""
    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace", None)
    if dump is None or not dist.is_initialized():
        return None
    try:
        data = pickle.loads(dump(True, False, False))  # collectives, no stacks, not only active
    except Exception as err:  # noqa: BLE001 — a dump must never fail because of the recorder
        return {"error": repr(err)}
    groups: dict[str, dict] = {}
    by_id: dict[str, str] = {}
    in_flight = []
    for e in data.get("entries", []):
        if e.get("is_p2p"):
            continue  # messages: depthscale's own spans name them with their labels
        name, desc = (list(e.get("process_group") or ["?", ""]) + [""])[:2]
        by_id[str(e.get("pg_id"))] = name
        if name not in groups:
            groups[name] = {"ranks": _ranks(name), "desc": desc, "enqueued": 0}
        if not e.get("retired") and e.get("state") != "completed":
            op = str(e.get("profiling_name", "?")).split(":")[-1]
            in_flight.append({"group": name, "seq": e.get("collective_seq_id"), "op": op})
    for pg_id, status in (data.get("pg_status") or {}).items():
        if str(pg_id) in by_id:
            groups[by_id[str(pg_id)]]["enqueued"] = int(status.get("last_enqueued_collective", 0))
    return {"groups": groups, "in_flight": in_flight}


def _ranks(name: str) -> list[int]:
    try:
        from torch.distributed import distributed_c10d

        return dist.get_process_group_ranks(distributed_c10d._resolve_process_group(name))
    except Exception:  # noqa: BLE001 — a group destroyed since: its members stay unknown
        return []
