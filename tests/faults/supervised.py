"""Helpers for the fault drills: run `depthscale train` as a user does (a subprocess, supervised),
read back what it logged, and compare a recovered run with an uninterrupted one bit for bit."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.toml")
TINY = [
    "--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "2",
    "--data.seq_len", "32", "--data.max_bytes", "100000", "--train.batch_size", "8",
    "--optim.warmup_steps", "2", "--train.eval_every", "0", "--logging.log_every", "1",
    "--logging.progress", "false", "--logging.tensorboard", "false",
    "--logging.peak_tflops", "1", "--checkpoint.every", "4", "--checkpoint.keep", "0",
]  # fmt: skip
HEARTBEAT_S = 0.25


def train(
    run: Path, *args: str, steps: int = 12, timeout: float = 600
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "depthscale.cli", "train", "-c", CONFIG, *TINY,
         "--train.steps", str(steps), "--train.run_dir", str(run), *args],
        cwd=run.parent,
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )  # fmt: skip


def trace_hang(run: Path) -> str:
    """`depthscale trace hang --run RUN`'s report (it must succeed)."""
    proc = subprocess.run(
        [sys.executable, "-m", "depthscale.cli", "trace", "hang", "--run", str(run)],
        cwd=run.parent,
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def losses(run: Path) -> dict[int, float]:
    """step → training loss; a step logged again after a restart or rollback keeps its last value
    (the one the finished run is built on)."""
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("split") == "train" and "loss" in record:
            out[record["step"]] = record["loss"]
    return out


def final_parameters(run: Path) -> dict[str, torch.Tensor]:
    from depthscale.interop.run_dir import load_run

    model, _ = load_run(run)
    return model.state_dict()


def assert_same_run(run: Path, reference: Path) -> None:
    """Losses from every step and the final parameters equal the reference's, bit for bit; and
    metrics.jsonl holds each step once, in order (a restart supersedes what it trains again)."""
    logged = [
        record["step"]
        for record in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if record.get("split") == "train"
    ]
    assert logged == sorted(set(logged)), logged
    got, want = losses(run), losses(reference)
    assert got == want, {s: (got.get(s), want.get(s)) for s in want if got.get(s) != want.get(s)}
    a, b = final_parameters(run), final_parameters(reference)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def supervisor_log(run: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run / "supervisor" / "log.jsonl").read_text().splitlines()]


def events(run: Path, kind: str) -> list[dict]:
    return [e for e in supervisor_log(run) if e["event"] == kind]


def detection_s(fault: dict) -> float:
    return fault["fault"]["detected_at"] - fault["fault"]["since"]


def restart_seconds(run: Path) -> list[float]:
    return [e["fault_to_first_step_s"] for e in events(run, "restart_time")]


def mentions(text: str, pattern: str) -> bool:
    return re.search(pattern, text) is not None


def train_nodes(run: Path, nnodes: int, *args: str, steps: int = 12, timeout: float = 600):
    """A multi-node job on one host: one supervisor per simulated node (DEPTHSCALE_NODE_ID),
    node 0's hosting the store on a free port. Returns each node's completed process."""
    done = []
    for proc in start_nodes(run, nnodes, *args, steps=steps):
        out, err = proc.communicate(timeout=timeout)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


def start_nodes(run: Path, nnodes: int, *args: str, steps: int = 12) -> list[subprocess.Popen]:
    """`train_nodes` without waiting: each node's supervisor, in a process group of its own (as
    on a machine of its own: `kill_node` ends one whole)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "depthscale.cli",
                "train",
                "-c",
                CONFIG,
                *TINY,
                "--train.steps",
                str(steps),
                "--train.run_dir",
                str(run),
                *args,
                "--parallel.nnodes",
                str(nnodes),
                "--parallel.node_rank",
                str(k),
                "--parallel.master_port",
                str(port),
            ],
            cwd=run.parent,
            env=dict(os.environ, PYTHONWARNINGS="ignore", DEPTHSCALE_NODE_ID=f"node{k}"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )  # fmt: skip
        for k in range(nnodes)
    ]


def kill_node(supervisor: subprocess.Popen, run: Path, node: int, sig: int = 9) -> None:
    """A node losing power: SIGKILL to its supervisor's process group and, at once, to each of
    its workers' (the supervisor starts them in sessions of their own; a worker's checkpoint
    writer is in its group). SIGSTOP: a frozen node, its kernel still answering."""
    workers = node_events(run, node, "launch")[-1]["pids"].values()
    for group in [supervisor.pid, *map(int, workers)]:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, sig)


def node_events(run: Path, node: int, kind: str) -> list[dict]:
    path = run / "supervisor" / f"node{node}" / "log.jsonl"
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == kind]
