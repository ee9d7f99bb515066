"""What torch's Flight Recorder knows about this rank's collectives, reduced for the hang analysis.

The Flight Recorder (on by default in torch 2.13 for gloo and for NCCL; `TORCH_FR_BUFFER_SIZE=0`
turns it off) keeps a ring buffer of the collectives each process group issued — also the ones
FSDP issues inside torch, which depthscale's own spans never see. A hang dump stores, per group
this rank used: its global ranks and how many collectives it has enqueued, and the collectives not
yet retired, oldest first. `observe/hang.py` then finds, for a rank blocked in collective k of a
group, the members that never joined it.

There are two recorders, one per backend: gloo's (`_dump_fr_trace`) and NCCL's
(`_dump_nccl_trace`, CUDA builds only). Reading gloo's alone on a GPU run saw only the side meshes,
so a rank on NCCL reads both (`dumpers`). NCCL also needs a different rule: the host only queues
a collective and runs ahead, so when one hangs every rank has usually *enqueued* it and the count
of enqueued collectives blames nobody. Its groups therefore also carry what the device did —
`started` (the collective's kernel began: its stream reached it; None where torch does not track
starts, without `TORCH_NCCL_ENABLE_TIMING`) and `completed` — and its pending collectives their
`state` ("scheduled", "started"). A member whose device never started the collective the others
are in is the one they wait for.

`nccl_env` is what a CUDA run sets before its process group exists (`configure_nccl`): start
tracking, a dump of NCCL's own recorder when a collective times out, written into the run
directory (torch's default is a node-local /tmp), and a buffer deep enough for a step of FSDP and
tensor-parallel collectives, which the host queues ahead of the device.

Private torch APIs (pinned by tests/unit/test_private_torch_apis.py):
`torch._C._distributed_c10d._dump_fr_trace` / `_dump_nccl_trace` and
`distributed_c10d._resolve_process_group`. A torch without them gives no record, and the analysis
falls back to the spans.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

NCCL_DUMP = "_dump_nccl_trace"
GLOO_DUMP = "_dump_fr_trace"

BUFFER_ENTRIES = 20_000
"""TORCH_FR_BUFFER_SIZE for CUDA runs (torch's default: 2,000). The host may queue a whole step's
collectives — FSDP's three per layer and micro-batch, tensor parallelism's four — past the one
that hangs; each entry is a few hundred bytes without stacks."""


def dumpers(backend: str) -> tuple[str, ...]:
    """The torch functions, NCCL's first, whose records hold this process's collectives, for the
    world group's backend as `dist.get_backend()` names it ("gloo", "nccl", "cpu:gloo,cuda:nccl").
    An NCCL run also has gloo side groups (clock sync, step statistics): both are read."""
    return (NCCL_DUMP, GLOO_DUMP) if "nccl" in backend else (GLOO_DUMP,)


def dump_prefix(run_dir: Path) -> Path:
    """Where NCCL's recorder writes its own dumps on a timeout: RUN/trace/nccl/rank<R> (torch adds
    the rank), for torch's `torchfrtrace` analyser."""
    return Path(run_dir) / "trace" / "nccl" / "rank"


def nccl_env(run_dir: Path) -> dict[str, str]:
    """The environment a CUDA run's NCCL groups are made under (see the module docstring)."""
    prefix = str(dump_prefix(run_dir))
    return {
        "TORCH_FR_BUFFER_SIZE": str(BUFFER_ENTRIES),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_ENABLE_TIMING": "1",  # else `last_started_collective` stays -1
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,  # the older name; the two must agree
    }


def configure_nccl(run_dir: Path, environ: dict | None = None) -> None:
    """Set `nccl_env` where the user has not (torch reads it when the first NCCL group is made:
    call this before `init_process_group`). The dump folder is made later (`make_dump_dir`)."""
    environ = os.environ if environ is None else environ
    for name, value in nccl_env(run_dir).items():
        environ.setdefault(name, value)


def make_dump_dir(environ: dict | None = None) -> None:
    """Create the folder of `TORCH_FR_DUMP_TEMP_FILE`: torch writes into it and creates nothing.
    Called once the previous attempt's RUN/trace has been archived (`train/telemetry.py`), which
    takes that attempt's NCCL dumps along. No-op when unset."""
    environ = os.environ if environ is None else environ
    prefix = environ.get("TORCH_FR_DUMP_TEMP_FILE")
    if prefix:
        Path(prefix).parent.mkdir(parents=True, exist_ok=True)


def snapshot() -> dict[str, Any] | None:
    """{"groups": {name: {"ranks", "desc", "enqueued"[, "backend", "started", "completed"]}},
    "in_flight": [{"group", "seq", "op"[, "state"]}]} — the bracketed keys for NCCL groups — or
    None without a Flight Recorder, or {"error": ...} when reading every recorder failed."""
    if not dist.is_initialized():
        return None
    c10d = torch._C._distributed_c10d
    found = [(n, getattr(c10d, n)) for n in dumpers(str(dist.get_backend())) if hasattr(c10d, n)]
    if not found:
        return None
    groups: dict[str, dict] = {}
    pending: list[tuple[int, dict]] = []
    errors = []
    for name, dump in found:
        try:
            if name == NCCL_DUMP:
                _use_rank_device()  # it queries CUDA events: not from a thread on GPU 0
            data = pickle.loads(dump(True, False, False))  # collectives, no stacks, all
        except Exception as err:  # noqa: BLE001 — a dump must never fail because of the recorder
            errors.append(f"{name}: {err!r}")
            continue
        reduce(data, name == NCCL_DUMP, groups, pending)
    if errors and not groups:
        return {"error": "; ".join(errors)}
    pending.sort(key=lambda p: p[0])  # oldest first, over both recorders
    return {"groups": groups, "in_flight": [e for _, e in pending], **_errors(errors)}


def _errors(errors: list[str]) -> dict:
    return {"errors": errors} if errors else {}


def reduce(
    data: dict, nccl: bool, groups: dict[str, dict], pending: list[tuple[int, dict]]
) -> None:
    """Add one recorder's dump (`data`, torch's format) to `groups` and `pending` ((time created,
    entry) of the collectives not yet retired)."""
    by_id: dict[str, str] = {}
    config = data.get("pg_config") or {}
    for e in data.get("entries", []):
        if e.get("is_p2p"):
            continue  # messages: depthscale's own spans name them with their labels
        name, desc = (list(e.get("process_group") or ["?", ""]) + [""])[:2]
        by_id[str(e.get("pg_id"))] = name
        if name not in groups:
            groups[name] = {"ranks": _ranks(name, config if nccl else {}), "desc": desc,
                            "enqueued": 0}  # fmt: skip
            if nccl:
                groups[name].update(backend="nccl", started=None, completed=0)
        if not e.get("retired") and e.get("state") != "completed":
            op = str(e.get("profiling_name", "?")).split(":")[-1]
            entry = {"group": name, "seq": e.get("collective_seq_id"), "op": op}
            if nccl:
                entry["state"] = str(e.get("state"))
            pending.append((int(e.get("time_created_ns") or 0), entry))
    tracked = nccl and _starts_tracked(data)
    for pg_id, status in (data.get("pg_status") or {}).items():
        if str(pg_id) not in by_id:
            continue
        group = groups[by_id[str(pg_id)]]
        group["enqueued"] = int(status.get("last_enqueued_collective", 0))
        if nccl:
            group["completed"] = max(0, int(status.get("last_completed_collective", 0)))
            started = int(status.get("last_started_collective", -1))
            group["started"] = max(started, group["completed"], 0) if tracked else None


def _starts_tracked(data: dict) -> bool:
    """Whether this NCCL recorder knows when collectives start (its work has start events: torch
    makes them under TORCH_NCCL_ENABLE_TIMING or TORCH_NCCL_DESYNC_DEBUG). Without them every
    pending collective reads "scheduled" and `last_started_collective` -1."""
    if any(
        int(s.get("last_started_collective", -1)) >= 0 for s in data.get("pg_status", {}).values()
    ):
        return True
    if any(e.get("time_discovered_started_ns") for e in data.get("entries", [])):
        return True
    flags = (
        os.environ.get(v, "0") for v in ("TORCH_NCCL_ENABLE_TIMING", "TORCH_NCCL_DESYNC_DEBUG")
    )
    return any(f.strip().lower() in ("1", "true", "yes", "on") for f in flags)


def _use_rank_device() -> None:
    """Make the rank's GPU current in the calling thread (the watchdog's, whose device is 0 until
    set): the world group is bound to it at start-up (`init_process_group(device_id=)`)."""
    device = getattr(dist.group.WORLD, "bound_device_id", None)
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)


def _ranks(name: str, config: dict) -> list[int]:
    """The group's global ranks: from the dump's pg_config (NCCL's is keyed by group name; gloo's,
    in torch 2.13, by an empty one), else from the live group."""
    try:
        return [int(r) for r in json.loads(config[name]["ranks"])]
    except (KeyError, TypeError, ValueError):
        pass
    try:
        from torch.distributed import distributed_c10d

        return dist.get_process_group_ranks(distributed_c10d._resolve_process_group(name))
    except Exception:  # noqa: BLE001 — a group destroyed since: its members stay unknown
        return []
