"""Reading a training subprocess's console as a user watches it (shared by e2e tests and drills)."""

import subprocess
import time


def wait_for_step(proc: subprocess.Popen, step: int, timeout: float = 600) -> None:
    """Read stdout until the line for `step` (logging every step) has been printed."""
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith(f"step {step:>6}/"):
            return
    proc.kill()
    raise AssertionError(f"training never reached step {step}: {proc.stderr.read()}")
