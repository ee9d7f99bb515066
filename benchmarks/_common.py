"""Shared helpers for benchmark scripts: device description, interleaved timing, saved-activation bytes."""

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


def saved_activation_bytes(fn: Callable[[], torch.Tensor], params: list[torch.Tensor]) -> int:
    """Bytes of distinct non-parameter storages autograd saves for backward during fn(): the
    activation memory that peaks at the end of the forward pass. Works on CPU, where there is no
    allocator statistic."""
    exclude = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in exclude:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())
