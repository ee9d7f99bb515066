"""Ctrl-C and `pkill -INT` against a supervised group while a background save is in flight: the
stop is named by the signal that was sent, the save in flight and the stop's own save land, and
the output is the one-line stop message (no traceback, no torch zip-writer error)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from supervised import CONFIG, TINY

from depthscale.train.manifest import newest_verified
from training_output import wait_for_step

pytestmark = pytest.mark.dist


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (workers and their checkpoint writers), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="walks /proc for the process tree")
def test_ctrl_c_then_sigint_to_every_process_during_a_save_stops_cleanly(tmp_path):
    """The first SIGINT goes to the supervisor alone (a terminal's Ctrl-C: the workers have
    process groups of their own); it was forwarded as SIGTERM and reported as "stopped by
    SIGTERM". The second goes to every process, checkpoint writers included (`pkill -INT`); a
    writer took it as a KeyboardInterrupt inside torch.save, and the run ended with rc 2 and
    "[enforce fail at inline_container.cc:672] unexpected pos"."""
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "depthscale.cli", "train", "-c", CONFIG, *TINY,
         "--train.steps", "200", "--checkpoint.every", "5", "--train.run_dir", str(run),
         "--nproc", "2", "--parallel.dp_shard", "2", "--resilience.diagnose", "false",
         "--faults", "slowsave@5:4"],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    wait_for_step(proc, 6)  # the save of step 5 is being written, 4 s longer than it takes
    os.kill(proc.pid, signal.SIGINT)
    time.sleep(0.3)
    for pid in [proc.pid, *_descendants(proc.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    assert "Traceback" not in err and "enforce fail" not in err, err[-3000:]
    [line] = [ln for ln in out.splitlines() if "stopped by" in ln]
    assert "stopped by SIGINT after step" in line, line
    step = int(line.split("after step ")[1].split(";")[0])
    assert newest_verified(run / "checkpoints") == run / "checkpoints" / f"step_{step:08d}"
    assert (run / "checkpoints" / "step_00000005").is_dir()  # the save in flight landed too
