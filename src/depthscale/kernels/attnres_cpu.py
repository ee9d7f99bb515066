"""Fused CPU kernels, built on first use: the Attention-Residual depth reads (`attnres_cpu.cpp`,
`torch.ops.depthscale_attnres`) and causal sliding-window attention (`window_cpu.cpp`,
`torch.ops.depthscale_window`), one library sharing `vec16.h`.

The C++ sources ship with the package and are compiled once per machine and source version with
`torch.utils.cpp_extension.load` (g++ or $CXX, and ninja) into torch's extension cache
($TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions); later processes load the cached
library in well under a second. The ops register as `torch.ops.depthscale_attnres.*` (no pybind
module: the build needs only the ATen headers).

Flags: -O3, -ffp-contract=fast and -fopenmp (threads over tokens through `at::parallel_for`, which
is serial without it; the library links the libgomp torch already loaded), never -march=native,
because the cache may be shared by machines with different CPUs: the hot loops are compiled for
x86-64-v4, x86-64-v3 and the baseline with `target_clones` and the loader picks one per machine.
Where -fopenmp does not build (e.g. Apple clang) a single-threaded variant is tried. See the .cpp
for the determinism contract.

Any failure (no compiler, no ninja, a compile or load error) is logged once and `load()` returns
None: the PyTorch ops in `model/attnres_ops.py` run instead. DEPTHSCALE_CPU_KERNELS=0 skips the
kernels (and the build) altogether.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(f) for f in ("attnres_cpu.cpp", "window_cpu.cpp")]
HEADER = Path(__file__).with_name("vec16.h")
NAME = (
    "depthscale_cpu_"
    + hashlib.sha1(b"".join(p.read_bytes() for p in (*SOURCES, HEADER))).hexdigest()[:12]
)
"""Named by the sources' content: two checkouts (or versions) of depthscale on one machine build
and load their own libraries instead of racing for one build directory (torch's cache keys on the
name; within a process it tracks source changes, across processes only ninja's timestamps do, and
a library of another version would register ops this one lacks)."""
CFLAGS = ["-O3", "-ffp-contract=fast"]
VARIANTS = [
    (NAME, [*CFLAGS, "-fopenmp"], ["-fopenmp"]),
    (f"{NAME}_serial", CFLAGS, []),
]
"""(library name, cflags, ldflags), tried in order."""
STALE_LOCK_S = 15 * 60
"""A build lock older than this is left over from a killed build: torch would wait on it forever."""

_ops: Any = None
_tried = False
build_seconds: float | None = None
"""Wall time of this process's load(): the compile on a cold cache, a library load on a warm one."""


def enabled_by_env() -> bool:
    """False when DEPTHSCALE_CPU_KERNELS is set to 0/false/no/off."""
    return os.environ.get("DEPTHSCALE_CPU_KERNELS", "1").strip().lower() not in (
        "0",
        "false",
        "no",
        "off",
    )


def _remove_stale_lock(name: str) -> None:
    try:
        from torch.utils.cpp_extension import _get_build_directory  # private: best effort

        lock = Path(_get_build_directory(name, verbose=False)) / "lock"
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            log.warning("removing stale torch extension build lock %s", lock)
            lock.unlink()
    except Exception:  # no lock (the usual case), or the private helper moved
        pass


def _summary(exc: Exception) -> str:
    """One line of a build error: the first compiler diagnostic ("error:") if there is one."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    first_error = next((line for line in lines if "error:" in line.lower()), None)
    return f"{type(exc).__name__}: {first_error or (lines[0] if lines else '')}"[:300]


def load() -> Any:
    """The `torch.ops.depthscale_attnres` namespace, building the library if needed; None when the
    kernels are disabled (checked on every call) or cannot be built here (tried once per process,
    the failure logged once)."""
    global _ops, _tried, build_seconds
    if not enabled_by_env():
        return None
    if _tried:
        return _ops
    _tried = True
    start = time.perf_counter()
    errors = []
    for name, cflags, ldflags in VARIANTS:
        try:
            ops = _build(name, cflags, ldflags)
        except Exception as exc:  # no compiler, no ninja, compile or load error: next / fall back
            errors.append(f"{name}: {_summary(exc)}")
            if isinstance(exc, _LoadedIncomplete):
                break
            continue
        build_seconds = time.perf_counter() - start
        log.info("CPU kernels (%s) ready in %.1f s", name, build_seconds)
        _ops = ops
        return _ops
    log.warning("CPU kernels unavailable, using the PyTorch ops (%s)", "; ".join(errors))
    return None


def _build(name: str, cflags: list[str], ldflags: list[str]) -> Any:
    import torch
    from torch.utils import cpp_extension

    _remove_stale_lock(name)
    log.info("loading the CPU kernels (compiled once per machine and version)")
    cpp_extension.load(
        name=name,
        sources=[str(p) for p in SOURCES],
        extra_cflags=cflags,
        extra_ldflags=ldflags,
        is_python_module=False,
        verbose=False,
    )
    try:
        torch.ops.depthscale_window.forward  # noqa: B018  (raise if the library registered nothing)
        ops = torch.ops.depthscale_attnres
        ops.read_forward  # noqa: B018
    except (AttributeError, RuntimeError) as exc:
        raise _LoadedIncomplete(f"{name} loaded without its ops: {exc}") from exc
    return ops


class _LoadedIncomplete(RuntimeError):
    """A library loaded but did not register every op: loading another variant would register the
    same namespaces twice, which aborts the process, so no other variant is tried."""
