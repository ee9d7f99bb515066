"""What a step reports: throughput and MFU, telemetry notices, the metrics log and console line, the
progress bar, and the first step's one-time notes."""

from __future__ import annotations

from typing import Any

from depthscale.model.attnres_ops import kernel_paths
from depthscale.observe import startup
from depthscale.parallel.mesh import shorten_timeout
from depthscale.train import console
from depthscale.train.hooks import Hook, Run


class FirstStep(Hook):
    """Once per `fit`, after its first step: which AttnRes kernels ran, where start-up went
    (RUN/startup/), and the process groups' timeout shortened from `parallel.setup_timeout_s`
    (compiles and first collectives are slow) to `parallel.timeout_s`."""

    def step_end(self, run: Run, metrics: dict[str, Any], seconds: float) -> None:
        if len(run.history) != 1:
            return
        t = run.trainer
        _print_kernel_paths()
        startup.mark("first_step")
        startup.save(t.run_dir, t.env.rank)
        shorten_timeout(t.cfg.parallel.timeout_s)
        t.timeout_shortened = True


class Throughput(Hook):
    """tokens/s and MFU of the step, and a note when a measured rate raised the MFU peak."""

    def step_end(self, run: Run, metrics: dict[str, Any], seconds: float) -> None:
        t = run.trainer
        t.throughput.update(t.tokens_per_step, seconds)
        metrics |= t.throughput.rate()
        if (note := t.throughput.take_note()) is not None:
            run.say(note)


class TelemetryNotices(Hook):
    """Stragglers and MFU alarms, the same on every rank. Busy rows arrive one step late
    (`HostVote`): they are the previous step's."""

    def step_end(self, run: Run, metrics: dict[str, Any], seconds: float) -> None:
        t = run.trainer
        notices = t.telemetry.end_step(
            t.step, t.busy_rows, metrics.get("mfu"), rows_step=t.step - 1
        )
        for kind, text, fields in notices:
            run.say(text)
            run.event(t.step, kind, fields)


class Logging(Hook):
    """Log steps: the data stream's own metrics (a mixture's tokens and epochs per source) join
    the step's, then the metrics log and the console line."""

    def log(self, run: Run, metrics: dict[str, Any]) -> None:
        t = run.trainer
        metrics |= t.batches.metrics()
        run.logger.log(t.step, metrics)
        console.write(run.bar, console.format_step(t.step, t.cfg.train.steps, metrics))


class Progress(Hook):
    """The progress bar (rank 0, a terminal): loss and tokens/s when read, one tick a step."""

    def metrics_read(self, run: Run, metrics: dict[str, Any]) -> None:
        if run.bar is not None:
            run.bar.set_postfix(
                loss=f"{metrics['loss']:.3f}", tok_s=f"{metrics['tokens_per_s']:.0f}"
            )

    def after_step(self, run: Run) -> None:
        if run.bar is not None:
            run.bar.update(1)


def _print_kernel_paths() -> None:
    """One line naming the AttnRes read paths this rank took (fused Triton / CPU kernels, or the
    PyTorch fallback with its reason): a silent fallback is how a slow bf16 run goes unnoticed."""
    paths = kernel_paths(reasons=True)
    if paths:
        console.say("AttnRes kernels: " + ", ".join(f"{k}={v}" for k, v in sorted(paths.items())))
