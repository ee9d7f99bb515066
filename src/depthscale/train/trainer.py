"""The training loop: build everything from one Config, then step, log, evaluate and checkpoint.

Kept apart from the model (`model/`) and from how a model is parallelized (`parallel/`), torchtitan
style: `Trainer.__init__` builds, `Trainer.train_step` does one optimizer step, `Trainer.fit` loops.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from depthscale.config import Config
from depthscale.data.loader import DataBundle
from depthscale.data.prefetch import Prefetcher
from depthscale.errors import TrainingError
from depthscale.evaluation.held_out import Evaluator
from depthscale.model.documents import DocumentPacking
from depthscale.model.transformer import Transformer
from depthscale.observe import spans, startup
from depthscale.observe.metrics import Throughput, flops_per_token
from depthscale.parallel.parallelize import parallelize
from depthscale.resilience.faults import attempt
from depthscale.resilience.heartbeat import Heartbeat
from depthscale.shape import ModelShape
from depthscale.train import console, setup
from depthscale.train.checkpoint import Checkpointer, is_model_only
from depthscale.train.hooks import Hooks, Run
from depthscale.train.hooks.defaults import default_hooks
from depthscale.train.nan_guard import (
    NanGuard,
    PersistentNonFinite,
    not_finite_error,
    poison,
    read_skipped,
    roll_back_to,
)
from depthscale.train.offload import OffloadStats, offloading_for
from depthscale.train.optim import build_optimizer
from depthscale.train.peer_loss import peer_failure, timeout_names
from depthscale.train.schedule import lr_at, set_lr
from depthscale.train.snapshot import Snapshots
from depthscale.train.step_metrics import HostVote, PendingMetrics
from depthscale.train.stop import StopSignals, stopped_line
from depthscale.train.telemetry import Telemetry


class Trainer:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.timeout_shortened = False  # parallel.setup_timeout_s in force until the first step
        # first: a supervised worker is watched from the start (a hang in start-up is a hang too)
        self.heartbeat = Heartbeat.from_env(int(os.environ.get("RANK", "0")), attempt())
        self.layout, self.faults, self.dtype = setup.start_runtime(cfg, self.heartbeat)
        self.env, self.device = self.layout.env, self.layout.device
        self.dp_rank, self.dp_size = self.layout.dp_rank, self.layout.dp_size
        self.run_dir = cfg.run_path
        self.checkpointer = Checkpointer(self.run_dir / "checkpoints", cfg.checkpoint, cfg.model)
        if self.heartbeat is not None:
            self.heartbeat.probe("saving", lambda: self.checkpointer.saving_step)
        self.checkpointer.inject_write_error_at = self.faults.failing_save()
        self.checkpointer.inject_write_delay = self.faults.slow_save()
        self.snapshots = Snapshots(cfg, self.checkpointer)  # in memory, kept by the node's keeper
        # the newest snapshot or checkpoint that verifies, of this model (train/snapshot.py)
        resume_from = self.snapshots.resolve_resume()
        self._init_data()
        self._init_model()
        self.step = 0
        self.tokens_seen = 0
        self.signals: StopSignals | None = None
        self.stop_agreed = False
        self.stopped_by: signal.Signals | None = None
        """The signal that ended `fit` early (agreed by all ranks), or None."""
        self.data.train.exclude(read_skipped(self.run_dir))
        if resume_from is not None:
            setup.check_same_tokenizer(self.run_dir, self.data.tokenizer)
            self._restore(resume_from)
        startup.mark("checkpoint_load")
        self.snapshots.report(self.heartbeat, resume_from, self.checkpointer.last_restore)
        if self.env.is_main:  # last: a refused or failed start leaves the run directory as it was
            setup.write_run_files(self.run_dir, cfg, self.data.tokenizer)
        self._init_loop()

    def _init_data(self) -> None:
        hb = self.heartbeat  # tokenizing in train is progress the supervisor sees
        tokenizing = None if hb is None else (lambda n: hb.update(tokenized=n))
        self.data: DataBundle = setup.build_data_once_per_node(
            self.cfg, self.env, self.dp_size, progress=tokenizing
        )
        self.cfg.resolve_vocab_size(self.data.tokenizer.vocab_size)
        startup.mark("data")

    def _init_model(self) -> None:
        """Built on the meta device: parallelize() splits and shards it, then each rank
        materialises and initialises only its own shards (the values one process would draw)."""
        cfg = self.cfg
        with torch.device("meta"):
            self.model = Transformer(cfg.model)
        self.model.set_recompute(cfg.train.recompute)  # part of the layers: before sharding
        self.plan = parallelize(
            self.model, self.layout.mesh, self.layout.dims, cfg, device=self.device
        )
        if cfg.data.document_mask:
            eos = self.data.tokenizer.eos_id
            self.plan.pack_documents(DocumentPacking(eos, cfg.data.mask_eos_target))
        self.offload = OffloadStats() if cfg.train.offload_activations else None
        if cfg.train.compile:
            setup.compile_blocks(self.model)
        self.forward = self.model
        self.optimizer = build_optimizer(self.model, cfg.optim)
        replay = cfg.resilience.nan_replay
        guard_calls = (self._optimizer_step, self._not_finite, self._nan_event)
        self.guard = NanGuard(self.optimizer, replay, *guard_calls)
        self.evaluator = Evaluator(
            cfg, self.data, self.plan, self.env.world_size, self.dp_rank, self.dp_size, self.device
        )
        startup.mark("model")

    def _init_loop(self) -> None:
        """What the step loop runs with: telemetry, the metrics and the stop vote, the batch
        prefetcher, the throughput meter and the hooks."""
        cfg = self.cfg
        idle = self.step >= cfg.train.steps  # `fit` will have nothing to do
        self.telemetry = Telemetry(cfg, self.run_dir, self.env, self.layout.dims, self.device, idle)
        self.pending = PendingMetrics(self.env.world_size)
        self.vote = HostVote(self.env.world_size, self.env.rank)
        self.busy_rows: list[list[float]] | None = None
        self.telemetry.slow_down(self.faults.slowdown())
        on_gpu = self.device.type == "cuda"
        self.batches = Prefetcher(
            self.data.train, self.dp_rank, self.dp_size, pin=on_gpu,
            device_index=self.device.index if on_gpu else None,
        )  # fmt: skip
        self.tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
        peak, self.peak_source = setup.peak_flops(cfg, self.device, self.dtype)
        flops = flops_per_token(cfg.model, cfg.data.seq_len)
        hardware = flops_per_token(cfg.model, cfg.data.seq_len, cfg.train.recompute)
        self.throughput = Throughput(
            flops, peak, n_devices=self.env.world_size, peak_source=self.peak_source,
            hardware_flops_per_token=hardware,
        )  # fmt: skip
        self.hooks = Hooks(default_hooks(self.heartbeat, self.snapshots))

    # ------------------------------------------------------------------ state

    def trainer_state(self) -> dict[str, Any]:
        data = self.batches.state_dict()
        return {"step": self.step, "tokens_seen": self.tokens_seen, "data": data}

    def _restore(self, path: Path) -> None:
        resolve = self.snapshots.resolver(path)  # a version spread over several nodes' memory
        state = self.checkpointer.load(path, self.model, self.optimizer, self.layout.mesh, resolve)
        self.step = state["step"]
        self.tokens_seen = state.get("tokens_seen", 0)
        if not is_model_only(state):
            loader = getattr(self, "batches", self.data.train)  # the prefetcher once running
            loader.load_state_dict(state["data"])

    def save_checkpoint(self, last: bool = False) -> Path:
        """Save this step (in the background where async); `last`: the run ends after it. The
        pending metrics are read first: a non-finite step not yet read stops the run before it
        is saved (copying the state waits for the device anyway)."""
        self._read_metrics()
        with spans.span("checkpoint", "checkpoint"):
            path = self.checkpointer.save(
                self.step, self.model, self.optimizer, self.trainer_state(), last=last
            )
        self.faults.corrupt_after_save(self.step, path, self.checkpointer.wait, self.env.is_main)
        return path

    # ------------------------------------------------------------------ steps

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def train_step(self) -> dict[str, float]:
        """One optimizer step, its metrics read at once (`fit` reads them once per log_every)."""
        metrics = self._train_step()
        self.pending.add(metrics)
        self._read_metrics()
        return metrics

    def _train_step(self) -> dict[str, Any]:
        """One optimizer step over the global batch, in `grad_accum_steps` micro-batches; the
        loss share and gradient norm stay on the device (`step_metrics.PendingMetrics`)."""
        step = self.step + 1
        self.telemetry.begin_step(step)
        self.faults.at_step_start(step)
        lr = lr_at(self.step, self.cfg.optim, self.cfg.train.steps)
        set_lr(self.optimizer, lr)
        with spans.span("data", "data"):
            inputs, labels = self.batches.next_batch()
        total, grad_norm, flag = self.guard.update(
            lambda: self._forward_backward(inputs, labels, step), step, self.batches.position
        )
        self.step += 1
        self.tokens_seen += self.tokens_per_step
        stop = self.signals is not None and self.signals.received is not None
        self.stop_agreed, self.busy_rows = self.vote.exchange(stop, self.telemetry.busy_row())
        metrics = {"loss": total.detach(), "lr": lr, "grad_norm": grad_norm.detach()}
        metrics["finite"] = flag
        metrics |= self.plan.finish_step()  # MoE: experts' loads, the balancing bias update
        if self.offload is not None:  # this rank's bytes moved to host memory during the step
            metrics["offloaded_mb"] = self.offload.bytes / 1e6
            self.offload.reset()
        return metrics

    def _read_metrics(self) -> None:
        """Read the pending steps' metrics (once per log step); a step the NaN guard found
        non-finite there (its update skipped on the device, nan_replay=false) stops the run."""
        resolved = self.pending.resolve()
        first = self.step - len(resolved) + 1
        bad = [first + i for i, m in enumerate(resolved) if not m.pop("finite")]
        if bad:
            raise self._not_finite(bad)

    def _optimizer_step(self) -> None:
        with spans.span("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def _not_finite(self, steps: list[int]) -> TrainingError:
        return not_finite_error(steps, lr_at(steps[0] - 1, self.cfg.optim, self.cfg.train.steps))

    def _forward_backward(self, inputs: Tensor, labels: Tensor, step: int) -> tuple[Tensor, Tensor]:
        """Loss share and global gradient norm of one try at the step (gradients clipped)."""
        around = lambda: self._around_forward(step)  # noqa: E731
        total = self.plan.forward_backward(self.forward, inputs, labels, self.autocast, around)
        self.plan.reduce_gradients()
        if self.faults and self.faults.poison_loss(step, self.batches.position):
            total = poison(total, list(self.model.parameters()))
        return total, self.plan.clip_gradients(self.cfg.train.grad_clip)

    def _around_forward(self, step: int) -> contextlib.AbstractContextManager:
        self.faults.in_forward(step)
        return offloading_for(self.offload, len(self.model.layers), self.cfg.parallel)

    def _nan_event(self, step: int, kind: str, text: str) -> None:
        event = {"step": step, "kind": kind, "text": f"step {step}: {text}"}
        console.say(f"depthscale: {event['text']}")
        self.hooks.nan_event(event)

    def _roll_back(self, bad: PersistentNonFinite) -> None:
        """The batch of `bad.step` stays non-finite: skip it from now on and go back to the
        newest verified checkpoint (`nan_guard.roll_back_to`)."""
        self.telemetry.abandon_step()
        self.pending.resolve()  # the steps before it, numbered before rolling back
        self.batches.exclude([bad.position])
        resume, is_main = self.cfg.checkpoint.resume, self.env.is_main
        path = roll_back_to(bad, self.run_dir, self.checkpointer, resume, is_main)
        self._nan_event(bad.step, "persistent", f"still non-finite on replay: rolling back to "
                        f"{path.name} and skipping the batch at data position {bad.position}")  # fmt: skip
        self._restore(path)

    # ------------------------------------------------------------------ loop

    def fit(self, stop_at: int | None = None) -> list[dict[str, float]]:
        """Train to `train.steps`; returns the per-step metrics of this invocation. `stop_at` ends the
        loop early without a final checkpoint, as a crash would (used to test resumption).
        SIGINT / SIGTERM end it after the current step, with a checkpoint (`stopped_by` is then
        the signal)."""
        try:
            with (
                StopSignals(second_sigint_interrupts=self.env.world_size == 1) as signals,
                self.telemetry.recording(),
            ):
                self.signals = signals
                return self._fit(stop_at)
        except Exception as err:
            timeouts = timeout_names(self.cfg.parallel, self.timeout_shortened)
            failed = peer_failure(
                err, self.env.rank, self.step + 1, self.telemetry, self.run_dir, timeouts
            )
            if failed is not None:
                raise failed from err
            raise
        finally:
            self.signals = None
            self.batches.close()

    def _fit(self, stop_at: int | None) -> list[dict[str, float]]:
        """The step loop: a step, then the hooks at their points (`train/hooks/`)."""
        steps = self.cfg.train.steps
        if self.step >= steps:
            console.say(f"{self.run_dir}: already trained to step {self.step} "
                        f"(train.steps={steps}); nothing to do")  # fmt: skip
            return []
        total = self.plan.num_params()
        active = total - ModelShape.from_config(self.cfg.model).idle_params()
        console.announce(self.cfg, total, active, self.device, self.run_dir, self.step)
        bar = console.progress(self.cfg, self.step)
        with console.metrics_logger(self.run_dir, self.cfg, self.env.is_main, self.step) as logger:
            run = Run(self, logger, bar)
            self.throughput.reset()
            while self.step < steps:
                if stop_at is not None and self.step >= stop_at:  # as a crash would: no save
                    self.checkpointer.wait()
                    self._read_metrics()
                    self.vote.close()
                    return run.history
                t0 = time.perf_counter()
                try:
                    metrics = self._train_step()
                except PersistentNonFinite as bad:
                    self._roll_back(bad)
                    logger.supersede(self.step)  # the steps after it are trained again
                    continue
                seconds = time.perf_counter() - t0
                self.pending.add(metrics)
                run.history.append(metrics)
                self.hooks.step_end(run, metrics, seconds)
                log_now = self.step % self.cfg.logging.log_every == 0 or self.step == steps
                if log_now or self.stop_agreed:  # the only steps that read device numbers
                    self._read_metrics()
                    self.hooks.metrics_read(run, metrics)
                if log_now:
                    self.hooks.log(run, metrics)
                if self.stop_agreed:
                    self.vote.close()
                    self._stop_on_signal(run)
                    return run.history
                self.hooks.after_step(run)
            self.vote.close()
            self.hooks.fit_end(run)
            self.save_checkpoint(last=True)
            self.checkpointer.wait(final=True)
        if bar is not None:
            bar.close()
        console.say(f"done: step {self.step}, loss {run.history[-1]['loss']:.4f}, checkpoint in "
                    f"{self.checkpointer.latest()}")  # fmt: skip
        return run.history

    def _stop_on_signal(self, run: Run) -> None:
        """Every rank agreed to stop after this step: save (unless this step just was), then say
        where the run resumes."""
        if run.bar is not None:
            run.bar.close()
        received = self.signals.received if self.signals else None
        if self.cfg.checkpoint.on_signal and run.saved_at != self.step:
            self.save_checkpoint(last=True)
        self.checkpointer.wait(final=True)
        console.say(stopped_line(received, self.step, self.checkpointer.latest()))
        self.stopped_by = received or signal.SIGTERM
