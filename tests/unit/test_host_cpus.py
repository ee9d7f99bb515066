"""Threads per rank come from the CPUs this process may use (its affinity mask: SLURM's
--cpus-per-task, taskset, a cpuset), not from the machine's count."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import depthscale
from depthscale.parallel import host_cpus
from depthscale.parallel.host_cpus import threads_per_rank, usable_cpus


@pytest.fixture
def machine(monkeypatch):
    """A 64-CPU machine whose job may use CPUs 8-23."""
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8, 24)), raising=False)


def test_the_affinity_mask_counts_not_the_machine(machine):
    assert usable_cpus() == 16
    assert [threads_per_rank(n) for n in (1, 4, 8, 16, 32)] == [16, 4, 2, 1, 1]


def test_without_an_affinity_api_the_machine_counts(machine, monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity")
    assert usable_cpus() == 64 and threads_per_rank(8) == 8
    monkeypatch.setattr(os, "cpu_count", lambda: None)  # undeterminable
    assert usable_cpus() == 1 and threads_per_rank(4) == 1


def test_nothing_else_sizes_threads_by_the_machines_count():
    """The launcher, the supervisor, `depthscale diagnose` and the calibration all go through
    `threads_per_rank`."""
    package = Path(depthscale.__file__).resolve().parent
    users = sorted(
        str(p.relative_to(package))
        for p in package.rglob("*.py")
        if "cpu_count(" in p.read_text() and p != Path(host_cpus.__file__).resolve()
    )
    assert users == []
