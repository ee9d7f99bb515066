"""What every stage shares: the JSON-lines writer, measurements that fail alone, and timers.

A stage calls `ctx.measure(name, fn)` once per measurement: `fn()` returns a dict of values and the
line is written at once (`status` ok); `Skipped` / `OutOfBounds` raised by `fn` write a skipped or
failed line (an out-of-bounds result keeps its values); any other exception — an API that moved
under another change, a CUDA error — writes a failed line with the exception in one line, and the
stage goes on to its next measurement. Nothing is buffered: a stage killed by its timeout keeps
every line it wrote.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
LLAMA_1B = REPO / "configs" / "llama-1b.toml"


class Skipped(Exception):  # noqa: N818 - an outcome, not an error
    """The measurement cannot run here (its reason is the line's error text)."""


class OutOfBounds(Exception):  # noqa: N818 - an outcome, not an error
    """The measurement ran, and a value is outside what a correct build gives: a failed line that
    keeps the values."""

    def __init__(self, message: str, values: dict[str, Any]) -> None:
        super().__init__(message)
        self.values = values


def plain(value: Any) -> Any:
    """`value` as JSON can hold it: tensors and numpy scalars as numbers, non-finite floats as
    strings ("nan", "inf"), dtypes, devices and paths as strings."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().tolist() if value.numel() != 1 else value.item()
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [plain(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return plain(value.item())
    return str(value)


def sig(x: float, digits: int = 4) -> float:
    """x rounded to `digits` significant digits (CPU dry-run rates are tiny, GPU ones large)."""
    return float(f"{x:.{digits}g}")


def one_line(err: BaseException, limit: int = 600) -> str:
    """An exception as one line: its type, its message's first line, and where it was raised."""
    lines = str(err).strip().splitlines()
    text = f"{type(err).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    frames = traceback.extract_tb(err.__traceback__)
    if frames:
        f = frames[-1]
        text += f" (at {Path(f.filename).name}:{f.lineno})"
    return text[:limit]


class Context:
    """One stage's view of the check: where its lines go, on which device it runs, how long it
    has left, and whether it is a dry run (CPU, tiny shapes)."""

    def __init__(
        self, stage: str, jsonl: Path, work: Path, dry_run: bool, timeout_s: float
    ) -> None:
        self.stage, self.jsonl, self.work, self.dry_run = stage, jsonl, work, dry_run
        self.deadline = time.monotonic() + timeout_s
        self.cuda = torch.cuda.is_available()
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.failed = False
        self.lines = 0

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def emit(
        self,
        name: str,
        values: dict[str, Any] | None = None,
        status: str = "ok",
        error: str | None = None,
    ) -> None:
        """Append one line to gpu_check.jsonl (opened, written and closed each time, so a crash
        right after loses nothing), and a short copy to stdout (the stage's log)."""
        line = {
            "stage": self.stage,
            "name": name,
            "status": status,
            "values": plain(values or {}),
            "error": error,
            "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        text = json.dumps(line, allow_nan=False)
        with open(self.jsonl, "a", encoding="utf-8") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.failed |= status in ("failed", "timeout")
        self.lines += 1
        print(f"[{self.stage}] {name}: {status}" + (f" ({error})" if error else ""), flush=True)

    def measure(self, name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        """Run one measurement and write its line; returns its values (None if it did not run)."""
        try:
            values = fn()
        except Skipped as s:
            self.emit(name, status="skipped", error=str(s))
            return None
        except OutOfBounds as o:
            self.emit(name, o.values, status="failed", error=str(o))
            return o.values
        except Exception as err:  # noqa: BLE001 - one failed measurement must not end the stage
            traceback.print_exc()
            self.emit(name, status="failed", error=one_line(err))
            return None
        self.emit(name, values)
        return values

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def time_ms(ctx: Context, fn: Callable[[], object], warmup: int = 3, reps: int = 10) -> float:
    """Median milliseconds of fn(): CUDA events around each call on a GPU (the device's time, not
    the host's), the host clock on CPU; after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    ctx.sync()
    times = []
    if ctx.cuda:
        pairs = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            pairs.append((start, end))
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) for s, e in pairs]
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def seconds_of(ctx: Context, fn: Callable[[], object]) -> tuple[float, Any]:
    """Wall seconds of one call of fn() (device synchronized before and after) and its result: a
    first call, with whatever it compiles."""
    ctx.sync()
    t0 = time.perf_counter()
    result = fn()
    ctx.sync()
    return time.perf_counter() - t0, result


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """‖got − want‖ / ‖want‖ in float64 (NaN anywhere gives NaN, which no bound passes)."""
    got, want = got.detach().double(), want.detach().double()
    return ((got - want).norm() / want.norm().clamp_min(1e-300)).item()


def max_abs(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.detach().double() - want.detach().double()).abs().max().item()


def goal(values: dict[str, Any], name: str, value: float | None, op: str, target: float) -> bool:
    """Judge one of the goals docs/gpu.md sets for a GPU run: `values["goals"][name]` becomes
    {"value", "goal": "<op> <target>", "met"}, and the summary line counts them. A missed goal is
    a finding, not a broken build: the measurement's line stays ok. `op` is ">=" or "<="; a
    missing or NaN value is missed."""
    if op not in (">=", "<="):
        raise ValueError(f"goal op {op!r}: allowed '>=' or '<='")
    met = value is not None and (value >= target if op == ">=" else value <= target)
    values.setdefault("goals", {})[name] = {"value": value, "goal": f"{op} {target:g}", "met": met}
    return met


def within(value: float, bound: float) -> bool:
    """value <= bound, False for NaN."""
    return value <= bound


def copy_gbps(ctx: Context, n_bytes: int) -> float:
    """Device-to-device copy bandwidth, bytes read plus bytes written per second / 1e9, on random
    data (METHOD: never time zeros) — the ceiling that memory-bound kernels are compared with."""
    x = torch.randn(n_bytes // 2, device=ctx.device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ms = time_ms(ctx, lambda: y.copy_(x), warmup=3, reps=10)
    return 2 * n_bytes / (ms * 1e-3) / 1e9


def profile_kernels(ctx: Context, fn: Callable[[], object], top: int = 8) -> dict[str, Any]:
    """The kernels fn() launches, from torch.profiler: on CUDA the GPU kernels (name, count, self
    device time), on CPU the aten ops (self CPU time); the most expensive `top` of them, the total
    launches, and the attention backends their names belong to
    (`attention_dispatch.kernel_family`, or a local rule where that is missing)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm: compiles and caches stay out of the profile
    ctx.sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    with profile(activities=activities) as prof:
        fn()
        ctx.sync()
    rows = []
    for e in prof.key_averages():
        if ctx.cuda:
            if getattr(e, "device_type", None) != DeviceType.CUDA:
                continue
            us = getattr(e, "self_device_time_total", None)
            if us is None:
                us = getattr(e, "self_cuda_time_total", 0.0)
        else:
            if not e.key.startswith("aten::"):
                continue
            us = e.self_cpu_time_total
        rows.append((e.key, int(e.count), float(us)))
    rows.sort(key=lambda r: -r[2])
    family = _kernel_family()
    families = sorted({family(name) for name, _, _ in rows} - {"other"}) or ["other (math)"]
    return {
        "backends": families,
        "launches": sum(c for _, c, _ in rows),
        "top_kernels": [
            {"name": name[:160], "count": c, "self_us": round(us, 1)} for name, c, us in rows[:top]
        ],
    }


def _kernel_family() -> Callable[[str], str]:
    try:
        from depthscale.model.attention_dispatch import kernel_family

        return kernel_family
    except ImportError:
        return _family


def _family(name: str) -> str:
    n = name.lower()
    for key, family in (
        ("cudnn", "cudnn"),
        ("flash", "flash"),
        ("fmha", "efficient"),
        ("efficient_attention", "efficient"),
        ("flex", "flex"),
        ("triton_tem", "flex"),
    ):
        if key in n:
            return family
    return "other"
