"""What the training loop prints and logs: rank 0's console lines, progress bar and metrics files."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from depthscale.config import Config
from depthscale.observe.metrics_log import MetricsLogger


def metrics_logger(run_dir: Path, cfg: Config, is_main: bool, start_step: int):
    """Rank 0 writes metrics, superseding those of steps after `start_step` (the run trains them
    again); the others get a logger that drops them."""
    if is_main:
        wandb = cfg if cfg.logging.wandb else None
        return MetricsLogger(run_dir, cfg.logging.tensorboard, start_step, wandb)
    return contextlib.nullcontext(_NullLogger())


class _NullLogger:
    def log(self, *args: Any, **kwargs: Any) -> None:
        pass

    def event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def supersede(self, step: int) -> None:
        pass


def is_main() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def say(msg: str) -> None:
    """Print on rank 0 only."""
    if is_main():
        print(msg, flush=True)


def progress(cfg: Config, start: int):
    if not (cfg.logging.progress and is_main()):
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


def write(bar, line: str) -> None:
    if bar is not None:
        bar.write(line)
    else:
        say(line)


def format_eval(step: int, results: dict[str, dict[str, float]]) -> str:
    """One line of evaluation results: step 50 | val loss 2.3104 | eval/arc acc 0.3125 ..."""
    parts = [f"step {step:>6}"]
    for prefix, values in results.items():
        parts.append(f"{prefix} " + " ".join(f"{k} {v:.4f}" for k, v in values.items()))
    return " | ".join(parts)


def format_step(step: int, total: int, m: dict[str, float]) -> str:
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


def announce(cfg: Config, total: int, active: int, device, run_dir: Path, step: int) -> None:
    """The run's one-line header: parameters (active ones under MoE), residual, device."""
    shown = f" ({active / 1e6:.2f}M active)" if active != total else ""
    say(
        f"depthscale: {total / 1e6:.2f}M parameters{shown}, residual={cfg.model.residual}, "
        f"device={device}, dtype={cfg.train.dtype}, run_dir={run_dir}"
        + (f", resumed at step {step}" if step else "")
    )
