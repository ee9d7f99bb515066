"""Run the diagnostics as a group from a supervisor process and say which nodes are bad.

    from depthscale.resilience.diagnose import diagnose
    report = diagnose(nproc, run_dir, env_per_rank={2: {"DEPTHSCALE_NODE_ID": "nodeB"}, ...})
    if not report.healthy:
        exclude(report.bad_nodes)          # {node: ["rank 2 all_reduce: wrong data ...", ...]}

`diagnose` starts `nproc` local workers (`python -m depthscale.resilience.diagnostics_worker`)
through torch's elastic `start_processes`, the machinery under torchrun, hosting their store
itself (a private one per call, so a training group's store is never touched). It waits for every
rank to join (`start_timeout_s`), then for the checks (`timeout_s`); a rank that stays silent past
that, or crashes, is a failure naming it and the check it stopped in. Never raises for a failing
node: the verdict is the returned `report.Report`. Raises ConfigError for bad arguments.

Every run is written to `RUN/diagnostics/<UTC time>.json`; the first healthy run of a shape
(nproc, size) also saves `RUN/diagnostics/baseline.json`, which later runs are compared with
(delete the entry to take a new one).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from depthscale.errors import ConfigError
from depthscale.parallel.host_cpus import threads_per_rank
from depthscale.parallel.launcher import ERROR_DIR_ENV, quiet_elastic_logs, read_worker_errors
from depthscale.resilience.diagnostics import FAULT_ENV, NODE_ENV, node_id, parse_faults
from depthscale.resilience.diagnostics_worker import JOINED, PROGRESS_DIR, ROWS_FILE, write_json
from depthscale.resilience.verdict import (
    MIN_FREE_BYTES,
    SLOW_FACTOR,
    Failure,
    Report,
    baseline_values,
    flag_outliers,
)

DEFAULT_SIZE_MB = 4.0
MAX_SIZE_MB = 4096.0
CHECK_ORDER = (
    "starting", JOINED, "all_reduce", "all_to_all", "reduce_scatter", "send_recv", "memcpy", "h2d",
    "d2h", "ckpt_write", "free_disk", "done",
)  # fmt: skip
"""What a rank's progress file can say, in the order a rank goes through it."""


def diagnose(
    nproc: int,
    run_dir: Path,
    env_per_rank: dict[int, dict[str, str]] | None = None,
    *,
    ckpt_dir: Path | None = None,
    size_mb: float = DEFAULT_SIZE_MB,
    timeout_s: float = 60.0,
    start_timeout_s: float = 300.0,
    slow_factor: float = SLOW_FACTOR,
) -> Report:
    """Run every check on `nproc` local ranks and return the verdict (also written to
    RUN/diagnostics/). `env_per_rank`: extra environment per rank, e.g. its DEPTHSCALE_NODE_ID;
    `ckpt_dir`: where checkpoints go (default RUN/checkpoints); `size_mb`: message size of each
    collective; `timeout_s`: how long the checks may take once every rank has joined."""
    if nproc < 1:
        raise ConfigError(f"diagnose: nproc={nproc} is not allowed; allowed: an integer >= 1")
    if not 0 < size_mb <= MAX_SIZE_MB:
        raise ConfigError(
            f"diagnose: size_mb={size_mb} is not allowed; allowed: (0, {MAX_SIZE_MB}]"
        )
    parse_faults(os.environ.get(FAULT_ENV))  # a bad spec is named here, not by every rank
    run_dir = Path(run_dir)
    ckpt_dir = Path(ckpt_dir) if ckpt_dir is not None else run_dir / "checkpoints"
    env_per_rank = env_per_rank or {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="depthscale-diagnose-") as tmp:
        work = Path(tmp)
        rows, failures = _run_group(
            nproc, work, env_per_rank, ckpt_dir, size_mb, timeout_s, start_timeout_s
        )
    return verdict(rows, run_dir, size_mb, ckpt_dir, failures, slow_factor, started)


def verdict(
    rows: list[dict],
    run_dir: Path,
    size_mb: float,
    ckpt_dir: Path,
    failures: list[Failure] = (),
    slow_factor: float = SLOW_FACTOR,
    started: float | None = None,
) -> Report:
    """Judge every rank's row (`diagnostics.run_checks`) against its peers and the run's baseline;
    write the report to RUN/diagnostics/ (and the baseline, on the first healthy run of a shape).
    Used by `diagnose` and by a supervised group that ran the checks itself on restart."""
    nproc = len(rows) or len({f.rank for f in failures})
    out_dir = Path(run_dir) / "diagnostics"
    out_dir.mkdir(parents=True, exist_ok=True)
    shape = f"nproc={nproc},size_mb={size_mb:g}"
    baselines = _read_json(out_dir / "baseline.json") or {}
    report = flag_outliers(rows, baselines.get(shape), slow_factor, _free_floor(Path(ckpt_dir)))
    report.failures.extend(failures)
    report.info = {
        "nproc": nproc,
        "size_mb": size_mb,
        "ckpt_dir": str(ckpt_dir),
        "time": datetime.now(UTC).isoformat(),
        "wall_s": round(time.monotonic() - started, 2) if started is not None else None,
        "baseline": "compared" if shape in baselines else "none",
    }
    if report.healthy and shape not in baselines:
        baselines[shape] = baseline_values(report)
        write_json(out_dir / "baseline.json", baselines)
        report.info["baseline"] = "saved"
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
    (out_dir / f"{stamp}.json").write_text(report.to_json())
    return report


def _run_group(nproc, work, env_per_rank, ckpt_dir, size_mb, timeout_s, start_timeout_s):
    """Start the ranks, wait for them; (rows, failures of ranks that crashed or went silent)."""
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes

    quiet_elastic_logs()
    (work / PROGRESS_DIR).mkdir()
    (work / "errors").mkdir()
    store = dist.TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)
    common = {
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # the store is ours: no rank hosts it
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads_per_rank(nproc))),
        ERROR_DIR_ENV: str(work / "errors"),
    }
    envs = {
        r: {**common, "RANK": str(r), "LOCAL_RANK": str(r), **env_per_rank.get(r, {})}
        for r in range(nproc)
    }
    args = (
        "-m", "depthscale.resilience.diagnostics_worker", str(work), "--size-mb", str(size_mb),
        "--ckpt-dir", str(ckpt_dir), "--timeout-s", str(timeout_s + start_timeout_s),
    )  # fmt: skip
    logs = DefaultLogsSpecs(log_dir=str(work / "logs"), redirects=Std.ALL)
    group = start_processes("diagnose", sys.executable, {r: args for r in range(nproc)}, envs, logs)
    deadline = time.monotonic() + start_timeout_s
    joined = False
    result = None
    try:
        while result is None and time.monotonic() < deadline:
            result = group.wait(timeout=0.2, period=0.05)
            if not joined and _all_joined(work, nproc):
                joined, deadline = True, time.monotonic() + timeout_s
    finally:
        group.close(timeout=5)
    failures: list[Failure] = []
    if result is None:
        failures = _silent(work, nproc, envs, timeout_s if joined else start_timeout_s)
    elif result.is_failed():
        failures = _crashed(work, result.failures, envs)
    rows = _read_json(work / ROWS_FILE) if not failures else None
    if not failures and not rows:
        failures = [Failure(_node(envs, 0, {}), 0, "crashed", "exited without writing the rows")]
    return rows or [], failures


def _progress(work: Path, nproc: int) -> dict[int, dict]:
    return {r: p for r in range(nproc) if (p := _read_json(work / PROGRESS_DIR / f"rank{r}.json"))}


def _all_joined(work: Path, nproc: int) -> bool:
    progress = _progress(work, nproc)
    return len(progress) == nproc and all(p["check"] != "starting" for p in progress.values())


def _node(envs: dict, rank: int, progress: dict) -> str:
    return progress.get("node") or envs[rank].get(NODE_ENV) or node_id()


def _silent(work: Path, nproc: int, envs: dict, waited: float) -> list[Failure]:
    """The ranks furthest behind: in a hang the culprit stops early, its peers wait one step on."""
    progress = _progress(work, nproc)

    def step(rank: int) -> int:
        check = progress.get(rank, {}).get("check")
        return CHECK_ORDER.index(check) if check in CHECK_ORDER else -1

    behind = min(step(r) for r in range(nproc))
    failures = []
    for rank in range(nproc):
        if step(rank) == behind:
            check = progress.get(rank, {}).get("check", "not started")
            detail = f"silent for {waited:.0f} s; last seen at: {check}"
            failures.append(
                Failure(_node(envs, rank, progress.get(rank, {})), rank, "silent", detail)
            )
    return failures


def _crashed(work: Path, exits: dict, envs: dict) -> list[Failure]:
    progress = _progress(work, len(envs))
    messages = {e.rank: e.message for e in read_worker_errors(work / "errors")}
    failures = []
    for rank, failure in sorted(exits.items()):
        detail = messages.get(rank) or (
            f"killed by {failure.signal_name()}"
            if failure.exitcode < 0
            else f"exited with code {failure.exitcode}"
        )
        last = progress.get(rank, {}).get("check", "not started")
        node = _node(envs, rank, progress.get(rank, {}))
        failures.append(Failure(node, rank, "crashed", f"{detail.splitlines()[-1]} (at: {last})"))
    return failures


def _free_floor(ckpt_dir: Path) -> int:
    """Twice the newest checkpoint (a save must fit beside the one it replaces), at least
    MIN_FREE_BYTES."""
    steps = sorted(ckpt_dir.glob("step_*")) if ckpt_dir.is_dir() else []
    newest = sum(f.stat().st_size for f in steps[-1].rglob("*") if f.is_file()) if steps else 0
    return max(MIN_FREE_BYTES, 2 * newest)


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
