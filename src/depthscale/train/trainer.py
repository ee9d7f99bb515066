"""The training loop: build everything from one Config, then step, log, evaluate and checkpoint.

Kept apart from the model (`model/`) and from how a model is parallelized (`parallel/`), torchtitan
style: `Trainer.__init__` builds, `Trainer.train_step` does one optimizer step, `Trainer.fit` loops.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from depthscale.config import Config, ConfigError, to_toml
from depthscale.data.loader import DataBundle, build_data
from depthscale.data.prefetch import Prefetcher
from depthscale.errors import CheckpointError, TrainingError
from depthscale.model.attnres_ops import kernel_paths
from depthscale.model.transformer import Transformer
from depthscale.observe import spans
from depthscale.observe.metrics import MetricsLogger, Throughput, detect_peak_flops, flops_per_token
from depthscale.parallel.parallelize import init_layout, parallelize
from depthscale.train.checkpoint import Checkpointer, is_model_only
from depthscale.train.faults import maybe_inject_fault
from depthscale.train.host import keep_freed_host_memory
from depthscale.train.memory import OffloadStats, offload_activations
from depthscale.train.optim import build_optimizer
from depthscale.train.schedule import lr_at, set_lr
from depthscale.train.stop import StopSignals
from depthscale.train.telemetry import Telemetry

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "train.device='cuda' but no CUDA device is available; allowed here: 'auto', 'cpu'"
        )
    return torch.device(name)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.device = resolve_device(cfg.train.device)
        if cfg.train.keep_host_memory:
            keep_freed_host_memory()
        self.layout = init_layout(cfg, self.device)
        self.env, self.device = self.layout.env, self.layout.device
        self.dp_rank, self.dp_size = self.layout.dp_rank, self.layout.dp_size
        self.dtype = DTYPES[cfg.train.dtype]
        if cfg.train.deterministic:
            torch.use_deterministic_algorithms(True)
        seed_everything(cfg.train.seed)
        self.run_dir = cfg.run_path
        self.checkpointer = Checkpointer(self.run_dir / "checkpoints", cfg.checkpoint, cfg.model)
        # the newest checkpoint that verifies, of this model (see train/manifest.py)
        resume_from = self.checkpointer.resolve_resume()

        self.data: DataBundle = _build_data_once_per_node(cfg, self.env, self.dp_size)
        cfg.resolve_vocab_size(self.data.tokenizer.vocab_size)
        # Built on the meta device: parallelize() splits and shards it, then each rank materialises
        # and initialises only its own shards (the values one process would draw).
        with torch.device("meta"):
            self.model = Transformer(cfg.model)
        self.model.set_recompute(cfg.train.recompute)  # part of the layers: before sharding
        self.plan = parallelize(
            self.model, self.layout.mesh, self.layout.dims, cfg, device=self.device
        )
        self.offload = OffloadStats() if cfg.train.offload_activations else None
        # static shapes: train and eval batches differ, and dynamic-shape tracing of the custom AttnRes
        # autograd Functions is not reliable; a recompile per batch shape is cheap.
        self.forward = torch.compile(self.model, dynamic=False) if cfg.train.compile else self.model
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.step = 0
        self.tokens_seen = 0
        self.signals: StopSignals | None = None
        self.stop_agreed = False
        self.stopped_by: signal.Signals | None = None
        """The signal that ended `fit` early (agreed by all ranks), or None."""

        if resume_from is not None:
            _check_same_tokenizer(self.run_dir, self.data.tokenizer)
            self._restore(resume_from)
        # Written last, once everything above has been checked: a refused or failed start leaves an
        # existing run directory as it was, and creates none.
        if self.env.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.toml").write_text(to_toml(cfg))
            self.data.tokenizer.save(self.run_dir / "tokenizer")
        self.telemetry = Telemetry(cfg, self.run_dir, self.env, self.layout.dims, self.device)
        self.batches = Prefetcher(self.data.train, self.dp_rank, self.dp_size)

        self.tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
        peak, self.peak_source = _peak_flops(cfg, self.device, self.dtype)
        self.throughput = Throughput(
            flops_per_token(cfg.model, cfg.data.seq_len), peak, n_devices=self.env.world_size
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
            self.data.train.load_state_dict(state["data"])

    def save_checkpoint(self) -> Path:
        with spans.span("checkpoint", "checkpoint"):
            return self.checkpointer.save(
                self.step, self.model, self.optimizer, self.trainer_state()
            )

    # ------------------------------------------------------------------ steps

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def train_step(self) -> dict[str, float]:
        """One optimizer step over the global batch, in `grad_accum_steps` micro-batches."""
        cfg = self.cfg
        self.telemetry.begin_step(self.step + 1)
        maybe_inject_fault(self.env.rank, self.step + 1)
        lr = lr_at(self.step, cfg.optim, cfg.train.steps)
        set_lr(self.optimizer, lr)
        with spans.span("data", "data"):
            inputs, labels = self.batches.next_batch()
        total = self.plan.forward_backward(
            self.forward,
            inputs,
            labels,
            autocast=self.autocast,
            around_forward=self._offloading,
        )
        self.plan.reduce_gradients()
        grad_norm = float(self.plan.clip_gradients(cfg.train.grad_clip))
        with spans.span("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens_seen += self.tokens_per_step
        loss, self.stop_agreed, self.busy_rows = self._mean_and_stop(
            total, self.telemetry.busy_row()
        )
        metrics = {"loss": loss, "lr": lr, "grad_norm": grad_norm}
        if self.offload is not None:  # this rank's bytes moved to host memory during the step
            metrics["offloaded_mb"] = self.offload.bytes / 1e6
            self.offload.reset()
        return metrics

    def _offloading(self) -> contextlib.AbstractContextManager:
        if self.offload is None:
            return contextlib.nullcontext()
        return offload_activations(self.offload)

    def _mean_over_ranks(self, value: Tensor) -> float:
        return self._mean_and_stop(value)[0]

    def _mean_and_stop(
        self, value: Tensor, busy: list[float] | None = None
    ) -> tuple[float, bool, list[list[float]] | None]:
        """(global mean loss, whether any rank received a stop signal, every rank's `busy` row),
        in one reduction.

        `value` is this rank's share of the loss (`ParallelPlan.forward_backward`): the global mean
        is the mean over all ranks. The stop flag rides along so that every rank stops after the
        same step, and so do the ranks' busy times per phase (each rank fills its own row of a
        world × phases block), which the straggler detector compares."""
        stop = self.signals is not None and self.signals.received is not None
        world, rank = self.env.world_size, self.env.rank
        if world == 1:
            return value.item(), stop, [busy] if busy is not None else None
        width = len(busy) if busy is not None else 0
        packed = value.new_zeros(2 + world * width, dtype=torch.float64)
        packed[0], packed[1] = value.detach().double(), float(stop)
        if busy is not None:
            packed[2 + rank * width : 2 + (rank + 1) * width] = torch.tensor(busy)
        with spans.collective("all_reduce", None, packed):
            dist.all_reduce(packed)
        values = packed.tolist()
        rows = (
            [values[2 + r * width : 2 + (r + 1) * width] for r in range(world)] if width else None
        )
        return values[0] / world, values[1] > 0, rows

    @torch.no_grad()
    def evaluate(self) -> float | None:
        if self.data.val is None:
            return None
        self.model.eval()
        batches = self.data.val.iter_eval(self.cfg.train.eval_batches, self.dp_rank, self.dp_size)
        losses = [
            self._mean_over_ranks(self.plan.evaluate(self.forward, x, y, self.autocast))
            for x, y in batches
        ]
        self.model.train()
        return sum(losses) / len(losses) if losses else None

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
        except Exception as err:  # every rank says where it was: the hang analysis reads it
            self.telemetry.on_error(err)
            if _peers_failed(err):
                raise TrainingError(
                    f"rank {self.env.rank}: waiting for its peers failed at step {self.step + 1} "
                    f"({str(err).splitlines()[0][-160:]}); every rank that could wrote its hang "
                    f"dump: `depthscale trace hang --run {self.run_dir}` names the rank the "
                    f"others waited for (parallel.timeout_s={self.cfg.parallel.timeout_s:g})"
                ) from err
            raise
        finally:
            self.signals = None
            self.batches.close()

    def _fit(self, stop_at: int | None) -> list[dict[str, float]]:
        cfg = self.cfg
        history: list[dict[str, float]] = []
        if self.step >= cfg.train.steps:
            _print(
                f"{self.run_dir}: already trained to step {self.step} (train.steps={cfg.train.steps}); nothing to do"
            )
            return history
        _print(
            f"depthscale: {self.plan.num_params() / 1e6:.2f}M parameters, residual={cfg.model.residual}, "
            f"device={self.device}, dtype={cfg.train.dtype}, run_dir={self.run_dir}"
            + (f", resumed at step {self.step}" if self.step else "")
        )
        bar = _progress(cfg, self.step)
        saved_at = None
        with _metrics_logger(self.run_dir, cfg, self.env.is_main) as logger:
            self.throughput.reset()
            while self.step < cfg.train.steps:
                if stop_at is not None and self.step >= stop_at:
                    self.checkpointer.wait()
                    return history
                t0 = time.perf_counter()
                metrics = self.train_step()
                if not history:  # which AttnRes kernels the first step ran, once
                    _print_kernel_paths()
                self.throughput.update(self.tokens_per_step, time.perf_counter() - t0)
                metrics |= self.throughput.rate()
                for kind, text, fields in self.telemetry.end_step(
                    self.step, self.busy_rows, metrics.get("mfu")
                ):
                    _write(bar, f"depthscale: {text}")
                    logger.event(self.step, kind, fields)
                for kind, fields in self.checkpointer.events():  # blocking time, failed saves
                    logger.event(self.step, kind, fields)
                history.append(metrics)
                if not math.isfinite(metrics["loss"]):
                    self._stop_on_non_finite(metrics, bar)
                if self.step % cfg.logging.log_every == 0 or self.step == cfg.train.steps:
                    logger.log(self.step, metrics)
                    _write(bar, _format(self.step, cfg.train.steps, metrics))
                if self.stop_agreed:
                    self._stop_on_signal(saved_at, bar)
                    return history
                if cfg.train.eval_every and (
                    self.step % cfg.train.eval_every == 0 or self.step == cfg.train.steps
                ):
                    with spans.span("eval"):
                        val = self.evaluate()
                    if val is not None:
                        logger.log(self.step, {"loss": val}, prefix="val")
                        _write(bar, f"step {self.step:>6} | val loss {val:.4f}")
                if (
                    cfg.checkpoint.every
                    and self.step % cfg.checkpoint.every == 0
                    and self.step != cfg.train.steps
                ):
                    self.save_checkpoint()
                    saved_at = self.step
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(
                        loss=f"{metrics['loss']:.3f}", tok_s=f"{metrics['tokens_per_s']:.0f}"
                    )
            self.save_checkpoint()
            self.checkpointer.wait(final=True)
        if bar is not None:
            bar.close()
        _print(
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
            self.save_checkpoint()
        self.checkpointer.wait(final=True)
        latest = self.checkpointer.latest()
        where = (
            f"checkpoint {latest}; run the same command to resume"
            if latest is not None
            else "no checkpoint saved (checkpoint.on_signal=false)"
        )
        _print(f"depthscale: stopped by {name} after step {self.step}; {where}")
        self.stopped_by = received or signal.SIGTERM

    def _stop_on_non_finite(self, metrics: dict[str, float], bar) -> None:
        """A NaN/Inf loss: stop before anything is saved from this step, keeping the last
        checkpoint as it was."""
        if bar is not None:
            bar.close()
        self.checkpointer.wait()
        latest = self.checkpointer.latest()
        raise TrainingError(
            f"the loss is {metrics['loss']} at step {self.step} (lr {metrics['lr']:.3g}); "
            "nothing was saved from this step"
            + (f"; the newest checkpoint is {latest}" if latest is not None else "")
            + ". Lower optim.lr, raise optim.warmup_steps or keep train.grad_clip > 0"
        )


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
        _print("AttnRes kernels: " + ", ".join(f"{k}={v}" for k, v in sorted(paths.items())))


def _build_data_once_per_node(cfg: Config, env, dp_size: int) -> DataBundle:
    """Local rank 0 tokenizes (or trains the BPE tokenizer) and fills the cache; the node's other
    ranks then load it instead of repeating the work. The token stream is memory-mapped, so one copy
    in the page cache serves every rank on the node."""
    build = lambda: build_data(cfg.data, cfg.train.seed, cfg.train.batch_size, ranks=dp_size)  # noqa: E731
    if env.world_size == 1:
        return build()
    data = build() if env.local_rank == 0 else None
    dist.barrier()
    return data if data is not None else build()


def _metrics_logger(run_dir: Path, cfg: Config, is_main: bool):
    """Rank 0 writes metrics; the others get a logger that drops them."""
    if is_main:
        return MetricsLogger(run_dir, cfg.logging.tensorboard)
    return contextlib.nullcontext(_NullLogger())


class _NullLogger:
    def log(self, *args: Any, **kwargs: Any) -> None:
        pass

    def event(self, *args: Any, **kwargs: Any) -> None:
        pass


def _check_same_tokenizer(run_dir: Path, tokenizer) -> None:
    """The checkpoints were trained on the run's saved tokenizer; another one would decode garbage."""
    from depthscale.data.tokenizer import load_tokenizer

    saved_dir = run_dir / "tokenizer"
    if not saved_dir.is_dir():
        return
    saved = load_tokenizer(saved_dir)
    if saved.fingerprint != tokenizer.fingerprint:
        raise CheckpointError(
            f"cannot resume {run_dir}: its checkpoints were trained with the tokenizer in "
            f"{saved_dir} ({saved.name}), but data.tokenizer gives another one ({tokenizer.name}); "
            "allowed: the run's own tokenizer (or start a new run with a new --train.name)"
        )


def _peak_flops(cfg: Config, device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    if cfg.logging.peak_tflops > 0:
        return cfg.logging.peak_tflops * 1e12, "logging.peak_tflops"
    return detect_peak_flops(device, dtype)


def _is_main() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _print(msg: str) -> None:
    if _is_main():
        print(msg, flush=True)


def _progress(cfg: Config, start: int):
    if not (cfg.logging.progress and _is_main()):
        return None
    from tqdm import tqdm

    return tqdm(
        total=cfg.train.steps,
        initial=start,
        desc="train",
        unit="step",
        dynamic_ncols=True,
        mininterval=1.0,
        leave=False,
    )


def _write(bar, line: str) -> None:
    if bar is not None:
        bar.write(line)
    else:
        _print(line)


def _format(step: int, total: int, m: dict[str, float]) -> str:
    parts = [
        f"step {step:>6}/{total}",
        f"loss {m['loss']:.4f}",
        f"lr {m['lr']:.2e}",
        f"grad_norm {m['grad_norm']:.3f}",
        f"tok/s {m['tokens_per_s']:,.0f}",
    ]
    if m.get("mfu") is not None:
        parts.append(f"mfu {100 * m['mfu']:.1f}%")
    return " | ".join(parts)
