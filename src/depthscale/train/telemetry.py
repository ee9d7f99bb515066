"""The run's observability, built once by the trainer: the span recorder and its clock offset, the
hang watchdog, the online straggler detector, the MFU-decline alarm and synchronised garbage
collection (`train.gc_interval`).

The trainer calls `begin_step` / `end_step` around a step and hands `busy_row()` to the host
vote it already exchanges every step (`step_metrics.HostVote`: straggler detection adds no
collective); every `gather_every(world)` steps `end_step` gets each rank's median row back and
returns what to log.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import shutil
import socket
import weakref
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import torch

from depthscale.config import Config
from depthscale.observe import flight_recorder, spans
from depthscale.observe.attempts import ARCHIVE, archive_name
from depthscale.observe.profile_window import ProfileWindow
from depthscale.observe.spans import BUSY_PHASES, Slowdown, SpanRecorder, trace_path
from depthscale.observe.stragglers import StragglerDetector
from depthscale.observe.watchdog import Watchdog, write_hang_dump
from depthscale.parallel.clock_sync import measure_offset
from depthscale.parallel.mesh import DistEnv, ParallelDims
from depthscale.parallel.startup import leader_first

log = logging.getLogger("depthscale.observe")


class Telemetry:
    """Everything a rank records about itself; inert (`recorder is None`) with logging.trace off.

    Built once the run directory exists (every rank together: it measures clock offsets); records
    only inside `recording()`, which `Trainer.fit` enters, so that a Trainer driven step by step
    (tests) or two in one process never record into each other's files.

    `idle`: the run is already trained to `train.steps` (every rank knows it from the checkpoint).
    Such a start records nothing and moves nothing: archiving the trace and writing new rank files
    would replace the last real run's timeline and hang dumps with empty ones."""

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        env: DistEnv,
        dims: ParallelDims,
        device: torch.device,
        idle: bool = False,
    ) -> None:
        self.cfg, self.run_dir, self.rank, self.world = cfg, run_dir, env.rank, env.world_size
        self.coords = [dims.coordinates(r) for r in range(env.world_size)]
        self.recorder: SpanRecorder | None = None
        self.watchdog: Watchdog | None = None
        self.detector: StragglerDetector | None = None
        self._step_span: spans.Open | None = None
        self._busy = dict.fromkeys(BUSY_PHASES, 0)
        self.mfu = MfuAlarm(cfg.logging.mfu_alarm)
        self.gc_interval = cfg.train.gc_interval
        self.profile = ProfileWindow(cfg, run_dir, env.rank, env.world_size, device.type)
        if not cfg.logging.trace or idle:
            if not idle:
                flight_recorder.make_dump_dir()  # NCCL's own dumps (CUDA), traced or not
            return
        _archive_previous(run_dir, self.rank)
        flight_recorder.make_dump_dir()  # after the previous attempt's went to the archive
        sizes = {
            **dims.sizes(),
            "pp_virtual": cfg.parallel.pp_virtual,
            "microbatches": cfg.grad_accum_steps,
        }
        meta = {
            "rank": self.rank,
            "world": self.world,
            "coords": self.coords[self.rank],
            "dims": sizes,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "clock": "perf_counter_ns",
            "device": device.type,
        }
        self.recorder = SpanRecorder(
            trace_path(run_dir, self.rank),
            meta,
            device_type=device.type,
            device_index=device.index,
            queue_size=cfg.logging.trace_queue,
        )
        self._finalizer = weakref.finalize(self, self.recorder.close)
        self.recorder.put(
            measure_offset(
                self.recorder.now_ns, device, env.local_rank, own_clock=self.recorder.skew_ns != 0
            )
        )
        if cfg.logging.straggler_threshold > 0 and self.world > 1:  # one process: the MFU alarm
            self.detector = StragglerDetector(
                self.coords, threshold=cfg.logging.straggler_threshold
            )

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Spans go to this rank's trace file, the watchdog watches and GC is synchronised: off,
        with what is alive now frozen out of the collections `begin_step` runs (a full one over
        everything took 0.5 s on a CPU with only torch imported); the young generations are
        collected first, for the cost of the few objects in them."""
        if self.gc_interval:
            gc.collect(1)
            gc.freeze()
            gc.disable()
        old = spans.activate(self.recorder) if self.recorder is not None else None
        if self.recorder is not None and self.cfg.logging.hang_dump_s > 0:
            self.watchdog = Watchdog(self.run_dir, self.recorder, self.cfg.logging.hang_dump_s)
        try:
            yield
        finally:
            self._said_profile(self.profile.close())
            if self.watchdog is not None:
                self.watchdog.close()
                self.watchdog = None
            if self.recorder is not None:
                spans.activate(old)
                self.recorder.flush()  # the run's records are on disk when fit returns
            if self.gc_interval:
                gc.unfreeze()
                gc.enable()

    # ------------------------------------------------------------------ per step

    def begin_step(self, step: int) -> None:
        """`step`: the optimizer step about to run (1-based)."""
        spans.set_step(step)
        if self.gc_interval and step % self.gc_interval == 0 and not gc.isenabled():
            with spans.span("gc", "compute"):
                gc.collect()  # the same step on every rank: no rank launches collectives late
        self._step_span = spans.begin("step", "step")
        self.profile.begin(step)

    def busy_row(self) -> list[float]:
        """This rank's busy milliseconds per phase in the step that just ran (zeros untraced)."""
        self._busy = self.recorder.take_busy() if self.recorder else dict.fromkeys(BUSY_PHASES, 0)
        return [self._busy[p] / 1e6 for p in BUSY_PHASES]

    def end_step(
        self,
        step: int,
        rows: list[list[float]] | None,
        mfu: float | None,
        rows_step: int | None = None,
    ) -> list[tuple[str, str, dict]]:
        """Close the step; feed every rank's busy row (None: one process or none yet) of step
        `rows_step` (default `step`) to the straggler detector and this rank's phase times to the
        MFU alarm. Returns (kind, message, fields) to print and log — the same on every rank;
        rank 0 logs them."""
        if self._step_span is not None:
            spans.end(self._step_span)
            self._step_span = None
        self._said_profile(self.profile.end(step))
        notices = []
        if self.recorder is not None:
            self.recorder.put(
                {"kind": "step", "step": step, "busy": {p: int(v) for p, v in self._busy.items()}}
            )
        if self.detector is not None and rows is not None:
            rows_at = step if rows_step is None else rows_step
            for flag in self.detector.update(rows_at, [[v * 1e6 for v in row] for row in rows]):
                notices.append(("straggler", flag.message(), flag.as_record()))
                if self.recorder is not None and self.rank == 0:
                    self.recorder.put({"kind": "straggler", **flag.as_record()})
        wall = self.recorder.take_wall() if self.recorder is not None else {}
        alarm = self.mfu.update(step, mfu, wall)
        if alarm:
            notices.append(("mfu_alarm", alarm[0], alarm[1]))
        return notices

    def _said_profile(self, files: list[Path]) -> None:
        opens = {".json": "ui.perfetto.dev", ".pickle": "pytorch.org/memory_viz"}
        for f in files:
            print(f"depthscale: rank {self.rank}: profile of the steps written to {f} (open it in "
                  f"{opens[f.suffix]})", flush=True)  # fmt: skip

    def abandon_step(self) -> None:
        """The step was given up (rolled back): close its span, record nothing of it."""
        if self._step_span is not None:
            spans.end(self._step_span)
            self._step_span = None

    def slow_ranks(self) -> list[int]:
        """Ranks the straggler detector has flagged and not yet seen recover (same on every rank)."""
        if self.detector is None:
            return []
        return [r for r, flags in enumerate(self.detector.flagged) if any(flags)]

    def slow_down(self, slow: tuple[float, int] | None) -> None:
        """Drills (`slow@R:F`): this rank's forward and backward take `factor`× as long."""
        if slow is not None and self.recorder is not None:
            factor, from_step = slow
            self.recorder.slowdown = Slowdown(from_step, factor - 1, 0, ("forward", "backward"))

    def on_error(self, error: BaseException, say: bool = True) -> None:
        """A collective or message timed out or lost its peer: dump what this rank was in, for
        `depthscale trace hang`. Only then — the trainer calls it for those errors alone: a rank's
        own error (bad data, a NaN, a full disk) is no hang, and its report is the error itself.
        `say`: log where the dump went (not when the error's one line already points there)."""
        if self.recorder is not None:
            path = write_hang_dump(self.run_dir, self.recorder, "error", f"{error!r}")
            if say:
                log.error("rank %d: wrote its hang dump to %s", self.rank, path)

    def close(self) -> None:
        """Flush and close the trace file (also done when the Telemetry is collected)."""
        if self.recorder is not None:
            self._finalizer()


class MfuAlarm:
    """Warns when rolling MFU stays `drop` (fraction) below its best for a window of steps, naming
    the phase whose time
    grew most since the best window (MegaScale §6.3: MFU that declines over a long run) — or saying
    that none grew measurably (by more than `MEASURABLE` of the best window's step, and 0.05 ms),
    rather than name a phase that went from 0.0 to 0.0 ms."""

    MEASURABLE = 0.02
    """A phase "grew" by more than this fraction of the best window's traced step: an MFU decline
    worth an alarm (10 %) lengthens the step by over 11 %, so its cause clears this easily."""
    MIN_GROWTH_NS = 50_000
    """...and by more than this, for steps too short for a fraction to rise above timer noise."""

    def __init__(self, drop: float, window: int = 20) -> None:
        self.drop, self.window = drop, window
        self._mfu: deque[float] = deque(maxlen=window)
        self._phases: deque[dict[str, float]] = deque(maxlen=window)
        self.best: tuple[float, dict[str, float]] | None = None
        self._alarmed = False
        self._below = 0
        """Steps in a row whose rolling MFU was `drop` below the best: the alarm waits for a whole
        window of them. The best is the highest of many noisy windows, so a loaded machine, a
        background checkpoint writer or an evaluation dips under it for a few steps in almost
        every run (a loaded 4-rank tour alarmed in each); a decline worth a line outlasts them."""

    def update(
        self, step: int, mfu: float | None, wall: dict[str, float]
    ) -> tuple[str, dict] | None:
        """`wall`: this rank's wall ns per phase in the step (`SpanRecorder.take_wall`)."""
        if self.drop <= 0 or mfu is None or not wall:
            return None
        self._mfu.append(mfu)
        self._phases.append(dict(wall))
        if len(self._mfu) < self.window:
            return None
        rolling = sum(self._mfu) / len(self._mfu)
        phases = {p: sum(d[p] for d in self._phases) / len(self._phases) for p in wall}
        if self.best is None or rolling > self.best[0]:
            self.best, self._alarmed, self._below = (rolling, phases), False, 0
            return None
        best, then = self.best
        self._below = self._below + 1 if rolling < (1 - self.drop) * best else 0
        if self._below < self.window or self._alarmed:
            return None
        self._alarmed = True
        grew = self.grown_phase(then, phases)
        text = (
            f"MFU declined: rolling {rolling:.1%} over the last {self.window} steps at step {step} "
            f"is {1 - rolling / best:.0%} below its best {best:.1%}; "
        )
        if grew is None:
            text += (
                f"no phase of this rank's step grew measurably (traced step "
                f"{sum(then.values()) / 1e6:.1f} → {sum(phases.values()) / 1e6:.1f} ms)"
            )
        else:
            text += (
                f"the phase that grew most is {grew} ({then[grew] / 1e6:.1f} → "
                f"{phases[grew] / 1e6:.1f} ms per step on this rank)"
            )
        return text, {"mfu": rolling, "best_mfu": best, "phase": grew}

    def grown_phase(self, then: dict[str, float], now: dict[str, float]) -> str | None:
        """The phase whose mean ns per step grew most from `then` to `now`, if any grew
        measurably."""
        grew = max(now, key=lambda p: now[p] - then.get(p, 0.0))
        floor = max(self.MIN_GROWTH_NS, self.MEASURABLE * sum(then.values()))
        return grew if now[grew] - then.get(grew, 0.0) > floor else None


def _archive_previous(run_dir: Path, rank: int) -> None:
    """A resumed run keeps the previous invocation's traces: rank 0 moves them to
    trace/archive/<time>/ before anyone writes; the others wait for rank 0 alone (no barrier).
    `trace hang` and `trace timeline` look there when RUN/trace has no dumps or spans
    (`observe/attempts.py`)."""
    trace = Path(run_dir) / "trace"

    def archive() -> None:
        if rank != 0 or not trace.is_dir():
            return
        old = [p for p in trace.iterdir() if p.name != ARCHIVE]
        if old:
            dest = trace / ARCHIVE / archive_name(trace)
            dest.mkdir(parents=True)
            for p in old:
                shutil.move(str(p), dest / p.name)

    leader_first("archive_traces", 0, archive)
