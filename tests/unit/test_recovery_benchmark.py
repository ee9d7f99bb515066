"""The parts of `benchmarks/recovery.py` that need no training run: the page-cache eviction that
makes its disk tier read from the disk, the timed-step window, the derived snapshot interval and
the summary of two runs' records."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "recovery.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("recovery_benchmark", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_evict_drops_a_synced_file_from_the_page_cache_unless_it_lives_in_memory(bench, tmp_path):
    path = tmp_path / "part.distcp"
    with open(path, "wb") as fh:
        fh.write(os.urandom(4 << 20))
        fh.flush()
        os.fsync(fh.fileno())
    size = path.stat().st_size
    assert bench.cached_bytes(path) == size  # just written: every page cached
    bench.evict(path)
    # a tmpfs's pages are the file itself and stay; a disk's clean pages go
    assert bench.cached_bytes(path) == (size if bench._on_tmpfs(tmp_path) else 0)


def test_step_window_times_whole_snapshot_intervals_after_the_first_wait(bench):
    assert bench.step_window(2, 17) == (3, 15)  # steps 4..15: six intervals of 2
    assert bench.step_window(3, 17) == (4, 16)
    with pytest.raises(SystemExit, match=r"--kill-after 6 .* allowed: >= 8"):
        bench.step_window(3, 6)  # steps 5..7 are one interval: the fault at 8 at the earliest
    assert bench.step_window(3, 8) == (4, 7)


def test_interval_for_is_the_smallest_whole_interval_within_the_goal(bench):
    # 0.9 s per snapshot on a 1 s step: 0.9 / (n * 1) <= 0.03 from n = 30
    assert bench.interval_for(0.9, 1.0, 0.03) == 30
    assert 0.9 / (29 * 1.0) > 0.03
    assert bench.interval_for(0.0, 1.0, 0.03) == 1


def _run(steps_done: int, step_s: float, restored: int, tier: str, load_s: float, total_s: float):
    return {
        "restart": {
            "fault_to_first_step_s": total_s,
            "phases_s": {"checkpoint_load": load_s},
            "restore": {
                "0": {"tier": tier, "step": restored},
                "1": {"tier": tier, "step": restored},
            },
        },
        "step_end_time": {str(s): 100.0 + s * step_s for s in range(1, steps_done + 1)},
        "saves": [
            {"split": "snapshot", "blocking_s": b}
            for b in ([0.1, 0.3, 0.2] if tier == "memory" else [])
        ],
        "page_cache": {
            "evicted": [],
            "at_fault": {"step_00000012": {"bytes": 1000, "cached_bytes": 0}},
            "errors": [],
        },
    }


def test_summarise_derives_the_issue_figures_from_the_records(bench):
    raw = {
        "config": {"state_gb": 1.0, "snapshot_every": 2, "checkpoint_every": 6, "kill_after": 17},
        "runs": {
            "memory": _run(16, 1.5, 14, "memory", load_s=0.5, total_s=10.0),
            "disk": _run(16, 1.0, 12, "disk", load_s=2.0, total_s=12.5),
        },
    }
    s = bench.summarise(raw, judge_every=10)
    assert s["memory_vs_disk"] == 0.8 and s["met_memory_vs_disk"] is False
    assert s["checkpoint_load_memory_vs_disk"] == 0.25
    assert s["restart_besides_load_s"] == {"memory": 9.5, "disk": 10.5}
    assert "0.25x disk's" in s["why"]
    assert s["steps_lost"] == {"memory": 2, "disk": 4}
    assert s["disk_restore_cached_at_fault"] == {"checkpoint": "step_00000012", "fraction": 0.0}
    cost = s["snapshot_cost"]
    assert cost["wait_per_snapshot_s"] == {"median": 0.2, "max": 0.3}
    assert cost["per_snapshot_s"] == pytest.approx(1.0)  # (1.5 - 1.0) s per step x every 2
    assert cost["at_run_interval"]["with_the_writers_cpu"] == 0.5
    assert cost["derived_at_judged_interval"]["with_the_writers_cpu"] == 0.1
    assert cost["derived_smallest_interval_for_goal"] == {
        "training_wait_only": 7,  # 0.2 / (0.03 x 1.0) = 6.7
        "with_the_writers_cpu": 34,  # 1.0 / 0.03 = 33.3
    }
