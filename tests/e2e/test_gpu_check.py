"""scripts/gpu_check.py, the prepared GPU check, as a user runs it: its --dry-run runs every stage's
logic on CPU at tiny shapes, so that the check still works the day a GPU session runs it; a stage
that crashes or hangs costs that stage alone; bad input is one line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "scripts"))
from gpu_stages import STAGES  # noqa: E402

KEYS = {"stage", "name", "status", "values", "error", "time"}
CPU_SKIP = "no CUDA device"
"""The only reason a dry run may skip a measurement: it needs CUDA itself (the CUDA sanitizer,
device memory outside torch's allocator). Anything else skipped on CPU is a check that rotted."""


def gpu_check(*args: str, env: dict[str, str] | None = None, timeout: float = 900):
    environ = {k: v for k, v in os.environ.items() if k != "OUT"} | (env or {})
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "gpu_check.jsonl").read_text().splitlines()]


def test_dry_run_writes_an_ok_line_for_every_stage(tmp_path):
    out = tmp_path / "out"
    result = gpu_check("--dry-run", "--out", str(out))
    lines = read(out)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert all(set(line) == KEYS for line in lines), lines
    assert [line["status"] for line in lines if line["name"] == "stage"] == ["ok"] * len(STAGES)
    for stage in STAGES:
        mine = [line for line in lines if line["stage"] == stage.name and line["name"] != "stage"]
        assert any(line["status"] == "ok" for line in mine), (stage.name, mine)
        for line in mine:
            allowed = line["status"] == "skipped" and line["error"].startswith(CPU_SKIP)
            assert line["status"] == "ok" or allowed, line
    summary = lines[-1]
    assert (summary["stage"], summary["name"], summary["status"]) == ("check", "summary", "ok")
    results_file = summary["values"]["results_file"]
    assert results_file.startswith("benchmarks/results/gpu_check_cpu_")
    assert (summary["values"]["device"], summary["values"]["date"]) == ("cpu", results_file[-16:-6])
    # the results under their committed name beside the lines; a dry run writes none in the tree
    assert (out / Path(results_file).name).read_text() == (out / "gpu_check.jsonl").read_text()
    assert not (ROOT / results_file).exists()
    # the stage budgets a GPU run has, printed first: they fit the budget with a margin
    table = result.stdout.split("gpu_check:")[0]
    budgets = dict(re.findall(r"^  (\w+)\s+(\d+) s", table, re.M))
    assert list(budgets) == [s.name for s in STAGES] + ["total"], table
    assert sum(int(v) for k, v in budgets.items() if k != "total") == int(budgets["total"]) <= 420
    # the numbers a GPU run is read for are there, from the real code paths
    by_name = {(line["stage"], line["name"]): line["values"] for line in lines}
    assert by_name[("env", "device")]["name"] == "cpu"
    assert by_name[("unit_tests", "pytest")]["counts"]["passed"] > 0
    reads = [v for (stage, name), v in by_name.items() if name.startswith("read d=")]
    assert reads and all(v["rel_err"]["out"] < 1e-2 and v["fwd_ms"] > 0 for v in reads)
    if (ROOT / "benchmarks" / "attnres_traffic.py").exists():  # the model's expectation beside
        assert all(0 < v["traffic_model"]["fwd_of_copy"] <= 1 for v in reads), reads
    assert by_name[("kernels", "graph_read")]["replay_equals_eager"] is True
    assert set(by_name[("trainer", "step_time_ratios")]) == {"block_over_standard",
                                                            "full_over_standard"}  # fmt: skip
    profile = by_name[("trainer", "step_profile block")]
    assert profile["host_ms_per_step"] > 0 and profile["launches_per_layer"] > 0
    assert by_name[("trainer", "bitwise")]["equal"] is True  # CPU: deterministic
    assert by_name[("llama1b", "standard")]["graph_breaks"] == 0
    assert "block_over_standard" in by_name[("llama1b", "step_time_ratio")]
    loss = by_name[("loss", "equal_tokens")]
    assert loss["steps_each"] >= 2 and set(loss["loss"]) == {"block", "standard"}
    world = {name: v for (stage, name), v in by_name.items() if stage == "world1"}
    assert world["p2p_self_loop"]["equal"] and world["ring_cp1"]["rel_err"] < 1e-4
    assert world["flight_recorder"]["groups"]
    assert by_name[("hf", "logits_fp32")]["rel_err"] < 1e-4
    # every goal is judged and counted (on CPU the rates miss theirs: the logic is what runs)
    goals = summary["values"]["goals"]
    judged = {k.split("/")[-1] for k in goals["each"]}
    assert {"fwd_of_copy", "bwd_of_copy", "mfu", "block_over_standard", "ring_over_sdpa",
            "block_loss_minus_standard", "bitwise_equal"} <= judged  # fmt: skip
    assert goals["met"] + goals["missed"] == len(goals["each"])
    assert (out / "gpu_check.log").stat().st_size > 0


def test_a_crashed_and_a_hung_stage_cost_only_themselves(tmp_path):
    out = tmp_path / "out"
    result = gpu_check(
        "--dry-run", "--out", str(out), "--only", "env,kernels,attention",
        "--stage-timeout", "attention=3",
        env={"GPU_CHECK_FAULT": "kernels=abort,attention=hang"},
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    stages = {line["stage"]: line for line in read(out) if line["name"] == "stage"}
    assert stages["env"]["status"] == "ok"
    assert stages["kernels"]["status"] == "failed"
    assert "SIGABRT" in stages["kernels"]["error"]
    assert stages["attention"]["status"] == "timeout"
    assert stages["attention"]["values"]["seconds"] < 30
    env_lines = [line for line in read(out) if line["stage"] == "env" and line["name"] != "stage"]
    assert len(env_lines) >= 5 and all(line["status"] == "ok" for line in env_lines)
    summary = read(out)[-1]
    assert summary["status"] == "failed" and summary["values"]["failed"] == ["kernels", "attention"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--only", "env,nope"], "unknown stage nope"),
        (["--stage-timeout", "env=soon"], "--stage-timeout 'env=soon'"),
        (["--budget", "0"], "--budget 0 must be > 0"),
        (["--out", "{file}/sub"], "cannot write to the output folder"),
    ],
)
def test_bad_input_is_one_line(tmp_path, args, message):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    args = [a.replace("{file}", str(blocker)) for a in args]
    result = gpu_check(*args, timeout=60)
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and message in result.stderr, result.stderr


def test_the_budget_keeps_each_later_stage_its_floor():
    from gpu_check import share

    later = [(100.0, 30.0), (10.0, 15.0)]  # a later stage's floor counts up to its own limit
    assert share(500.0, 130.0, 30.0, later) == 130.0  # room for all: its own limit
    assert share(100.0, 130.0, 30.0, later) == 60.0  # 100 - 30 - 10 kept for the later ones
    assert share(60.0, 130.0, 30.0, later) is None  # 20 s would be below its floor: skipped
    assert share(5.0, 3.0, 30.0, []) == 3.0  # a limit below the floor still runs


class _Lines:
    """A stage context that keeps its lines."""

    def __init__(self):
        self.lines = []

    def emit(self, name, values=None, status="ok", error=None):
        self.lines.append((name, status, values, error))

    def measure(self, name, fn):
        from gpu_stages.common import OutOfBounds

        try:
            self.emit(name, fn())
        except OutOfBounds as o:
            self.emit(name, o.values, "failed", str(o))


def test_a_pytest_run_cut_short_reports_the_tests_that_finished():
    from gpu_stages.unit_tests import report

    output = "\n".join([
        "tests/unit/test_kernels.py::test_read[bf16-1] PASSED [ 10%]",
        "tests/unit/test_kernels.py::test_read[bf16-2] FAILED [ 20%]",
        "tests/unit/test_memory.py::test_offload PASSED [ 30%]",
        "tests/unit/test_memory.py::test_pre",  # killed mid-line
    ])  # fmt: skip
    files = ["tests/unit/test_kernels.py", "tests/unit/test_memory.py", "tests/unit/test_x.py"]
    ctx = _Lines()
    report(ctx, output, -9, True, 90.0, files, "not cpu")
    by_name = {name: (status, values, error) for name, status, values, error in ctx.lines}
    assert by_name["pytest tests/unit/test_kernels.py"][0] == "failed"
    assert by_name["pytest tests/unit/test_kernels.py"][1]["failures"] == [
        "tests/unit/test_kernels.py::test_read[bf16-2]"
    ]
    assert by_name["pytest tests/unit/test_memory.py"][:2] == ("ok", {"passed": 1})
    assert "pytest tests/unit/test_x.py" not in by_name  # nothing of it ran
    status, values, error = by_name["pytest"]
    assert status == "failed" and values["timed_out"] and "killed after 90 s" in error
    assert values["counts"] == {"passed": 2, "failed": 1}
