"""Fused kernels. Importing this package never imports triton nor builds anything: CPU-only installs
and machines without a compiler work unchanged.

The AttnRes ops in `model/attnres_ops.py` use `attnres_triton` for CUDA inputs when triton
imports, and `attnres_cpu` (C++, built on first use) for CPU inputs when it builds.
`use_triton` / `use_cpu_kernels` override those choices: to test the Triton kernels on CPU under
`TRITON_INTERPRET=1`, or to compare either with the PyTorch ops. DEPTHSCALE_CPU_KERNELS=0 turns
the CPU kernels off for a whole process. `model.attnres_ops.kernel_paths()` says which path ran
(and why the PyTorch ops did, where they did). `strict(True)` / `with strict():` (or
DEPTHSCALE_STRICT_KERNELS=1) makes a read that misses an available kernel raise instead of falling
back (`model/kernel_dispatch.py` says which fallbacks count as missed).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any


def strict_from_env() -> bool:
    """DEPTHSCALE_STRICT_KERNELS as a flag: unset, "", 0, false, no, off → False; else True."""
    value = os.environ.get("DEPTHSCALE_STRICT_KERNELS", "").strip().lower()
    return value not in ("", "0", "false", "no", "off")


_override: bool | None = None
_cpu_override: bool | None = None
_strict: bool = strict_from_env()


class strict:  # lower case: used like a function, as torch.set_grad_enabled is
    """Strict kernel dispatch, True: an AttnRes read that misses an available fused kernel (mixed
    dtypes, a failed build, triton missing for CUDA tensors, ...) raises `KernelFallbackError`
    instead of running the PyTorch ops; False: it falls back (and logs a warning once). Reads
    without a fused kernel (float64, torch.compile tracing, DTensors, `use_triton(False)` /
    `use_cpu_kernels(False)`) fall back either way; see `model/kernel_dispatch.py`.

    A setter and a context manager, like `torch.set_grad_enabled`: `kernels.strict(True)` sets it
    for the process; `with kernels.strict():` (or `strict(False)`) sets it for the block and
    restores the previous setting on leaving it. The default is DEPTHSCALE_STRICT_KERNELS (1 / 0,
    read at import; the test suite sets 1)."""

    def __init__(self, enabled: bool = True) -> None:
        global _strict
        self.previous, _strict = _strict, bool(enabled)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        global _strict
        _strict = self.previous


def strict_mode() -> bool:
    """Whether a missed fused kernel raises here (`strict`)."""
    return _strict


@contextmanager
def use_triton(enabled: bool | None) -> Iterator[None]:
    """Within the block, True: the AttnRes ops run the Triton kernels on any device (on CPU only
    under TRITON_INTERPRET=1; float64 still runs in PyTorch); False: they run the PyTorch ops even
    on CUDA; None: the default (Triton for CUDA inputs when triton imports)."""
    global _override
    previous, _override = _override, enabled
    try:
        yield
    finally:
        _override = previous


def triton_override() -> bool | None:
    """The choice made by the innermost `use_triton` block, or None outside one."""
    return _override


def load_attnres_triton() -> ModuleType | None:
    """The `attnres_triton` module, or None when triton is not installed (an ImportError under
    `use_triton(True)`, so that a forced run never silently tests PyTorch against itself)."""
    try:
        from depthscale.kernels import attnres_triton
    except ImportError:
        if _override:
            raise
        return None
    return attnres_triton


@contextmanager
def use_cpu_kernels(enabled: bool | None) -> Iterator[None]:
    """Within the block, True: the AttnRes ops run the C++ CPU kernels for CPU inputs (float64 and
    mixed dtypes still run in PyTorch) and a failed build raises; False: they run the PyTorch ops;
    None: the default (the kernels when they build, unless DEPTHSCALE_CPU_KERNELS=0)."""
    global _cpu_override
    previous, _cpu_override = _cpu_override, enabled
    try:
        yield
    finally:
        _cpu_override = previous


def cpu_kernels_override() -> bool | None:
    """The choice made by the innermost `use_cpu_kernels` block, or None outside one."""
    return _cpu_override


def load_attnres_cpu() -> Any:
    """The CPU kernels' op namespace (`torch.ops.depthscale_attnres`), built on first use, or None
    when disabled or unbuildable (logged once). Under `use_cpu_kernels(True)` unavailability raises
    RuntimeError, so that a forced run never silently tests PyTorch against itself."""
    from depthscale.kernels import attnres_cpu

    if _cpu_override and not attnres_cpu.enabled_by_env():
        raise RuntimeError("use_cpu_kernels(True) under DEPTHSCALE_CPU_KERNELS=0")
    ops = attnres_cpu.load()
    if ops is None and _cpu_override:
        raise RuntimeError("use_cpu_kernels(True): the AttnRes CPU kernels did not build (see log)")
    return ops
