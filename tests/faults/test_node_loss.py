"""A node gone whole — it lost power: its supervisor and its workers SIGKILLed at once — in a job of
two nodes on one host. The other node says at once which node is gone and why it cannot go on,
writes its report and exits 75 for the scheduler to requeue the job (it waited out the 300 s
start-up limit before, and exited 1). Under plain torchrun (no supervisor) the surviving rank's
error is one line naming the rank it lost (was the hang-dump line and gloo's paragraph, or, with a
save in flight, its checkpoint writer's traceback with torch's C++ stacks, after minutes)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from supervised import CONFIG, TINY, kill_node, node_events, start_nodes

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ONE_RANK_A_NODE = ["--nproc", "1", "--parallel.dp_shard", "2", "--resilience.diagnose", "false"]
FOUND = {
    (1, signal.SIGKILL): "its supervisor has not beaten in node 0's store for",  # node 0 watches
    (0, signal.SIGKILL): "the rendezvous store its supervisor hosts at",  # its process ended
    (0, signal.SIGSTOP): "did not answer this node's beat for",  # frozen: its kernel still answers
}
BOUND_S = 30.0
"""From the SIGKILL to the survivor's exit: node_lost_s (5 s) and stopping its workers, with
room for a loaded 2-core box (it was the 300 s start-up limit)."""


def _wait_for(ready, timeout: float, procs) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        assert time.monotonic() < deadline, "the job never started"
        time.sleep(0.1)


def _end(procs, run: Path | None = None) -> None:
    """Every process of the job gone, a frozen node's workers included."""
    for k, proc in enumerate(procs):
        if run is not None and _logs(run) and node_events(run, k, "launch"):
            kill_node(proc, run, k)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


@pytest.mark.parametrize("victim, sig", list(FOUND), ids=["node1", "node0", "node0-frozen"])
def test_a_node_gone_whole_is_named_at_once_and_the_other_gives_up(tmp_path, victim, sig):
    run = tmp_path / "run"
    procs = start_nodes(run, 2, *ONE_RANK_A_NODE, steps=100_000)
    survivor, other = procs[1 - victim], 1 - victim
    try:
        started = lambda: all(node_events(run, k, "start_time") for k in (0, 1))  # noqa: E731
        _wait_for(lambda: (run / "supervisor").is_dir() and _logs(run) and started(), 600, procs)
        kill_node(procs[victim], run, victim, sig)
        killed = time.monotonic()
        out, err = survivor.communicate(timeout=120)
        took = time.monotonic() - killed
    finally:
        _end(procs, run)
    assert survivor.returncode == 75, err[-3000:]
    assert took < BOUND_S, (took, err[-3000:])
    (fault,) = node_events(run, other, "fault")
    assert fault["fault"]["kind"] == "lost" and fault["fault"]["nodes"] == [f"node{victim}"]
    assert f"lost: node {victim} (node{victim}" in fault["text"], fault["text"]
    assert FOUND[victim, sig] in fault["text"] and fault["fault"]["evidence"]["limit_s"] == 5.0
    report = json.loads((run / "supervisor" / f"node{other}" / "report.json").read_text())
    assert f"node {victim} (node{victim}" in report["gave_up"] and "is gone" in report["gave_up"]
    assert report["lost_node"]["ranks"] == [victim] and report["lost_node"]["node_rank"] == victim
    (gave_up,) = node_events(run, other, "gave_up")
    assert "requeue" in gave_up["text"] and "Traceback" not in err, err[-3000:]


def _logs(run: Path) -> bool:
    return all((run / "supervisor" / f"node{k}" / "log.jsonl").exists() for k in (0, 1))


# ------------------------------------------------------------------ plain torchrun


def _plain_workers(run: Path, *args: str) -> list[subprocess.Popen]:
    """Two ranks started as torchrun starts its workers (its environment; rank 0 hosts the store,
    as without torchrun's agent), each a node of its own, unsupervised."""
    run.parent.mkdir(parents=True, exist_ok=True)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in (0, 1):
        env = dict(
            os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", RANK=str(rank),
            WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT="0",
        )  # fmt: skip
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "depthscale",
                    "train",
                    "-c",
                    CONFIG,
                    *TINY,
                    "--train.steps",
                    "100000",
                    "--train.run_dir",
                    str(run),
                    "--parallel.dp_shard",
                    "2",
                    "--resilience.supervise",
                    "false",
                    *args,
                ],
                cwd=run.parent,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )  # fmt: skip
        )
    return procs


def _step(run: Path) -> int:
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    return max((json.loads(line).get("step", 0) for line in lines if line.endswith("}")), default=0)


@pytest.mark.parametrize(
    "victim, at, faults",
    [
        (1, 6, "none"),
        # rank 1 waits for its checkpoint writer (the save of step 4, 6 s longer) when rank 0,
        # which hosts the store, goes: the writer printed its traceback and torch's C++ stacks
        (0, 8, "slowsave@4:6"),
    ],
)
def test_plain_torchrun_a_lost_peer_is_one_line(tmp_path, victim, at, faults):
    run = tmp_path / "run"
    more = ["--faults", faults] if faults != "none" else []
    procs = _plain_workers(run, *more)
    survivor = procs[1 - victim]
    try:
        _wait_for(lambda: _step(run) >= at, 600, procs)
        os.killpg(procs[victim].pid, signal.SIGKILL)  # the rank and its checkpoint writer
        killed = time.monotonic()
        out, err = survivor.communicate(timeout=120)
        took = time.monotonic() - killed
    finally:
        _end(procs)
    assert survivor.returncode == 1, err[-3000:]
    assert len(err.splitlines()) == 1, err[-6000:]
    assert f"rank {1 - victim} lost its peer rank {victim} (node {victim}, host " in err, err
    assert "Traceback" not in err and took < BOUND_S, (took, err)
