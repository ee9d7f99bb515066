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
import torch.distributed as dist
from torch import Tensor

from depthscale.config import Config, to_toml
from depthscale.data.loader import DataBundle
from depthscale.data.mixture import mixture_metrics
from depthscale.data.prefetch import Prefetcher
from depthscale.errors import PeersFailed, TrainingError
from depthscale.model.attnres_ops import kernel_paths
from depthscale.model.documents import DocumentPacking
from depthscale.model.transformer import Transformer
from depthscale.observe import flight_recorder, spans, startup
from depthscale.observe.metrics import Throughput, flops_per_token
from depthscale.parallel.mesh import shorten_timeout
from depthscale.parallel.parallelize import init_layout, parallelize
from depthscale.resilience.diagnostics import DIAGNOSE_ENV, diagnose_in_group
from depthscale.resilience.faults import FaultPlan, attempt, corrupt_checkpoint, parse_faults
from depthscale.resilience.heartbeat import Heartbeat
from depthscale.shape import ModelShape
from depthscale.train import console, setup
from depthscale.train.checkpoint import Checkpointer, is_model_only
from depthscale.train.evaluation import Evaluator
from depthscale.train.host import expandable_segments, keep_freed_host_memory
from depthscale.train.memory import OffloadStats, offload_activations
from depthscale.train.nan_guard import (
    EarlyRead,
    PersistentNonFinite,
    finite_flag,
    poison,
    read_skipped,
    record_skipped,
    skip_if_not_finite,
)
from depthscale.train.optim import build_optimizer
from depthscale.train.peer_loss import describe as describe_lost_peer
from depthscale.train.peer_loss import is_peer_loss
from depthscale.train.schedule import lr_at, set_lr
from depthscale.train.snapshot import Snapshots
from depthscale.train.step_metrics import HostVote, PendingMetrics
from depthscale.train.stop import StopSignals
from depthscale.train.telemetry import Telemetry

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Trainer:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.timeout_shortened = False  # parallel.setup_timeout_s in force until the first step
        # first: a supervised worker is watched from the start (a hang in start-up is a hang too)
        self.heartbeat = Heartbeat.from_env(int(os.environ.get("RANK", "0")), attempt())
        self.device = setup.resolve_device(cfg.train.device)
        if cfg.train.keep_host_memory is True or (
            cfg.train.keep_host_memory == "auto" and self.device.type == "cpu"
        ):
            keep_freed_host_memory()
        expandable_segments(self.device.type)  # before the first CUDA allocation
        if self.device.type == "cuda":  # read when the first NCCL group is made
            flight_recorder.configure_nccl(cfg.run_path)
        self.layout = init_layout(cfg, self.device)
        self.env, self.device = self.layout.env, self.layout.device
        self.dp_rank, self.dp_size = self.layout.dp_rank, self.layout.dp_size
        self.faults = FaultPlan(parse_faults(cfg.resilience.faults), self.env.rank)
        if self.heartbeat is not None:
            self.heartbeat.update(coords=self.layout.dims.coordinates(self.env.rank))
            if os.environ.get(DIAGNOSE_ENV) and self.env.world_size > 1:  # a restart after a fault
                diagnose_in_group(cfg.run_path / "checkpoints", self.heartbeat.publish_diagnostics)
                startup.mark("diagnose")
        self.dtype = DTYPES[cfg.train.dtype]
        setup.apply_tf32(cfg.train.tf32, self.device)
        if cfg.train.deterministic:
            torch.use_deterministic_algorithms(True)
        setup.seed_everything(cfg.train.seed)
        self.run_dir = cfg.run_path
        self.checkpointer = Checkpointer(self.run_dir / "checkpoints", cfg.checkpoint, cfg.model)
        if self.heartbeat is not None:
            self.heartbeat.probe("saving", lambda: self.checkpointer.saving_step)
        self.checkpointer.inject_write_error_at = self.faults.failing_save()
        self.checkpointer.inject_write_delay = self.faults.slow_save()
        self.snapshots = Snapshots(cfg, self.checkpointer)  # in memory, kept by the node's keeper
        # the newest snapshot or checkpoint that verifies, of this model (train/snapshot.py)
        resume_from = self.snapshots.resolve_resume()

        tokenizing = None
        if self.heartbeat is not None:  # tokenizing in train is progress the supervisor sees
            tokenizing = lambda n: self.heartbeat.update(tokenized=n)  # noqa: E731
        self.data: DataBundle = setup.build_data_once_per_node(
            cfg, self.env, self.dp_size, progress=tokenizing
        )
        cfg.resolve_vocab_size(self.data.tokenizer.vocab_size)
        startup.mark("data")
        # Built on the meta device: parallelize() splits and shards it, then each rank materialises
        # and initialises only its own shards (the values one process would draw).
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
        self.evaluator = Evaluator(
            cfg, self.data, self.plan, self.env.world_size, self.dp_rank, self.dp_size, self.device
        )
        startup.mark("model")
        self.step = 0
        self.tokens_seen = 0
        self.signals: StopSignals | None = None
        self.stop_agreed = False
        self.stopped_by: signal.Signals | None = None
        """The signal that ended `fit` early (agreed by all ranks), or None."""

        self.data.train.skip = read_skipped(self.run_dir)
        if resume_from is not None:
            setup.check_same_tokenizer(self.run_dir, self.data.tokenizer)
            self._restore(resume_from)
        startup.mark("checkpoint_load")
        self.snapshots.report(self.heartbeat, resume_from, self.checkpointer.last_restore)
        self.nan_events: list[dict[str, Any]] = []
        # Written last, once everything above has been checked: a refused or failed start leaves an
        # existing run directory as it was, and creates none.
        if self.env.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.toml").write_text(to_toml(cfg))
            self.data.tokenizer.save(self.run_dir / "tokenizer")
        self.telemetry = Telemetry(
            cfg,
            self.run_dir,
            self.env,
            self.layout.dims,
            self.device,
            idle=self.step >= cfg.train.steps,  # `fit` will have nothing to do
        )
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
        self.throughput = Throughput(
            flops_per_token(cfg.model, cfg.data.seq_len),
            peak,
            n_devices=self.env.world_size,
            peak_source=self.peak_source,
        )

    # ------------------------------------------------------------------ state

    def trainer_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "data": self.batches.state_dict(),
        }

    def _restore(self, path: Path) -> None:
        state = self.checkpointer.load(path, self.model, self.optimizer, self.layout.mesh)
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
        if self.faults.corrupts(self.step):
            self.checkpointer.wait()
            if self.env.is_main:
                name = corrupt_checkpoint(path)
                console.say(f"depthscale: injected fault: flipped a byte of {path / name}")
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
        loss share and gradient norm stay on the device (`step_metrics.PendingMetrics`).

        A non-finite loss or gradient on any rank (`nan_guard.finite_flag`) updates nothing: the
        step is replayed once on the same batch; still non-finite, PersistentNonFinite. Without
        replay (`resilience.nan_replay=false`) and with an optimizer that skips on the device
        (fused AdamW), the flag is read only with the metrics: the step reads nothing."""
        cfg = self.cfg
        step = self.step + 1
        self.telemetry.begin_step(step)
        self.faults.at_step_start(step)
        lr = lr_at(self.step, cfg.optim, cfg.train.steps)
        set_lr(self.optimizer, lr)
        with spans.span("data", "data"):
            inputs, labels = self.batches.next_batch()
        for first_try in (True, False):
            total, grad_norm = self._forward_backward(inputs, labels, step, first_try)
            flag = finite_flag(total, grad_norm)
            early = EarlyRead(flag) if cfg.resilience.nan_replay else None
            skips_on_device = skip_if_not_finite(self.optimizer, flag)
            if skips_on_device:  # launched now, a no-op on the device if the flag is 0
                self._optimizer_step()
                if not cfg.resilience.nan_replay:
                    break  # the flag is read with the metrics, on the next log step
            # the guard's one read per step; where the update skips itself, it is already queued
            if early.true() if early is not None else flag.item() > 0:
                if not skips_on_device:
                    self._optimizer_step()
                break
            self.optimizer.zero_grad(set_to_none=True)
            if not cfg.resilience.nan_replay:
                raise self._not_finite([step])
            if not first_try:
                raise PersistentNonFinite(step, self.batches.position)
            self._nan_event(step, "transient", "non-finite loss or gradient; replaying the step")
        else:  # pragma: no cover - the loop always breaks or raises
            raise AssertionError
        if not first_try:
            self._nan_event(step, "transient", "the replay was finite: a transient fault")
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
        lr = lr_at(steps[0] - 1, self.cfg.optim, self.cfg.train.steps)
        later = f" and {len(steps) - 1} later step(s)" if len(steps) > 1 else ""
        return TrainingError(
            f"the loss or gradient is not finite at step {steps[0]} (lr {lr:.3g}){later}; nothing "
            "was updated or saved from it. Lower optim.lr, raise optim.warmup_steps, keep "
            "train.grad_clip > 0, or set resilience.nan_replay=true to replay and skip bad "
            "batches"
        )

    def _forward_backward(
        self, inputs: Tensor, labels: Tensor, step: int, first_try: bool
    ) -> tuple[Tensor, Tensor]:
        """Loss share and global gradient norm of one try at the step (gradients clipped)."""
        total = self.plan.forward_backward(
            self.forward,
            inputs,
            labels,
            autocast=self.autocast,
            around_forward=lambda: self._around_forward(step),
        )
        self.plan.reduce_gradients()
        if self.faults and self.faults.poison_loss(step, self.batches.position):
            total = poison(total, list(self.model.parameters()))
        return total, self.plan.clip_gradients(self.cfg.train.grad_clip)

    def _around_forward(self, step: int) -> contextlib.AbstractContextManager:
        self.faults.in_forward(step)
        return self._offloading()

    def _nan_event(self, step: int, kind: str, text: str) -> None:
        event = {"step": step, "kind": kind, "text": f"step {step}: {text}"}
        self.nan_events.append(event)
        console.say(f"depthscale: {event['text']}")
        if self.heartbeat is not None:
            self.heartbeat.update(nan_events=list(self.nan_events))

    def _roll_back(self, bad: PersistentNonFinite) -> None:
        """The batch of `bad.step` stays non-finite: never train on it again (recorded in the run
        directory), and go back to the newest verified checkpoint."""
        self.data.train.skip.add(bad.position)
        if self.env.is_main:
            record_skipped(self.run_dir, bad.step, bad.position)
        self.checkpointer.wait()
        path = self.checkpointer.resolve_resume() if self.cfg.checkpoint.resume != "none" else None
        if path is None:
            raise TrainingError(
                f"{bad}; its batch (data position {bad.position}) is recorded in "
                f"{self.run_dir / 'skipped_batches.json'} and will be skipped, but there is no "
                "verified checkpoint to roll back to: start the run again (a supervised run "
                "restarts by itself)"
            )
        self._nan_event(
            bad.step,
            "persistent",
            f"still non-finite on replay: rolling back to {path.name} and skipping the batch at "
            f"data position {bad.position}",
        )
        self._restore(path)

    def _offloading(self) -> contextlib.AbstractContextManager:
        if self.offload is None:
            return contextlib.nullcontext()
        # the layers one forward runs (a pipeline stage runs one of this rank's chunks): backward
        # brings back a layer's worth of activations ahead of use
        p = self.cfg.parallel
        layers = max(1, len(self.model.layers) // (p.pp_virtual if p.pp > 1 else 1))
        return offload_activations(self.offload, layers=layers)

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
            if is_peer_loss(err):  # another process is gone: one line naming it
                raise PeersFailed(self._lost_peer(err)) from err
            if _peers_failed(err):  # a hang seen from here: the hang analysis reads every dump
                self.telemetry.on_error(err)
                raise PeersFailed(
                    f"rank {self.env.rank}: waiting for its peers failed at step {self.step + 1} "
                    f"({str(err).splitlines()[0][-160:]}); every rank that could wrote its hang "
                    f"dump: `depthscale trace hang --run {self.run_dir}` names the rank the "
                    f"others waited for ({self._timeout_name()})"
                ) from err
            raise
        finally:
            self.signals = None
            self.batches.close()

    def _lost_peer(self, err: BaseException) -> str:
        """The peer this rank lost, in one line: under plain torchrun every surviving rank
        prints its own (gloo's error says only an address and a paragraph of advice). Its hang
        dump is still written, silently, for `depthscale trace hang`."""
        self.telemetry.on_error(err, say=False)
        recorder = self.telemetry.recorder
        in_flight = recorder.in_flight() if recorder is not None else []
        line = describe_lost_peer(err, self.env.rank, self.step + 1, in_flight, self.run_dir)
        return f"{line} (`depthscale trace hang --run {self.run_dir}`: every rank's view)"

    def _timeout_name(self) -> str:
        """The process-group timeouts in force: until the first step completes, the world group
        and the store still have the start-up one."""
        p = self.cfg.parallel
        name = f"parallel.timeout_s={p.timeout_s:g}"
        if not self.timeout_shortened:
            name += f"; world group: parallel.setup_timeout_s={p.setup_timeout_s:g}"
        return name

    def _fit(self, stop_at: int | None) -> list[dict[str, float]]:
        cfg = self.cfg
        history: list[dict[str, float]] = []
        if self.step >= cfg.train.steps:
            console.say(
                f"{self.run_dir}: already trained to step {self.step} (train.steps={cfg.train.steps}); nothing to do"
            )
            return history
        total = self.plan.num_params()
        idle = ModelShape.from_config(cfg.model).idle_params()
        active = f" ({(total - idle) / 1e6:.2f}M active)" if idle else ""
        console.say(
            f"depthscale: {total / 1e6:.2f}M parameters{active}, residual={cfg.model.residual}, "
            f"device={self.device}, dtype={cfg.train.dtype}, run_dir={self.run_dir}"
            + (f", resumed at step {self.step}" if self.step else "")
        )
        bar = console.progress(cfg, self.step)
        saved_at = None
        with console.metrics_logger(self.run_dir, cfg, self.env.is_main, self.step) as logger:
            self.throughput.reset()
            while self.step < cfg.train.steps:
                if stop_at is not None and self.step >= stop_at:
                    self.checkpointer.wait()
                    self._read_metrics()
                    self.vote.close()
                    return history
                t0 = time.perf_counter()
                try:
                    metrics = self._train_step()
                except PersistentNonFinite as bad:
                    self.telemetry.abandon_step()
                    self.pending.resolve()  # the steps before it, numbered before rolling back
                    self._roll_back(bad)
                    logger.supersede(self.step)  # the steps after it are trained again
                    continue
                if not history:  # which AttnRes kernels the first step ran, once
                    _print_kernel_paths()
                    startup.mark("first_step")
                    startup.save(self.run_dir, self.env.rank)  # RUN/startup/: where start-up went
                    shorten_timeout(cfg.parallel.timeout_s)  # from setup_timeout_s
                    self.timeout_shortened = True
                seconds = time.perf_counter() - t0
                self.pending.add(metrics)
                self.throughput.update(self.tokens_per_step, seconds)
                metrics |= self.throughput.rate()
                if (note := self.throughput.take_note()) is not None:  # a raised MFU peak
                    console.write(bar, f"depthscale: {note}")
                if self.heartbeat is not None:
                    self.heartbeat.update(
                        seconds,
                        step=self.step,
                        tokens_per_s=metrics["tokens_per_s"],
                        slow_ranks=self.telemetry.slow_ranks(),
                    )
                # busy rows arrive one step late (HostVote): they are the previous step's
                for kind, text, fields in self.telemetry.end_step(
                    self.step, self.busy_rows, metrics.get("mfu"), rows_step=self.step - 1
                ):
                    console.write(bar, f"depthscale: {text}")
                    logger.event(self.step, kind, fields)
                for kind, fields in self.checkpointer.events():  # blocking time, failed saves
                    logger.event(self.step, kind, fields)
                    if kind == "checkpoint" and self.heartbeat is not None:
                        # progress for the supervisor once on disk, not once staged in memory
                        self.heartbeat.update(checkpoint_step=fields["step"])
                history.append(metrics)
                log_now = self.step % cfg.logging.log_every == 0 or self.step == cfg.train.steps
                if log_now or self.stop_agreed:  # the only steps that read device numbers
                    self._read_metrics()
                    if self.heartbeat is not None:
                        self.heartbeat.update(loss=metrics["loss"])
                    if bar is not None:
                        bar.set_postfix(
                            loss=f"{metrics['loss']:.3f}", tok_s=f"{metrics['tokens_per_s']:.0f}"
                        )
                if log_now:
                    metrics |= mixture_metrics(self.batches.state_dict(), cfg.data.seq_len)
                    logger.log(self.step, metrics)
                    console.write(bar, console.format_step(self.step, cfg.train.steps, metrics))
                if self.stop_agreed:
                    self.vote.close()
                    self._stop_on_signal(saved_at, bar)
                    return history
                if cfg.train.eval_every and (
                    self.step % cfg.train.eval_every == 0 or self.step == cfg.train.steps
                ):
                    with spans.span("eval"):
                        results = self.evaluator.run(self.model, self.forward, self.autocast)
                    for prefix, values in results.items():
                        logger.log(self.step, values, prefix=prefix)
                    if results:
                        console.write(bar, console.format_eval(self.step, results))
                if (
                    cfg.checkpoint.every
                    and self.step % cfg.checkpoint.every == 0
                    and self.step != cfg.train.steps
                ):
                    self.save_checkpoint()
                    saved_at = self.step
                self.snapshots.after_step(self, logger.event)
                if bar is not None:
                    bar.update(1)
            self.vote.close()
            if self.heartbeat is not None:
                self.heartbeat.update(state="finishing")
            self.save_checkpoint(last=True)
            self.checkpointer.wait(final=True)
        if bar is not None:
            bar.close()
        console.say(
            f"done: step {self.step}, loss {history[-1]['loss']:.4f}, checkpoint in "
            f"{self.checkpointer.latest()}"
        )
        return history

    def _stop_on_signal(self, saved_at: int | None, bar) -> None:
        """Every rank agreed to stop after this step: save (unless this step just was), then say
        where the run resumes."""
        if bar is not None:
            bar.close()
        received = self.signals.received if self.signals else None
        name = received.name if received is not None else "a signal on another rank"
        if self.cfg.checkpoint.on_signal and saved_at != self.step:
            self.save_checkpoint(last=True)
        self.checkpointer.wait(final=True)
        latest = self.checkpointer.latest()
        where = (
            f"checkpoint {latest}; run the same command to resume"
            if latest is not None
            else "no checkpoint saved (checkpoint.on_signal=false)"
        )
        console.say(f"depthscale: stopped by {name} after step {self.step}; {where}")
        self.stopped_by = received or signal.SIGTERM


def _peers_failed(err: BaseException) -> bool:
    """A collective or message that timed out or lost its peer (gloo and NCCL word it so)."""
    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    text = str(err)
    return any(s in text for s in ("Timed out", "timed out", "Connection closed by peer",
                                   "Connection reset by peer"))  # fmt: skip


def _print_kernel_paths() -> None:
    """One line naming the AttnRes read paths this rank took (fused Triton / CPU kernels, or the
    PyTorch fallback with its reason): a silent fallback is how a slow bf16 run goes unnoticed."""
    paths = kernel_paths(reasons=True)
    if paths:
        console.say("AttnRes kernels: " + ", ".join(f"{k}={v}" for k, v in sorted(paths.items())))
