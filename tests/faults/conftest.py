"""Uninterrupted reference runs for the fault drills, each made once per session and shared: the
drills of several modules compare with the same run (two ranks of FSDP, 12 steps), and each made
its own (~10 s a launch)."""

from __future__ import annotations

import pytest
from supervised import train


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """`reference_run(*args, steps=12)`: the directory of an uninterrupted `train(run, *args)`,
    made when first asked for. Drills only read it (losses, final parameters)."""
    made: dict[tuple, object] = {}

    def reference(*args: str, steps: int = 12):
        key = (args, steps)
        if key not in made:
            run = tmp_path_factory.mktemp("reference") / "run"
            proc = train(run, *args, steps=steps)
            assert proc.returncode == 0, proc.stderr[-3000:]
            made[key] = run
        return made[key]

    return reference
