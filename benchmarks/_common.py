"""Shared helpers for benchmark scripts: device description and interleaved timing."""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable

import torch


def device_info() -> dict:
    if torch.cuda.is_available():
        return {
            "device": torch.cuda.get_device_name(),
            "cuda": torch.version.cuda,
            "torch": torch.__version__,
        }
    return {
        "device": f"cpu ({platform.processor() or platform.machine()})",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def interleaved_times(
    fns: dict[str, Callable[[], None]], rounds: int, warmup: int = 2
) -> dict[str, float]:
    """Median seconds per call of each fn, measured in alternating rounds so drift hits all equally."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(s) for name, s in samples.items()}
