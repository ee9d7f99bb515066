"""The verdict of `depthscale diagnose` from per-rank rows (pure: no processes): outliers against
the median and the baseline, whose data was wrong, slow exchanges, the checkpoint disk, and the
silent ranks of a hung run."""

import json

import pytest

from depthscale.errors import ConfigError
from depthscale.resilience.diagnose import _silent
from depthscale.resilience.diagnostics import parse_faults
from depthscale.resilience.verdict import baseline_values, flag_outliers, format_table

NODES = ["nodeA", "nodeA", "nodeB", "nodeB"]
GIB = 2**30


def rows(memcpy=(1000, 1000, 1000, 1000), pairs=None, all_reduce=(500,) * 4, free=(100 * GIB,) * 4):
    """Four healthy ranks on two nodes, with the given bandwidths (MB/s)."""
    pairs = pairs or {"0-1": 800, "1-2": 800, "2-3": 800, "0-3": 800}
    out = []
    for rank, node in enumerate(NODES):
        mine = {p: v for p, v in pairs.items() if str(rank) in p.split("-")}
        out.append(
            {
                "rank": rank,
                "node": node,
                "world_size": 4,
                "checks": {
                    "all_reduce": {"ok": True, "value": all_reduce[rank], "bad_sources": []},
                    "send_recv": {"ok": True, "pairs": mine, "bad_sources": []},
                    "memcpy": {"ok": True, "value": memcpy[rank]},
                    "ckpt_write": {"ok": True, "value": 100.0},
                    "free_disk": {"ok": True, "value": free[rank], "detail": "/ckpt"},
                },
            }
        )
    return out


def test_healthy_rows_pass_and_become_the_baseline():
    report = flag_outliers(rows(), None)
    assert report.healthy and report.bad_nodes == {}
    assert baseline_values(report) == {
        "memcpy": 1000,
        "ckpt_write": 100.0,
        "all_reduce": 500,
        "send_recv": 800,
    }
    assert "healthy: every node passed" in format_table(report)
    assert json.loads(report.to_json())["healthy"] is True


def test_a_rank_below_the_median_fails_its_node():
    report = flag_outliers(rows(memcpy=(1000, 1000, 150, 1000)), None)
    assert list(report.bad_nodes) == ["nodeB"]
    (failure,) = report.failures
    assert (failure.rank, failure.check) == (2, "memcpy")
    assert "150 MB/s < median 1000 / 5" in failure.detail
    assert "FAILED node nodeB: rank 2 memcpy" in format_table(report)


def test_within_the_slow_factor_passes():
    assert flag_outliers(rows(memcpy=(1000, 1000, 300, 1000)), None).healthy


def test_half_the_ranks_slow_needs_the_baseline():
    """Two of four ranks slow: the median is slow too; the baseline of a healthy run tells."""
    slow_b = rows(
        memcpy=(1000, 1000, 100, 100),
        pairs={"0-1": 800, "1-2": 80, "2-3": 80, "0-3": 80},
    )
    without = flag_outliers(slow_b, None)
    assert [f.check for f in without.failures] == ["memcpy", "memcpy"]  # pairs: median is slow
    report = flag_outliers(slow_b, baseline_values(flag_outliers(rows(), None)))
    assert list(report.bad_nodes) == ["nodeB"]
    exchanges = [f for f in report.failures if f.check == "send_recv"]
    assert [f.rank for f in exchanges] == [2, 3]  # ranks 0 and 1 each have one fast exchange
    assert "every exchange slow" in exchanges[0].detail


def test_a_slow_collective_is_a_warning_naming_no_node():
    base = baseline_values(flag_outliers(rows(), None))
    report = flag_outliers(rows(all_reduce=(50,) * 4), base)
    assert report.healthy
    assert report.warnings and report.warnings[0].startswith("all_reduce: 50 MB/s")


def test_a_slow_link_names_both_ends():
    report = flag_outliers(rows(pairs={"0-1": 800, "1-2": 100, "2-3": 800, "0-3": 800}), None)
    assert sorted((f.node, f.rank) for f in report.failures) == [("nodeA", 1), ("nodeB", 2)]
    assert all("slow link 1-2" in f.detail for f in report.failures)


def test_wrong_data_blames_its_source_once():
    data = rows()
    for row in data:  # every rank saw rank 3's slot of the sum wrong
        row["checks"]["all_reduce"].update(ok=False, bad_sources=[3])
    report = flag_outliers(data, None)
    (failure,) = report.failures
    assert (failure.node, failure.rank, failure.check) == ("nodeB", 3, "all_reduce")
    assert "seen by rank(s) [0, 1, 2, 3]" in failure.detail


def test_unwritable_checkpoint_dir_and_low_disk():
    data = rows(free=(100 * GIB, 100 * GIB, 100 * GIB, GIB // 2))
    data[0]["checks"]["ckpt_write"] = {
        "ok": False,
        "value": None,
        "detail": "/ckpt is not writable",
    }
    report = flag_outliers(data, None, min_free_bytes=GIB)
    assert report.bad_nodes == {
        "nodeA": ["rank 0 ckpt_write: /ckpt is not writable"],
        "nodeB": ["rank 3 free_disk: 0.50 GiB free in /ckpt < floor 1.00 GiB"],
    }
    assert " x!" in format_table(report)


def test_fault_spec():
    assert parse_faults("slow@nodeB, wrong@nodeB,hang@n3") == {
        "nodeB": {"slow", "wrong"},
        "n3": {"hang"},
    }
    assert parse_faults(None) == {}
    for bad in ("slow", "fast@nodeB", "slow@"):
        with pytest.raises(ConfigError, match="KIND@NODE"):
            parse_faults(bad)


def test_a_hung_run_names_the_ranks_furthest_behind(tmp_path):
    """The culprit stops early; its peers wait one check further on, inside the collective."""
    (tmp_path / "progress").mkdir()
    at = {0: "all_to_all", 1: "all_to_all", 2: "all_reduce"}  # rank 3 never started
    for rank, check in at.items():
        record = {"rank": rank, "node": NODES[rank], "check": check}
        (tmp_path / "progress" / f"rank{rank}.json").write_text(json.dumps(record))
    envs = {r: {"DEPTHSCALE_NODE_ID": n} for r, n in enumerate(NODES)}
    (failure,) = _silent(tmp_path, 4, envs, 30.0)
    assert (failure.node, failure.rank, failure.check) == ("nodeB", 3, "silent")
    assert "last seen at: not started" in failure.detail
    (tmp_path / "progress" / "rank3.json").write_text(json.dumps({"check": "all_to_all"}))
    (failure,) = _silent(tmp_path, 4, envs, 30.0)
    assert failure.rank == 2 and "last seen at: all_reduce" in failure.detail


def test_table_headers_carry_their_units():
    header = format_table(flag_outliers(rows(), None)).splitlines()[0].split("  ")
    header = [h.strip() for h in header if h.strip()]
    assert header == [
        "rank",
        "node",
        "all_reduce bus MB/s",
        "memcpy MB/s",
        "ckpt_write MB/s",
        "free_disk GiB",
    ]


def test_run_naming_a_checkpoints_directory_is_refused_before_any_work(tmp_path, capsys):
    """`diagnose --run RUN/checkpoints` read as a run with nothing saved ("none saved") and
    wrote checkpoints/ and diagnostics/ among the step_N folders; now one line naming RUN."""
    from depthscale.cli import main

    ckpts = tmp_path / "run" / "checkpoints"
    (ckpts / "step_00000004").mkdir(parents=True)
    assert main(["diagnose", "--nproc", "1", "--run", str(ckpts)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "checkpoints directory" in err
    assert repr(str(tmp_path / "run")) in err
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000004"]  # nothing written
