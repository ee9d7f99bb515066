"""Goodput under failures: how much of a run's wall time is progress, and the snapshot and
checkpoint intervals that maximise it (Young–Daly, two tiers). Pure arithmetic, torch-free.

The model (each assumption is one a reader can check against the run):

- Failures are a Poisson process of rate λ for the whole job (exponential gaps, memoryless). A
  fraction `p` of them the memory tier survives (the failed node's keeper, or its buddy's replica
  when the node is gone); the rest (`1 − p`) need the newest DCP checkpoint on storage.
- The run alternates work and saves. Every `τ` seconds of work it saves a snapshot to memory,
  costing `C_s` seconds of step time; every `n`-th save also writes a DCP checkpoint, costing
  `C_d` more (the blocking stage of an asynchronous save). Or checkpoints alone, every `τ`.
- A memory-recoverable failure rolls back to the newest save of either kind and pays `R_s`
  (fault → first step from memory); any other rolls back to the newest DCP checkpoint and pays
  `R_d`. A failure during a recovery restarts it (a storage failure during a memory recovery
  turns it into a storage recovery).
- A save is restorable only once committed, `W` seconds after it starts (a snapshot's copy and
  checksum, a checkpoint's background write). To first order a failure in that window loses one
  more interval, W more work per failure on average: the model adds W to the tier's recovery
  time. Saves of a tier do not overlap, so a DCP interval is never shorter than its write.
- Each tier's cost and recovery scale with the state a rank holds and the bandwidths it moves
  through (`costs`); fixed costs (detection, restart, process groups) are one measured constant.

Under this model `goodput` is exact (a renewal argument over one DCP period: see `_period_s`);
`optimum` is Young's τ = √(2·C·M) with Daly's higher-order correction (Daly 2006: τ = √(2CM)·
[1 + ⅓√(C/2M) + ⅑·C/2M] − C, for C < 2M), applied per tier: the snapshot interval against the
memory-recoverable failures (M_s = 1/(p·λ)), the DCP interval against the others (M_d =
1/((1−p)·λ)), which is the first-order optimum of the two-tier waste C_s/τ_s + C_d/τ_d +
p·λ·(τ_s/2 + R_s) + (1−p)·λ·(τ_d/2 + R_d); or, when that has less goodput, checkpoints alone at
Young–Daly's interval for every failure (M = 1/λ): snapshots win only by recovering faster. `tests/unit/test_goodput.py` checks both against a
brute-force Monte-Carlo simulation of the process.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

DAY_S = 86400.0

LLAMA3_INTERRUPTIONS = 419
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16384
"""Llama 3 (arXiv 2407.21783, §3.3.4): 419 unexpected interruptions in a 54-day snapshot of
pre-training on 16,384 H100s."""
LLAMA3_NETWORK = 35
"""Of those, network switch and cable failures (Llama 3, Table 5)."""

MEMORY_RECOVERABLE = 1 - LLAMA3_NETWORK / LLAMA3_INTERRUPTIONS
"""The share of failures a node's memory (or its buddy's replica) survives, by default: every
failure contained in one node (a GPU, its HBM, the host, a crashed or hung worker) survives in
memory; Llama 3's network switch and cable failures can cut a node and its buddy at once, so they
are counted as needing storage (0.916)."""


def failures_per_day(gpus: int) -> float:
    """Llama 3's unexpected interruption rate scaled to `gpus` (failures grow with the parts)."""
    return LLAMA3_INTERRUPTIONS / LLAMA3_DAYS * gpus / LLAMA3_GPUS


@dataclass(frozen=True)
class Tier:
    """One place a run's state is kept, in seconds."""

    save_s: float
    """Step time one save costs (C)."""
    commit_s: float
    """From a save's start until its version can be restored (W)."""
    recover_s: float
    """Fault → first step again from this tier (R), without the commit lag."""

    @property
    def lost_s(self) -> float:
        """What a failure costs besides the interrupted interval: recovery and commit lag."""
        return self.recover_s + self.commit_s


@dataclass(frozen=True)
class Schedule:
    interval_s: float
    """Work between two saves (τ: a snapshot interval, or the DCP interval without snapshots)."""
    every: int
    """Every n-th save is also a DCP checkpoint (the DCP interval is n·τ)."""
    snapshots: bool = True
    """False: checkpoints alone (every = 1): every failure rolls back to the newest checkpoint."""

    @property
    def checkpoint_s(self) -> float:
        return self.interval_s * self.every


def check_failures(per_day: float, memory_fraction: float) -> None:
    """ValueError naming the flag when a failure rate or memory share cannot be planned for."""
    _check(per_day / DAY_S, memory_fraction)


def _check(rate_per_s: float, memory_fraction: float) -> None:
    if not (math.isfinite(rate_per_s) and rate_per_s > 0):
        got = f"{rate_per_s * DAY_S:g}"
        raise ValueError(f"--failures-per-day must be a finite number > 0, got {got}")
    if not 0 <= memory_fraction < 1:
        raise ValueError(
            f"--memory-recoverable {memory_fraction:g}; allowed: a fraction in [0, 1) (some "
            "failures always need storage)"
        )


def young_daly(save_s: float, mtbf_s: float) -> float:
    """The work interval that minimises the waste of one tier: Young's √(2·C·M) with Daly's
    higher-order correction; M itself when a save costs more than 2·M (save as rarely as the
    failures allow)."""
    if save_s >= 2 * mtbf_s:
        return mtbf_s
    x = save_s / (2 * mtbf_s)
    return math.sqrt(2 * save_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - save_s


def optimum(memory: Tier, storage: Tier, rate_per_s: float, memory_fraction: float) -> Schedule:
    """The snapshot and DCP intervals of most goodput (Young–Daly per tier), the DCP interval a
    whole number of snapshot intervals and no shorter than a checkpoint's write."""
    _check(rate_per_s, memory_fraction)
    alone = Schedule(max(young_daly(storage.save_s, 1 / rate_per_s), storage.commit_s), 1, False)
    if memory_fraction == 0:
        return alone
    disk = young_daly(storage.save_s, 1 / ((1 - memory_fraction) * rate_per_s))
    disk = max(disk, storage.commit_s)
    snap = min(young_daly(memory.save_s, 1 / (memory_fraction * rate_per_s)), disk)
    both = Schedule(snap, max(1, round(disk / snap)))
    # snapshots pay off through faster recoveries; where they cost as much as checkpoints and
    # recover little faster, checkpoints alone do better
    return max(
        (both, alone), key=lambda s: goodput(s, memory, storage, rate_per_s, memory_fraction)
    )


def goodput(
    schedule: Schedule, memory: Tier, storage: Tier, rate_per_s: float, memory_fraction: float
) -> float:
    """Expected work per wall second of a long run under the module's model (exact)."""
    _check(rate_per_s, memory_fraction)
    if not (math.isfinite(schedule.interval_s) and schedule.interval_s > 0):
        raise ValueError(f"a save interval must be > 0 seconds of work, got {schedule.interval_s}")
    if not (isinstance(schedule.every, int) and schedule.every >= 1):
        raise ValueError(
            f"every n-th save is a checkpoint: n must be an integer >= 1, got {schedule.every}"
        )
    if not schedule.snapshots:
        if schedule.every != 1:
            raise ValueError("without snapshots every save is a checkpoint: every must be 1")
        memory_fraction, memory = 0.0, Tier(0.0, 0.0, 0.0)
    work = schedule.interval_s * schedule.every
    return work / _period_s(schedule, memory, storage, rate_per_s, memory_fraction)


def _period_s(s: Schedule, memory: Tier, storage: Tier, lam: float, p: float) -> float:
    """Expected wall time from a DCP commit to the next.

    A_i, the expected time from the start of segment i (i − 1 saves since the checkpoint) to the
    period's end, and B, that from the start of a storage recovery, satisfy (segment of length L,
    q = e^{−λL}, a memory recovery of length R_s, s = e^{−λR_s}):
        A_i = α·A_{i+1} + β + γ·B,  α = q(1 − p(1−s)) / d,  β = (1−q)/(λ·d),  γ = (1−q)(1−p)/d,
        d = 1 − p(1 − q·s),   A_{n+1} = 0,   B = A_1 + (e^{λR_d} − 1)/λ
    (eliminating the memory recovery's own equation; p = 0, n = 1 gives Daly's
    M·e^{R/M}·(e^{L/M} − 1)). Segments 1..n−1 are alike, so A_1 follows from A_n in closed form."""
    s_mem = math.exp(-lam * memory.lost_s)

    def coefficients(length: float) -> tuple[float, float, float]:
        q = math.exp(-lam * length)
        d = 1 - p * (1 - q * s_mem)
        return (
            q * (1 - p * (1 - s_mem)) / d,
            -math.expm1(-lam * length) / (lam * d),
            (-math.expm1(-lam * length) * (1 - p) / d),
        )

    # A_n = beta_d + gamma_d·B; A_1 = a + b·B
    _, beta_d, gamma_d = coefficients(s.interval_s + memory.save_s + storage.save_s)
    a, b = beta_d, gamma_d
    if s.every > 1:
        alpha, beta, gamma = coefficients(s.interval_s + memory.save_s)
        k = s.every - 1
        power = alpha**k
        geometric = (1 - power) / (1 - alpha) if alpha < 1 else float(k)
        a, b = power * a + beta * geometric, power * b + gamma * geometric
    restart = math.expm1(lam * storage.lost_s) / lam
    return (a + b * restart) / (1 - b)


@dataclass(frozen=True)
class Bandwidths:
    """What a rank's state moves through (bytes/s; `plan.hardware.Cluster` holds the defaults and
    says where each comes from)."""

    snapshot: float
    """Bytes of state per second of step time a snapshot costs (the copy to host memory)."""
    host: float
    """Host memory → device, per rank (a restore from memory)."""
    storage: float
    """Storage bytes/s per rank (its share of the file system)."""
    verify: float
    """How fast rank 0 hashes the whole checkpoint before choosing it (SHA-256 of one process,
    at most its node's share of the storage)."""
    restart_s: float
    """Fault → restarted workers ready to read their state (detection, start, process groups)."""


def costs(rank_bytes: float, checkpoint_bytes: float, bw: Bandwidths) -> tuple[Tier, Tier]:
    """The memory and storage tiers of a run whose fullest rank saves `rank_bytes`, of a
    checkpoint of `checkpoint_bytes` in all: a snapshot copies the rank's state to host memory
    (the step waits for it at `bw.snapshot`) and a restore reads it back at `bw.host`; a DCP save
    stages its own copy the same way (its own writer process) and writes it in the background at
    the rank's share of the storage; a DCP restore reads it back after rank 0 has verified the
    whole checkpoint."""
    if rank_bytes <= 0 or checkpoint_bytes <= 0:
        raise ValueError("a run's state must have bytes > 0")
    copy_s = rank_bytes / bw.snapshot
    to_host_s = rank_bytes / bw.host
    write_s = rank_bytes / bw.storage
    verify_s = checkpoint_bytes / bw.verify
    memory = Tier(save_s=copy_s, commit_s=to_host_s, recover_s=bw.restart_s + to_host_s)
    storage = Tier(save_s=copy_s, commit_s=write_s, recover_s=bw.restart_s + verify_s + write_s)
    return memory, storage


def plan(
    memory: Tier,
    storage: Tier,
    step_s: float,
    per_day: float,
    memory_fraction: float,
    configured: tuple[int, int] | None = None,
) -> dict:
    """The report: the optimal intervals (seconds and steps of `step_s`) and their goodput, and,
    for `configured` = (snapshot_every, checkpoint_every) steps, the goodput of those."""
    rate = per_day / DAY_S
    best = optimum(memory, storage, rate, memory_fraction)
    snap_steps = max(1, round(best.interval_s / step_s)) if best.snapshots else 0
    ckpt_steps = max(1, round(best.checkpoint_s / step_s))
    if snap_steps:
        ckpt_steps = max(1, round(best.checkpoint_s / (snap_steps * step_s))) * snap_steps
    report = {
        "failures_per_day": per_day,
        "mtbf_h": 1 / rate / 3600,
        "memory_recoverable": memory_fraction,
        "memory_tier": asdict(memory),
        "storage_tier": asdict(storage),
        "step_s": step_s,
        "optimal": {
            "snapshot_interval_s": best.interval_s if best.snapshots else None,
            "checkpoint_interval_s": best.checkpoint_s,
            "snapshot_every": snap_steps,
            "checkpoint_every": ckpt_steps,
            "goodput": goodput(best, memory, storage, rate, memory_fraction),
        },
        "checkpoint_only": _checkpoint_only(storage, memory, rate),
    }
    if configured:
        snapshot_every, checkpoint_every = configured
        if snapshot_every and checkpoint_every % snapshot_every:
            report["configured"] = {
                "snapshot_every": snapshot_every,
                "checkpoint_every": checkpoint_every,
                "goodput": None,
                "why": "not modelled: checkpoint.every is not a multiple of snapshot_every",
            }
        else:
            report["configured"] = configured_goodput(
                snapshot_every, checkpoint_every, step_s, memory, storage, rate, memory_fraction
            )
    return report


def _checkpoint_only(storage: Tier, memory: Tier, rate: float) -> dict:
    """DCP alone (no snapshots): every failure rolls back to the checkpoint, at its best interval."""
    best = optimum(memory, storage, rate, 0.0)
    return {
        "checkpoint_interval_s": best.checkpoint_s,
        "goodput": goodput(best, memory, storage, rate, 0.0),
    }


def configured_goodput(
    snapshot_every: int,
    checkpoint_every: int,
    step_s: float,
    memory: Tier,
    storage: Tier,
    rate: float,
    p: float,
) -> dict:
    """Goodput of a config's intervals in steps (snapshot_every 0: no snapshots, every failure
    goes to the checkpoint)."""
    if checkpoint_every < 1:
        raise ValueError(f"checkpoint.every {checkpoint_every}: goodput needs checkpoints (>= 1)")
    if snapshot_every < 0:
        raise ValueError(f"checkpoint.snapshot_every {snapshot_every} must be >= 0")
    if snapshot_every and checkpoint_every % snapshot_every:
        raise ValueError(
            f"checkpoint.every {checkpoint_every} is not a multiple of checkpoint.snapshot_every "
            f"{snapshot_every}: the model needs each checkpoint on a snapshot step"
        )
    if snapshot_every:
        schedule = Schedule(snapshot_every * step_s, checkpoint_every // snapshot_every)
        g = goodput(schedule, memory, storage, rate, p)
    else:
        g = goodput(Schedule(checkpoint_every * step_s, 1, False), memory, storage, rate, p)
    return {"snapshot_every": snapshot_every, "checkpoint_every": checkpoint_every, "goodput": g}


def lines(report: dict) -> list[str]:
    """The table's goodput lines."""
    opt, only = report["optimal"], report["checkpoint_only"]
    mem, disk = report["memory_tier"], report["storage_tier"]

    def every(steps: int, seconds: float | None) -> str:
        return f"every {steps} steps ({_duration(seconds)})"

    out = [
        f"goodput at {report['failures_per_day']:.3g} failures/day (MTBF "
        f"{_duration(report['mtbf_h'] * 3600)}), {report['memory_recoverable']:.1%} recoverable "
        "from memory:",
        f"  memory tier: save {mem['save_s']:.3g} s, commit {mem['commit_s']:.3g} s, recover "
        f"{mem['recover_s']:.3g} s; storage (DCP): save {disk['save_s']:.3g} s, write "
        f"{disk['commit_s']:.3g} s, recover {disk['recover_s']:.3g} s",
    ]
    if opt["snapshot_every"]:
        out.append(
            f"  best: snapshot {every(opt['snapshot_every'], opt['snapshot_interval_s'])}, "
            f"checkpoint {every(opt['checkpoint_every'], opt['checkpoint_interval_s'])}: "
            f"goodput {opt['goodput']:.2%}"
        )
    else:
        ckpt = every(opt["checkpoint_every"], opt["checkpoint_interval_s"])
        out.append(f"  best: no snapshots, checkpoint {ckpt}: goodput {opt['goodput']:.2%}")
    out.append(
        f"  checkpoints alone: every {_duration(only['checkpoint_interval_s'])}: goodput "
        f"{only['goodput']:.2%}"
    )
    if "configured" in report:
        c = report["configured"]
        snap = f"snapshot every {c['snapshot_every']} steps, " if c["snapshot_every"] else ""
        value = f"goodput {c['goodput']:.2%}" if c["goodput"] is not None else c["why"]
        out.append(f"  this config ({snap}checkpoint every {c['checkpoint_every']} steps): {value}")
    return out


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", DAY_S), ("h", 3600.0), ("min", 60.0)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"
