"""A torch.profiler window over chosen steps, and on CUDA a memory snapshot of it.

The first things a user reaches for when a step is slow or runs out of memory (torchtitan's
profiling and memory snapshots). `logging.profile_steps = "20-22"` profiles those steps on
`logging.profile_ranks` and writes, per rank, RUN/trace/profile/rank00000-steps20-22.json in the
Chrome trace format (ui.perfetto.dev opens it beside `depthscale trace timeline`'s merged view),
with CPU ops and their shapes, and on CUDA the kernels; with `logging.memory_snapshot` on
CUDA also rank00000-steps20-22.pickle (pytorch.org/memory_viz). A run that stops inside the window
(a signal, an error) still writes what was recorded, named by the steps it covers.

Nothing is started outside the window: a run without `profile_steps` runs no profiler code.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from depthscale.config import Config
from depthscale.config.section_checks import profile_window_ranks, profile_window_steps


class ProfileWindow:
    def __init__(self, cfg: Config, run_dir: Path, rank: int, world: int, device_type: str):
        steps = profile_window_steps(cfg.logging.profile_steps)
        ranks = profile_window_ranks(cfg.logging.profile_ranks, world) if steps else None
        self.steps = steps if steps and (ranks is None or rank in ranks) else None
        self.folder = run_dir / "trace" / "profile"
        self.rank, self.cuda = rank, device_type == "cuda"
        self.snapshot = cfg.logging.memory_snapshot and self.cuda
        self._profiler: torch.profiler.profile | None = None
        self._last_done = 0

    def begin(self, step: int) -> None:
        """Before `step` runs: start at the window's first step."""
        if self.steps is None or step != self.steps[0] or self._profiler is not None:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if self.snapshot:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        # kineto prints a line at every start and stop unless told to print none; memory is
        # the snapshot's job (profile_memory only warns about blocks allocated before the window)
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # above USDT (4) and ERROR (5)
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        self._profiler.start()

    def end(self, step: int) -> list[Path]:
        """After `step` ran; at the window's last step, the files written (else none)."""
        if self._profiler is None:
            return []
        self._last_done = step
        return self._write() if step >= self.steps[1] else []

    def close(self) -> list[Path]:
        """The run ends (done, stopped, failed): a window still open writes what it has."""
        return self._write() if self._profiler is not None else []

    def _write(self) -> list[Path]:
        profiler, self._profiler = self._profiler, None
        if self.cuda:
            torch.cuda.synchronize()  # the window's kernels are in the trace: one sync, once
        profiler.stop()
        first, last = self.steps[0], max(self._last_done, self.steps[0])
        self.folder.mkdir(parents=True, exist_ok=True)
        stem = self.folder / f"rank{self.rank:05d}-steps{first}-{last}"
        written = [stem.with_suffix(".json")]
        profiler.export_chrome_trace(str(written[0]))
        if self.snapshot:
            torch.cuda.memory._dump_snapshot(str(stem.with_suffix(".pickle")))
            torch.cuda.memory._record_memory_history(enabled=None)
            written.append(stem.with_suffix(".pickle"))
        self.steps = None  # once per run
        return written
