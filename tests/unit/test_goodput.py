"""The goodput model of `depthscale plan` (plan/goodput.py) against a brute-force Monte-Carlo
simulation of the process it models: exponential failures over a long run, each rolling back to
the newest save its tier survives, tried at a grid of intervals with the same failures (common
random numbers, so the grid's differences are not noise of separate draws)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from depthscale.plan.goodput import (
    DAY_S,
    Bandwidths,
    Schedule,
    Tier,
    costs,
    failures_per_day,
    goodput,
    optimum,
    young_daly,
)

LLAMA_1B = str(Path(__file__).resolve().parents[2] / "configs" / "llama-1b.toml")
BATCHES = 20
"""Batch means for the simulation's standard error (the goodput of each 1/20 of the failures)."""
SIGMAS = 3.0
"""Tolerance in standard errors of the simulation: a 3-sigma miss happens by chance 0.3 % of the
time, and the seeds are fixed."""
BAND = 1.3
"""The brute-force best interval lies within this factor of the analytic one. Near its optimum the
waste grows as (x − 1)²/2 of the interval-dependent waste for an interval x times the optimum, so
at x = 1.3 a single tier loses ~4 % of that waste (~0.6 % goodput in the cases below): far more
than the simulation's standard error (0.05–0.1 %), which is what could move the argmax."""


def simulate(
    intervals, every, memory: Tier, storage: Tier, lam: float, p: float, failures: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Simulated goodput of each (interval, every) and its standard error: failures arrive with
    exponential gaps; between them the run first recovers (a failure during a recovery restarts
    it), then works through segments of `interval` + a snapshot (every n-th + a checkpoint too);
    a memory-recoverable failure keeps every completed segment, any other keeps only those up to
    the newest checkpoint. Work is counted at each failure, so the totals are exact."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1 / lam, failures)
    to_memory = rng.random(failures) < p
    tau = np.asarray(intervals, float)
    n = np.asarray(every, float)
    seg = tau + memory.save_s
    last = seg + storage.save_s  # a checkpoint's step also takes a snapshot
    period = (n - 1) * seg + last
    i = np.ones_like(tau)  # the segment in progress (1: just after a checkpoint)
    work = np.zeros_like(tau)
    recovery = np.zeros_like(tau)  # seconds of recovery before work resumes
    in_storage = np.zeros(tau.shape, bool)
    batch_work, batch_time, elapsed = [], [], 0.0
    size = failures // BATCHES
    for j, (gap, memory_failure) in enumerate(zip(gaps, to_memory, strict=True)):
        ok = gap >= recovery
        y = np.where(ok, gap - recovery, 0.0)
        rest = (n - i) * seg + last
        finish = y >= rest
        within = np.minimum(np.floor(y / seg), n - i)
        beyond = np.where(finish, y - rest, 0.0)
        full = np.floor(beyond / period)
        after = np.minimum(np.floor((beyond - full * period) / seg), n - 1)
        work += np.where(finish, (n - i + 1 + full * n + after) * tau, within * tau)
        i = np.where(finish, 1 + after, i + within)
        elapsed += gap
        if memory_failure:  # a storage recovery cut short stays one
            in_storage = ~ok & in_storage
            recovery = np.where(in_storage, storage.lost_s, memory.lost_s)
        else:
            work -= (i - 1) * tau
            i = np.ones_like(tau)
            in_storage = np.ones(tau.shape, bool)
            recovery = np.full_like(tau, storage.lost_s)
        if (j + 1) % size == 0:
            batch_work.append(work.copy())
            batch_time.append(elapsed)
    w = np.diff(np.array([np.zeros_like(tau), *batch_work]), axis=0)
    t = np.diff(np.array([0.0, *batch_time]))
    per_batch = w / t[:, None]
    return work / elapsed, per_batch.std(axis=0, ddof=1) / math.sqrt(len(t))


def _check_optimum(memory, storage, lam, p, taus, everys, failures, seed):
    best = optimum(memory, storage, lam, p)
    intervals = [best.interval_s, *taus]
    every = [best.every, *everys]
    sim, se = simulate(intervals, every, memory, storage, lam, p, failures, seed)
    exact = goodput(best, memory, storage, lam, p)
    # the model's goodput is the simulated one
    assert abs(exact - sim[0]) <= SIGMAS * se[0], (exact, sim[0], se[0])
    k = 1 + int(np.argmax(sim[1:]))
    # the analytic intervals are as good as the best of the brute force, within its noise
    assert sim[k] - sim[0] <= SIGMAS * se[k], (sim[k], sim[0], se[k], intervals[k], every[k])
    return best, intervals[k], every[k]


def test_young_daly_single_tier_matches_a_brute_force_simulation():
    """Checkpoints alone (p = 0): a save costs 1 % of the MTBF, a recovery 5 %."""
    memory = Tier(save_s=0.0, commit_s=0.0, recover_s=0.0)
    storage = Tier(save_s=0.01, commit_s=0.002, recover_s=0.05)
    first = young_daly(storage.save_s, 1.0)
    taus = first * np.geomspace(1 / 3, 3, 25)
    best, tau, _ = _check_optimum(memory, storage, 1.0, 0.0, taus, [1] * 25, 20000, seed=1)
    assert best.every == 1 and not best.snapshots
    assert 1 / BAND <= tau / best.interval_s <= BAND, (tau, best.interval_s)


def test_young_daly_two_tiers_match_a_brute_force_simulation():
    """90 % of failures recoverable from memory: snapshots cost 0.2 % of the MTBF, checkpoints
    2 % (and 5 % to write), recoveries 1 % and 10 %. The grid varies the snapshot interval and the
    checkpoint's multiple of it together."""
    memory = Tier(save_s=0.002, commit_s=0.001, recover_s=0.01)
    storage = Tier(save_s=0.02, commit_s=0.05, recover_s=0.1)
    best = optimum(memory, storage, 1.0, 0.9)
    assert best.snapshots and best.every > 3 and best.checkpoint_s >= storage.commit_s
    factors = np.geomspace(0.5, 2, 7)
    taus = [best.interval_s * f for f in factors for _ in factors]
    everys = [max(1, round(best.every * f)) for _ in factors for f in factors]
    best, tau, every = _check_optimum(memory, storage, 1.0, 0.9, taus, everys, 30000, seed=2)
    assert 1 / BAND <= tau / best.interval_s <= BAND, (tau, best.interval_s)
    assert 1 / BAND <= tau * every / best.checkpoint_s <= BAND, (tau * every, best.checkpoint_s)


def test_one_tier_goodput_is_dalys_closed_form():
    """p = 0, n = 1 is Daly's model: a segment of work τ and save C takes M·e^{R/M}(e^{(τ+C)/M} − 1)."""
    storage = Tier(save_s=30.0, commit_s=10.0, recover_s=120.0)
    memory = Tier(save_s=1.0, commit_s=1.0, recover_s=1.0)
    m, tau = 3 * 3600.0, 900.0
    expected = tau / (m * math.exp(130 / m) * math.expm1((tau + 30) / m))
    assert goodput(Schedule(tau, 1, False), memory, storage, 1 / m, 0.3) == pytest.approx(
        expected, 1e-12
    )


def test_checkpoints_alone_where_snapshots_recover_no_faster():
    """Snapshots cost step time like a checkpoint's staging; where they recover no faster, the
    optimum is checkpoints alone (and two tiers are chosen once memory recovers faster)."""
    same = Tier(save_s=0.01, commit_s=0.0, recover_s=0.05)
    assert not optimum(same, same, 1.0, 0.9).snapshots
    fast = Tier(save_s=0.01, commit_s=0.0, recover_s=0.001)
    slow = Tier(save_s=0.01, commit_s=0.0, recover_s=0.3)
    assert optimum(fast, slow, 1.0, 0.9).snapshots


def test_tier_times_scale_with_the_state_and_bandwidths():
    bw = Bandwidths(snapshot=10e9, host=20e9, storage=0.1e9, verify=1e9, restart_s=5.0)
    memory, storage = costs(2e9, 100e9, bw)
    assert memory == Tier(save_s=0.2, commit_s=0.1, recover_s=5.1)
    # a checkpoint stages the same copy, writes the rank's 2 GB at 0.1 GB/s, and is verified
    # whole (100 GB at 1 GB/s) before it is read back
    assert storage == Tier(save_s=0.2, commit_s=20.0, recover_s=5.0 + 100.0 + 20.0)


def test_young_daly_is_youngs_interval_to_first_order():
    assert young_daly(1e-6, 1.0) == pytest.approx(math.sqrt(2e-6), rel=2e-3)
    assert young_daly(3.0, 1.0) == 1.0  # a save dearer than 2·MTBF: as rarely as failures allow


def test_the_default_failure_rate_is_llama_3s_per_gpu():
    assert failures_per_day(16384) == pytest.approx(419 / 54)
    assert failures_per_day(8) == pytest.approx(419 / 54 / 2048)


@pytest.mark.parametrize(
    ("rate", "p", "schedule", "words"),
    [
        (0.0, 0.5, Schedule(1.0, 1), "--failures-per-day must be a finite number > 0, got 0"),
        (-1 / DAY_S, 0.5, Schedule(1.0, 1), "--failures-per-day .* got -1"),
        (1.0, 1.0, Schedule(1.0, 1), r"--memory-recoverable 1; allowed: a fraction in \[0, 1\)"),
        (1.0, 0.5, Schedule(0.0, 1), "interval must be > 0"),
        (1.0, 0.5, Schedule(1.0, 0), "integer >= 1"),
    ],
)
def test_bad_values_are_named(rate, p, schedule, words):
    tier = Tier(1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match=words):
        goodput(schedule, tier, tier, rate, p)


def test_cli_plans_goodput_and_intervals(capsys):
    """`depthscale plan --failures-per-day F` reports the best intervals, in steps of the layout's
    predicted step, with their goodput; without the flag, Llama 3's rate scaled to --gpus."""
    from depthscale.cli import main

    argv = ["plan", "-c", LLAMA_1B, "--gpus", "8", "--layout", "fsdp=8", "--json"]
    assert main([*argv, "--failures-per-day", "24", "--memory-recoverable", "0.9"]) == 0
    g = json.loads(capsys.readouterr().out)["goodput"]
    assert g["failures_per_day"] == 24 and g["mtbf_h"] == pytest.approx(1.0)
    assert g["memory_recoverable"] == 0.9 and g["rank_state_gb"] > 0
    best = g["optimal"]
    assert best["snapshot_every"] >= 1 and best["checkpoint_every"] % best["snapshot_every"] == 0
    assert 0 < g["checkpoint_only"]["goodput"] <= best["goodput"] < 1
    assert g["configured"]["checkpoint_every"] == 1000  # the config's checkpoint.every
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["goodput"]["failures_per_day"] == pytest.approx(
        failures_per_day(8)
    )
    assert main(argv[:-1]) == 0
    out = capsys.readouterr().out
    assert "goodput at 0.00379 failures/day (MTBF 264 d)" in out and "checkpoints alone" in out


@pytest.mark.parametrize(
    ("flag", "value", "allowed"),
    [
        ("--failures-per-day", "0", "a finite number > 0"),
        ("--failures-per-day", "-3", "a finite number > 0"),
        ("--memory-recoverable", "1", r"a fraction in \[0, 1\)"),
        ("--memory-recoverable", "x", r"a fraction in \[0, 1\)"),
    ],
)
def test_cli_bad_failure_values_are_one_line(flag, value, allowed, capsys):
    from depthscale.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--gpus", "8", flag, value])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_.value.code == 2
    assert re.search(f"argument {flag}: '{value}' is not allowed; allowed: {allowed}", err), err
