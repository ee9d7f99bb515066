"""Observability end to end, as a user meets it: train with several processes, then
`depthscale trace timeline | stragglers | hang` on the run directory.

- every pipeline message (activations and gradients, with the AttnRes depth cache) and every ring
  transfer is one arrow in the merged timeline, as many as the schedule posts; injected ±50 ms
  clock skews are measured and undone; nothing points back in time;
- a rank made 40 % slower is named with its coordinates;
- a rank that stops (SIGSTOP) before a data-parallel all-reduce, a pipeline receive or a ring send,
  or in its backward while FSDP's reductions wait for it, is named, with the operation its peers
  wait in, although it writes no dump itself.

Each drill is one short real run (torchrun's machinery, gloo). The repeated drills the issue asks
for are marked slow (`pytest -m slow tests/e2e/test_observability.py`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from depthscale.config import ModelConfig
from depthscale.observe.timeline import read_rank_files
from depthscale.observe.trace_format import check_trace
from depthscale.parallel.pipeline.depth_cache import DepthCache
from depthscale.parallel.pipeline.p2p_order import SENDS, Post, rank_program, upstream
from depthscale.parallel.pipeline.schedules import interleaved_1f1b
from depthscale.parallel.pipeline.stage import split_layers
from drill_repeats import DRILL_REPEATS

TIMEOUT_S = float(os.environ.get("DEPTHSCALE_E2E_TIMEOUT_S", "900"))
SMALL = [
    *("--model.dim", "32", "--model.n_layers", "4", "--model.n_heads", "2"),
    *("--data.seq_len", "32", "--data.max_bytes", "200000", "--optim.warmup_steps", "1"),
    *("--train.eval_every", "0", "--checkpoint.every", "0", "--logging.progress", "false"),
    *("--logging.log_every", "1", "--logging.tensorboard", "false"),
]
SKEW_MS = {1: 50.0, 2: -50.0, 3: 30.0}


def depthscale(*args, cwd: Path, env: dict | None = None, check: bool = True):
    proc = subprocess.run(
        [sys.executable, "-m", "depthscale.cli", *args],
        cwd=cwd,
        env=dict(os.environ, PYTHONWARNINGS="ignore", **(env or {})),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def train(tmp_path: Path, *args, env: dict | None = None, check: bool = True):
    run = tmp_path / "run"
    proc = depthscale(
        "train", "-c", str(Path("configs/tiny.toml").resolve()), *SMALL, *args,
        "--train.run_dir", str(run), cwd=tmp_path, env=env, check=check,
    )  # fmt: skip
    return run, proc


def pipeline_messages(residual: str, pp: int, virtual: int, micro: int) -> int:
    """Messages one pipeline posts per training step: the schedule's sends, less the hops the
    AttnRes cache leaves empty (as `PipelineRuntime` skips them)."""
    cfg = ModelConfig(dim=32, n_layers=4, n_heads=2, residual=residual, attnres_n_blocks=4)
    cache = DepthCache(cfg, split_layers(4, pp * virtual), pp)
    schedule = interleaved_1f1b(pp, virtual, micro)

    def empty(a):
        return cache.hop_size(upstream(a), a.microbatch) == 0

    return sum(
        sum(1 for a in step.actions if a.kind in SENDS)
        for rank in range(pp)
        for step in rank_program(schedule, rank, empty)
        if isinstance(step, Post)
    )


def _timeline(run: Path, tmp_path: Path) -> tuple[dict, str]:
    proc = depthscale("trace", "timeline", "--run", str(run), cwd=tmp_path)
    return json.loads((run / "trace" / "timeline.json").read_text()), proc.stdout


def _flows(trace: dict) -> dict[str, int]:
    counts: dict[str, int] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "s":
            counts[e["cat"]] = counts.get(e["cat"], 0) + 1
    return counts


def test_pipeline_and_ring_timeline_with_skewed_clocks(tmp_path):
    """pp=2 × V=2 × cp=2 with Block AttnRes, four steps, clocks of ranks 1-3 shifted by ±50 ms.
    The depth cache travels with the activations, and hops it leaves empty are not sent: the
    pipeline's arrows are exactly the messages the schedule posts; each ring transfer is one."""
    skew = ",".join(f"{r}:{ms}" for r, ms in SKEW_MS.items())
    run, _ = train(
        tmp_path, "--nproc", "4", "--parallel.pp", "2", "--parallel.pp_virtual", "2",
        "--parallel.cp", "2", "--model.residual", "block", "--model.attnres_n_blocks", "4",
        "--train.batch_size", "8", "--train.steps", "4",
        env={"DEPTHSCALE_CLOCK_SKEW_MS": skew},
    )  # fmt: skip
    trace, out = _timeline(run, tmp_path)
    assert check_trace(trace) == []
    sends = sum(
        1
        for t in read_rank_files(run).values()
        for s in t.spans
        if s["cat"] == "cp" and s["name"] == "send"
    )
    # 8 rows split 2·pp = 4 ways; a pipeline per ring member; 4 steps
    assert sends > 0
    assert _flows(trace) == {"pp": 4 * 2 * pipeline_messages("block", 2, 2, 4), "cp": sends}
    assert trace["otherData"]["backward_flows"] == 0 and trace["otherData"]["unmatched"] == 0
    for rank, ms in SKEW_MS.items():
        assert abs(trace["otherData"]["clock_offsets_ns"][str(rank)] + ms * 1e6) <= 1e6
    names = {
        e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"
    }
    assert names[3].startswith("rank 3 · pp1 dp0 cp1 tp0")
    assert "pipeline stage 0: idle/compute" in out and "(p-1)/(v·m) = 0.125" in out


def test_a_start_with_nothing_to_do_keeps_the_trace(tmp_path):
    """A finished run started again trains nothing: its trace (spans, hang folder) stays where it
    was, nothing is archived, and the timeline is still the run's."""
    run, _ = train(tmp_path, "--train.steps", "2", "--train.batch_size", "2")
    before = {p.name: p.read_bytes() for p in (run / "trace").glob("rank*.jsonl")}
    _, again = train(tmp_path, "--train.steps", "2", "--train.batch_size", "2")
    assert "nothing to do" in again.stdout + again.stderr
    assert {p.name: p.read_bytes() for p in (run / "trace").glob("rank*.jsonl")} == before
    assert not (run / "trace" / "archive").exists()
    trace, out = _timeline(run, tmp_path)
    steps = {e["args"]["step"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert steps == {1, 2} and "step 2 of every rank" in out


TWO = ["--nproc", "2", "--train.batch_size", "4"]
HANG_DRILLS = {
    # (layout, the rank that stops, the span it stops before, who waits, in what)
    "dp all-reduce": ([*TWO, "--parallel.dp_shard", "2"], 0, "all_reduce", 1, "all_reduce over ranks [0,1]"),
    "pipeline recv": ([*TWO, "--parallel.pp", "2"], 0, "recv", 1, "pp recv from rank 0"),
    "ring send": ([*TWO, "--parallel.cp", "2"], 1, "send", 0, "cp recv from rank 1"),
    # FSDP's collectives run inside torch: no span sees them, torch's Flight Recorder does
    "fsdp backward": ([*TWO, "--parallel.dp_shard", "2"], 1, "backward", 0, "(from torch's flight recorder"),
    # sub-groups (the pipeline pairs, FSDP's shard groups) time out after parallel.timeout_s too
    "pp2 x dp2 recv": (
        ["--nproc", "4", "--train.batch_size", "8", "--parallel.pp", "2", "--parallel.dp_shard", "2"],
        2, "recv", 0, "pp recv from rank 2",
    ),
}  # fmt: skip


NOTICE = "waiting for the other workers to stop"


def _stopped_children(pid: int) -> list[int]:
    """The processes `pid` started that are stopped (state T in /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, ppid = stat.read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, IndexError):
            continue
        if int(ppid) == pid and state in ("T", "t"):
            found.append(int(stat.parent.name))
    return found


def _train_ending_the_stopped_rank(tmp_path: Path, *args: str, env: dict):
    """`train`, except that once the launcher's notice says it waits for the workers to stop, the
    stopped culprit is SIGKILLed here, as torch's agent does 30 s later. That wait was most of a
    drill's time, and TORCH_ELASTIC_SHUTDOWN_TIMEOUT does not shorten it: the agent stops a failed
    group with its default timeout. One drill still waits it out (`test_hang_drill_...`)."""
    run = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "depthscale.cli", "train", "-c",
        str(Path("configs/tiny.toml").resolve()), *SMALL, *args, "--train.run_dir", str(run),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=dict(os.environ, PYTHONWARNINGS="ignore", **env),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = threading.Timer(TIMEOUT_S, proc.kill)
    deadline.start()
    stdout: list[str] = []
    reader = threading.Thread(target=lambda: stdout.append(proc.stdout.read()))
    reader.start()
    stderr, killed = [], []
    for line in proc.stderr:
        stderr.append(line)
        if NOTICE in line:
            killed = _stopped_children(proc.pid)
            for pid in killed:
                os.kill(pid, signal.SIGKILL)
    proc.wait()
    reader.join()
    deadline.cancel()
    assert len(killed) == 1, f"stopped workers at the notice: {killed}\n{''.join(stderr)}"
    return run, subprocess.CompletedProcess(cmd, proc.returncode, "".join(stdout), "".join(stderr))


def _hang_drill(tmp_path: Path, kind: str, wait_for_torch: bool = False) -> None:
    """Unsupervised: the peers' own timeouts and hang dumps (supervised, the supervisor acts
    first: tests/faults)."""
    layout, culprit, op, waiter, waits_in = HANG_DRILLS[kind]
    # the peers dump after 2 s in the culprit's operation and time out after 6: 4 s apart, and a
    # step past the first (where the setup timeout still holds) takes ~0.1 s here
    drill = [
        *layout, "--train.steps", "6", "--resilience.supervise", "false",
        "--parallel.timeout_s", "6", "--logging.hang_dump_s", "2",
    ]  # fmt: skip
    env = {"DEPTHSCALE_INJECT_HANG": f"{culprit}:3:{op}"}
    if wait_for_torch:
        run, proc = train(tmp_path, *drill, env=env, check=False)
    else:
        run, proc = _train_ending_the_stopped_rank(tmp_path, *drill, env=env)
    assert proc.returncode != 0
    assert "depthscale trace hang --run" in proc.stderr + proc.stdout
    # the stopped culprit never answers torch's SIGTERM: its 30 s wait is named, not silent
    assert re.search(rf"rank \d+ failed 5 s ago; {NOTICE}", proc.stderr)
    assert not (run / "trace" / "hang" / f"rank{culprit:05d}.json").exists()
    source, report = depthscale("trace", "hang", "--run", str(run), cwd=tmp_path).stdout.split(
        "\n", 1
    )
    assert source.startswith("hang dumps of the latest attempt, written ")
    assert report.startswith(f"culprit: rank {culprit} (") and "wrote no hang dump" in report
    assert f"rank {waiter} (" in report and waits_in in report


@pytest.mark.parametrize("kind", list(HANG_DRILLS))
def test_hang_drill_names_the_stopped_rank(tmp_path, kind):
    # one drill lets torch's agent end the stopped rank itself, after its 30 s shutdown timeout
    _hang_drill(tmp_path, kind, wait_for_torch=kind == "dp all-reduce")


# The default suite's drill is the first run: with no more, no case (an empty set would be a skip).
if DRILL_REPEATS > 1:

    @pytest.mark.slow
    @pytest.mark.parametrize("repeat", range(1, DRILL_REPEATS))
    @pytest.mark.parametrize("kind", list(HANG_DRILLS))
    def test_hang_drills_repeated(tmp_path, kind, repeat):
        _hang_drill(tmp_path, kind)


# A model whose step keeps each rank computing ~40 ms: with four ranks sharing two cores, the
# per-rank CPU time of smaller steps varies by more than 12 % over 8-step windows (measured:
# docs/observability.md), which no threshold separates from a 20 % slowdown within 10 steps.
# Even at 40 ms, a clean 1,000-step CI run read two ranks 12 % and 15 % slower than their peers
# for 4 steps (8-step medians of CPU time; nothing was injected): the default threshold (12 %) is
# for machines that do not run four ranks on two cores. The drills run at 25 %, 10 points over
# that noise, and inject a slowdown that reads 45-80 % (SLOWED), 20 points over the threshold.
STRAGGLER_RUN = [
    *("--nproc", "4", "--parallel.dp_shard", "4", "--model.dim", "128", "--model.n_layers", "2"),
    *("--model.n_heads", "4", "--data.seq_len", "128", "--data.max_bytes", "400000"),
    *("--train.batch_size", "16", "--train.steps", "22", "--logging.log_every", "100"),
    *("--logging.straggler_threshold", "0.25"),
    *("--resilience.supervise", "false"),  # the detector alone: supervised, it restarts slow ranks
]


def _straggler_drill(tmp_path: Path, victim: int, slow: str, expect: str, *more: str) -> None:
    run, proc = train(
        tmp_path, *STRAGGLER_RUN, *more, env={"DEPTHSCALE_INJECT_SLOW": f"{victim}:10:{slow}"}
    )
    flagged = [ln for ln in proc.stdout.splitlines() if "depthscale: straggler at step" in ln]
    assert flagged, proc.stdout
    assert all(f"rank {victim} (pp0 dp{victim} cp0 tp0)" in ln for ln in flagged), flagged
    first = int(flagged[0].split("straggler at step ")[1].split(":")[0])
    # slowed from step 10 on, named within 10 steps (docs/observability.md): by step 20
    assert 10 <= first <= 20 and expect in flagged[0], flagged
    logged = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    events = [m for m in logged if m["split"] == "straggler" and not m["recovered"]]
    assert events and {(m["rank"], m["coords"]["dp"]) for m in events} == {(victim, victim)}
    out = depthscale("trace", "stragglers", "--run", str(run), cwd=tmp_path).stdout
    if expect == "compute":
        assert f"hottest: rank {victim} (" in out
    assert (run / "trace" / "stragglers.png").stat().st_size > 10_000


# How much slower the drills make a rank: 40 % more CPU time in its forward and backward reads as
# 30-55 % more busy time than its peers, 20 % as only 10-25 % (the peers' CPU time moves with the
# victim's: four ranks share two cores). 60 % keeps the reading (45-80 %) clear of the drills'
# 25 % threshold, which itself clears the noise of a clean run (STRAGGLER_RUN).
SLOWED = "60%"


def test_a_slowed_rank_is_named_and_is_the_hottest_cell(tmp_path):
    _straggler_drill(tmp_path, 2, SLOWED, "compute")


def test_a_slow_data_loader_is_blamed_on_its_data_phase_only(tmp_path):
    """Its peers wait for it in their gradient all-reduce; waiting is not busy time. The threshold
    is 30 %: were the peers' 40 ms waits counted as busy, their ~35 ms of compute would read
    over 100 % slower; what 4 ranks on 2 cores do to CPU time while one of them sleeps each step
    (13 % on one peer in a loaded CI run) is the machine, not attribution."""
    _straggler_drill(tmp_path, 1, "40ms:data", "in data", "--logging.straggler_threshold", "0.3")


@pytest.mark.slow
@pytest.mark.parametrize("drill", range(DRILL_REPEATS))
def test_straggler_drills_repeated(tmp_path, drill):
    _straggler_drill(tmp_path, drill % 4, SLOWED, "compute")


@pytest.mark.slow
def test_no_flag_in_a_thousand_clean_steps(tmp_path):
    """The drill's run, 1,000 steps, nothing injected: the detector never names a rank."""
    clean = [a if a != "22" else "1000" for a in STRAGGLER_RUN]
    run, proc = train(tmp_path, *clean)
    assert "straggler" not in proc.stdout
    logged = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert not [m for m in logged if m["split"] == "straggler"]
    assert max(m["step"] for m in logged) == 1000
