"""Training metrics: model FLOPs per token, peak FLOP/s, throughput and MFU (the log they go to is
metrics_log.py).

MFU = achieved model FLOP/s / peak FLOP/s, where model FLOPs count only what the model needs
(no recomputation), so MFU is comparable across activation-checkpointing and kernel choices; HFU
counts what recomputation runs again too. Both count FLOPs as `depthscale plan` does
(`shape/model.py` states the convention: the whole causal score matrix, as Megatron, PaLM and
torchtitan count it), so a logged MFU and a predicted one are the same quantity. It is
never above 100 %: a rate above the peak proves the peak too low, and `Throughput` raises it.
"""

from __future__ import annotations

import functools
import math
import time
from collections import deque
from collections.abc import Callable

import torch

from depthscale.config import ModelConfig
from depthscale.shape import ModelShape

__all__ = ["Throughput", "detect_peak_flops", "flops_per_token"]


# --------------------------------------------------------------------------------------------
# Model FLOPs


def flops_per_token(cfg: ModelConfig, seq_len: int, recompute: str = "none") -> float:
    """Training (forward + backward) FLOPs per token of sequences of `seq_len` tokens, the count
    `depthscale plan` predicts with (`shape.ModelShape.model_flops_per_token`; the convention,
    full causal score matrix included, is stated in `shape/model.py`). With `recompute`, what
    activation checkpointing runs again is added: HFU's numerator instead of MFU's."""
    if cfg.vocab_size <= 0:
        raise ValueError("flops_per_token: model.vocab_size must be resolved (> 0) first")
    if seq_len <= 0:
        raise ValueError(f"flops_per_token: seq_len={seq_len} must be > 0")
    return ModelShape.from_config(cfg).hardware_flops_per_token(seq_len, recompute)


# --------------------------------------------------------------------------------------------
# Peak FLOP/s

# Dense (no sparsity) spec-sheet peaks: (bf16/fp16 tensor core, tf32 tensor core, fp32 non-tensor).
# Order matters: the first substring found in the device name wins.
_GPU_PEAKS: list[tuple[str, tuple[float, float, float]]] = [
    ("H200", (989e12, 494.5e12, 67e12)),
    ("H100 PCIe", (756e12, 378e12, 51e12)),
    ("H100", (989e12, 494.5e12, 67e12)),  # SXM; also H100 80GB HBM3
    ("A100", (312e12, 156e12, 19.5e12)),
]


def _tf32_enabled() -> bool:
    return (
        torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
    )


def detect_peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """Peak dense FLOP/s of one device for matmuls in `dtype`, and where the number came from.

    Known CUDA GPUs (H200, H100 SXM/PCIe, A100) use the spec sheet: bf16/fp16 tensor-core peak, and
    for fp32 the TF32 tensor-core peak only when TF32 matmuls are enabled, else the plain fp32
    peak. Anything else is measured, so MFU there means "fraction of the best matmul rate this
    machine has shown": on a CPU, `_cpu_peak` (one core's best rate times the threads, the
    number a spec sheet would give, and one that other processes on the machine barely move); on
    an unknown GPU, `_measure_matmul_flops`. A measurement is a lower bound, so `Throughput`
    raises it to any rate the training steps achieve, and says so.
    """
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, (half, tf32, fp32) in _GPU_PEAKS:
            if key in name:
                if dtype in (torch.bfloat16, torch.float16):
                    return half, f"{name} spec sheet, dense {dtype}"
                if dtype == torch.float32:
                    if _tf32_enabled():
                        return tf32, f"{name} spec sheet, dense tf32"
                    return fp32, f"{name} spec sheet, fp32 (non-tensor-core)"
    if device.type == "cpu":
        return _cpu_peak(dtype, torch.get_num_threads())
    return _measure_matmul_flops(str(device), dtype)


MEASURED = "measured matmul peak"
"""How a measured peak's source begins: a lower bound, which `Throughput` raises with a note."""


def _cpu_peak(dtype: torch.dtype, threads: int) -> tuple[float, str]:
    """The CPU's peak for a run in `dtype` on `threads` intra-op threads: one core's best matmul
    rate (`_core_rate`) times the threads.

    One core, not all of them at once: a multi-threaded matmul on a shared machine waits at every
    barrier for its slowest thread, so its timing swung 50x with the load of other processes (two
    runs of the same throughput read 33 % and 51 % MFU), while one core's best trial is that
    core's rate whenever the core was free for a few milliseconds. Perfect scaling over the
    threads is what a peak means.

    Below fp32 (bf16, fp16), the peak is the better of the dtype's own rate and fp32's: a CPU
    without bf16 matmul units runs bf16 matmuls an order of magnitude slower than fp32 ones, while
    the kernels training uses convert and accumulate in fp32 at nearly fp32's rate, so the bf16
    rate alone was far below what a step achieved and every bf16 run printed a capped 100 %.
    """
    rate, n = _core_rate(dtype)
    text = f"{n}x{n} on one core x {threads} threads"
    if dtype != torch.float32:
        fp32, n32 = _core_rate(torch.float32)
        if fp32 > rate:
            return fp32 * threads, (
                f"{MEASURED} (cpu, {dtype} matmuls at {_rate_text(rate * threads)} here, slower "
                f"than float32's: float32's {n32}x{n32} on one core x {threads} threads)"
            )
    return rate * threads, f"{MEASURED} (cpu, {dtype}, {text})"


@functools.cache
def _core_rate(dtype: torch.dtype, budget_s: float = 0.4, trials: int = 5) -> tuple[float, int]:
    """One CPU core's best rate of n×n matmuls in `dtype` (`_best_rate`), and n: the first of
    128, 256, 512, 1024 whose matmul takes at least 5 ms (long enough that timer noise does not
    count; a slow dtype stays small, so its measurement stays within the budget). Cached per
    process: the number is a property of the machine, and measuring again costs every Trainer
    time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = 128
        while True:
            a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
            t0 = time.perf_counter()
            a @ b
            if time.perf_counter() - t0 >= 5e-3 or n >= 1024:
                break
            n *= 2
        return _best_rate(lambda: a @ b, 2 * n**3, trials, budget_s), n
    finally:
        torch.set_num_threads(threads)


@functools.cache
def _measure_matmul_flops(
    device: str, dtype: torch.dtype, budget_s: float = 0.5, trials: int = 5
) -> tuple[float, str]:
    """The best rate of 4096×4096 matmuls on a GPU no spec sheet here knows (`_best_rate`).
    Cached per device/dtype."""
    dev = torch.device(device)
    n = 4096
    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)

    def matmul() -> None:
        a @ b
        torch.cuda.synchronize(dev)

    rate = _best_rate(matmul, 2 * n**3, trials, budget_s)
    return rate, f"{MEASURED} ({dev.type}, {dtype}, {n}x{n})"


def _best_rate(
    run: Callable[[], None],
    flops: float,
    trials: int,
    budget_s: float,
    clock: Callable[[], float] = time.perf_counter,
    warmup_s: float = 0.1,
) -> float:
    """flops / the fastest of at least `trials` timed calls of `run` (more while within
    `budget_s`), after untimed warm-up calls for `warmup_s` (at least one: allocation, kernel
    selection, thread wake-up, the clock speed ramping up). The fastest, not the mean: load from
    other processes only slows a trial, never speeds it up."""
    start = clock()
    run()
    while clock() - start < warmup_s:
        run()
    best, count, start = math.inf, 0, clock()
    while count < trials or clock() - start < budget_s:
        t0 = clock()
        run()
        best, count = min(best, clock() - t0), count + 1
    return flops / best if best > 0 else math.inf


def _rate_text(flops: float) -> str:
    """A FLOP/s figure in the unit that reads best: a CPU's GFLOP/s, a GPU's TFLOP/s."""
    return f"{flops / 1e12:.3g} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:.3g} GFLOP/s"


# --------------------------------------------------------------------------------------------
# Throughput


class Throughput:
    """Tokens/s, achieved TFLOP/s per device and MFU over a sliding window of recent steps.

    A window (not the run average) so the numbers track the current speed and the first steps
    (compilation, allocator warmup) stop counting after `window` steps. `tokens` passed to `update`
    are all tokens of the step across `n_devices` devices; the rate is per device for TFLOP/s and MFU.

    A window that achieves more than `peak_flops` raises the peak to its rate, so MFU never reads
    above 100 % (a CPU peak measured while the machine was busy read 2098 %): the achieved rate is
    itself a lower bound on the peak. Never silently: the first raise leaves a note for the
    console (`take_note`), a warning for a spec-sheet or configured peak (that peak, or the FLOP
    count, is wrong), so a capped 100 % is never read as a measurement.
    """

    def __init__(
        self,
        flops_per_token: float,
        peak_flops: float,
        window: int = 20,
        n_devices: int = 1,
        peak_source: str = "",
        hardware_flops_per_token: float | None = None,
    ) -> None:
        """`hardware_flops_per_token`: what the hardware runs per token, recomputation included
        (HFU's numerator; default: the model's, no recomputation)."""
        if window < 1 or n_devices < 1:
            raise ValueError(f"Throughput: window={window} and n_devices={n_devices} must be >= 1")
        self.flops_per_token = flops_per_token
        self.hardware_flops_per_token = hardware_flops_per_token or flops_per_token
        self.peak_flops = peak_flops
        self.peak_source = peak_source
        self.n_devices = n_devices
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._last = time.perf_counter()
        self._raised = False
        self._note: str | None = None

    def reset(self) -> None:
        """Forget the window and restart the clock (e.g. after evaluation or checkpointing)."""
        self._samples.clear()
        self._last = time.perf_counter()

    def update(self, tokens: int, seconds: float | None = None) -> None:
        """Record one step of `tokens` tokens that took `seconds` (default: time since last call)."""
        now = time.perf_counter()
        if seconds is None:
            seconds = now - self._last
        self._last = now
        self._samples.append((tokens, seconds))

    def rate(self) -> dict[str, float | None]:
        """{tokens_per_s, tflops, mfu, hfu} over the window (tflops: model FLOPs per device);
        mfu and hfu are None when the peak is unknown (<= 0), and hfu (what the hardware ran,
        recomputation included) is at most 1: the peak is raised by it."""
        tokens = sum(t for t, _ in self._samples)
        seconds = sum(s for _, s in self._samples)
        tokens_per_s = tokens / seconds if seconds > 0 else 0.0
        flops = tokens_per_s * self.flops_per_token / self.n_devices
        hardware = tokens_per_s * self.hardware_flops_per_token / self.n_devices
        out = {"tokens_per_s": tokens_per_s, "tflops": flops / 1e12, "mfu": None, "hfu": None}
        if self.peak_flops <= 0:
            return out
        if hardware > self.peak_flops:
            self._raise_peak(hardware)
        return out | {"mfu": flops / self.peak_flops, "hfu": hardware / self.peak_flops}

    def _raise_peak(self, flops: float) -> None:
        if not self._raised:
            kind = "note" if self.peak_source.startswith(MEASURED) else "warning"
            self._note = (
                f"{kind}: achieved {_rate_text(flops)} per device, above the peak "
                f"{_rate_text(self.peak_flops)} ({self.peak_source or 'given'}): MFU is reported "
                "against the best rate achieved from here on"
            )
            self._raised = True
        self.peak_flops = flops

    def take_note(self) -> str | None:
        """The note of the first raise of the peak, once (then None)."""
        note, self._note = self._note, None
        return note
