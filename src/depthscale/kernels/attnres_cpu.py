"""Fused CPU kernels, built on first use: the Attention-Residual depth reads (`attnres_cpu.cpp`,
`torch.ops.depthscale_attnres`) and causal sliding-window attention (`window_cpu.cpp`,
`torch.ops.depthscale_window`), one library sharing `vec16.h`.

The C++ sources ship with the package and are compiled once per machine, source version, Python
and torch with `torch.utils.cpp_extension.load` (g++ or $CXX, and ninja; ~40 s on two idle cores)
into torch's extension cache ($TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions); later
processes load the cached library in well under a second. The ops register as
`torch.ops.depthscale_attnres.*` (no pybind module: the build needs only the ATen headers).

The cache directory is shared by every virtualenv and checkout on the machine, so the library's
name (`library_name`) hashes everything a built library is valid for: the sources and their
directory, the flags, the interpreter and its ABI, and torch's version, build and install
directory. Two checkouts or environments then never rebuild each other's library (ninja rebuilds
when its compile commands change, and they name the sources and torch headers of the one that
wrote them).

A build runs under `build_locked`: an `fcntl.flock` on a lock file in the build directory, which the
kernel releases when its holder exits or is killed, so a build interrupted by Ctrl-C or SIGKILL
holds up no later process. (torch's own `lock` file, created and deleted by the builder, outlives a
killed builder and made every later process wait on it silently; under our lock nobody else is
building, so one found there is stale and removed.) The builder prints a line to stderr when it
starts compiling and one when it is done; a process that waits on another's build says so.

Flags: -O3, -ffp-contract=fast and -fopenmp (threads over tokens through `at::parallel_for`, which
is serial without it; the library links the libgomp torch already loaded), never -march=native,
because the cache may be shared by machines with different CPUs: the hot loops are compiled for
x86-64-v4, x86-64-v3 and the baseline with `target_clones` and the loader picks one per machine.
Where -fopenmp does not build (e.g. Apple clang) a single-threaded variant is tried. See the .cpp
for the determinism contract.

Any failure (no compiler, no ninja, a compile or load error) is logged once and `load()` returns
None: the PyTorch ops in `model/attnres_ops.py` run instead. A build interrupted by Ctrl-C (which
reaches ninja too) tries no other variant: the user asked to stop, not to wait for another build.
DEPTHSCALE_CPU_KERNELS=0 skips the kernels (and the build) altogether.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(f) for f in ("attnres_cpu.cpp", "window_cpu.cpp")]
HEADER = Path(__file__).with_name("vec16.h")
CFLAGS = ["-O3", "-ffp-contract=fast"]
WAIT_NOTICE_S = 1.0
"""A process that has waited this long for another's build says so (a warm library loads sooner)."""
LOCK_FILE = "depthscale.lock"

_T = TypeVar("_T")


def build_env() -> dict[str, str]:
    """What a built library is valid for besides its flags: the sources and where they are; the
    interpreter (version, ABI tag, executable: one per virtualenv); torch's version, git hash, C++
    ABI and install directory; and the compiler. The paths count because ninja's compile commands
    name the sources and torch's headers: a checkout or virtualenv with other paths would rewrite
    the commands, and ninja would rebuild the other's library."""
    sources = hashlib.sha1(b"".join(p.read_bytes() for p in (*SOURCES, HEADER))).hexdigest()
    cxx = os.environ.get("CXX", "c++")
    return {
        "sources": sources,
        "source_dir": str(SOURCES[0].parent),
        "python": sys.version,
        "abi": sys.implementation.cache_tag + getattr(sys, "abiflags", ""),
        "interpreter": sys.executable,
        "torch": str(torch.__version__),
        "torch_git": str(torch.version.git_version),
        "torch_cxx11_abi": str(torch.compiled_with_cxx11_abi()),
        "torch_dir": str(Path(torch.__file__).parent),
        "cxx": shutil.which(cxx) or cxx,
    }


def library_name(env: dict[str, str], cflags: list[str], ldflags: list[str]) -> str:
    """`depthscale_cpu_<hash>` of `env` (`build_env`) and the flags: torch's cache keys a build
    directory on the name alone."""
    key = json.dumps({**env, "cflags": cflags, "ldflags": ldflags}, sort_keys=True)
    return "depthscale_cpu_" + hashlib.sha1(key.encode()).hexdigest()[:16]


def _variants() -> list[tuple[str, list[str], list[str]]]:
    env = build_env()
    flags = [([*CFLAGS, "-fopenmp"], ["-fopenmp"]), (CFLAGS, [])]
    return [(library_name(env, cflags, ldflags), cflags, ldflags) for cflags, ldflags in flags]


VARIANTS = _variants()
"""(library name, cflags, ldflags), tried in order: with OpenMP, then serial."""

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


def build_directory(name: str) -> Path:
    """torch's extension cache directory for library `name` (`name` keys Python and torch)."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / name


def _say(line: str) -> None:
    """Lines a user must see while nothing else prints (no logging is configured for them)."""
    print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def build_lock(directory: Path, notice_after_s: float = WAIT_NOTICE_S) -> Iterator[None]:
    """Exclusive use of `directory` among processes: an flock the kernel drops when its holder dies,
    so a killed build never holds up the next. One line on stderr (rank 0 only, not once per rank)
    when the wait lasts over `notice_after_s`, naming the process it waits for."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    with open(path, "a+") as lock:  # a+: never truncate a file another process holds
        deadline = time.monotonic() + notice_after_s
        while not _try_flock(lock):
            if time.monotonic() > deadline:
                if os.environ.get("RANK", "0") == "0":
                    holder = path.read_text().strip() or "another process"
                    _say(f"depthscale: waiting for process {holder} to build the CPU kernels …")
                fcntl.flock(lock, fcntl.LOCK_EX)
                break
            time.sleep(0.05)
        lock.truncate(0)
        lock.write(str(os.getpid()))
        lock.flush()
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _try_flock(lock: Any) -> bool:
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def build_locked(directory: Path, library: Path, build: Callable[[], _T]) -> _T:
    """`build()` (compile if needed, then load) under `build_lock(directory)`, after removing the
    `lock` a killed torch build left there; prints when it compiles (`library` absent) and how long
    that took, or that it failed."""
    with build_lock(directory):
        (directory / "lock").unlink(missing_ok=True)  # torch's, left by a killed build
        if library.exists():
            return build()  # ninja finds nothing to do, the library loads
        _say("depthscale: compiling the CPU kernels (first use with this Python and torch; ~40 s "
             "on two idle cores, longer on a busy machine) …")  # fmt: skip
        start = time.perf_counter()
        try:
            result = build()
        except Exception as exc:
            seconds = time.perf_counter() - start
            _say(f"depthscale: the CPU kernel build failed after {seconds:.0f} s ({_summary(exc)})")
            raise
        _say(f"depthscale: compiled the CPU kernels in {time.perf_counter() - start:.0f} s")
        return result


def interrupted(exc: Exception) -> bool:
    """Whether a build failed because ninja was stopped by a signal (SIGINT, SIGTERM, SIGHUP: a
    Ctrl-C on the terminal reaches the whole foreground group), not because it cannot build."""
    return "interrupted by user" in str(exc)


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
            if interrupted(exc):  # a Ctrl-C asks to stop, not to wait for the next variant
                _say("depthscale: the CPU kernel build was interrupted: this process runs the "
                     "PyTorch ops; the next one builds the kernels")  # fmt: skip
                return None
            continue
        build_seconds = time.perf_counter() - start
        log.info("CPU kernels (%s) ready in %.1f s", name, build_seconds)
        _ops = ops
        return _ops
    log.warning("CPU kernels unavailable, using the PyTorch ops (%s)", "; ".join(errors))
    return None


def _build(name: str, cflags: list[str], ldflags: list[str]) -> Any:
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None or not cpp_extension.is_ninja_available():
        raise RuntimeError(f"no C++ compiler ({cxx}) or no ninja on PATH")  # say nothing per run
    directory = build_directory(name)

    def compile_and_load() -> None:
        cpp_extension.load(
            name=name,
            sources=[str(p) for p in SOURCES],
            extra_cflags=cflags,
            extra_ldflags=ldflags,
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )

    build_locked(directory, directory / f"{name}.so", compile_and_load)
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
