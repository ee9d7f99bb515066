"""Telling a failed write on storage from a bug, and naming the disk in one line.

A full disk does not always arrive as an OSError: `torch.save` writes through its zip writer,
which reports a short write as `RuntimeError: [enforce fail at inline_container.cc] unexpected
pos 704 vs 598`, with no errno. A checkpoint save that met it stopped the run with that line,
where a full disk should be reported and training go on (`checkpoint_write.py`). So the zip writer's
failures count as storage failures too, and every storage failure is described with what the
file system holding the path says about its free space: that is what a person needs to act.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

_TORCH_WRITE_FAILED = ("unexpected pos", "PytorchStreamWriter failed", "file write failed")
"""What torch's zip writer (caffe2/serialize/inline_container.cc) says when a write falls short."""


def _os_error_in(exc: BaseException) -> OSError | None:
    """The OSError behind `exc`: itself, or one it was raised from or while handling. torch.save
    meets ENOSPC as an OSError, then its zip writer's cleanup raises the RuntimeError that
    surfaces, with the OSError only as its context."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def is_storage_failure(exc: BaseException) -> bool:
    """An OSError (or an error raised while handling one), or torch's zip writer failing a
    write (its RuntimeError carries no errno)."""
    if _os_error_in(exc) is not None:
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in _TORCH_WRITE_FAILED)


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def disk_state(path: Path) -> str | None:
    """'the file system holding PATH has 12.0 KB free of 1.2 MB', from the nearest existing
    ancestor of `path`; None if even that cannot be asked."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        usage = shutil.disk_usage(probe)
    except OSError:
        return None
    state = f"the file system holding {path} has {_size(usage.free)} free of {_size(usage.total)}"
    if usage.free < max(1 << 20, usage.total // 100):
        state += " (full)"
    return state


def describe(exc: BaseException, path: Path) -> str:
    """One line for a storage failure while writing under `path`."""
    if (os_error := _os_error_in(exc)) is not None:
        what = f"{type(os_error).__name__}: {os_error}"
        if os_error.errno == errno.EFBIG:
            what += " (a file passed the process's file-size limit, ulimit -f)"
    else:
        what = f"a write failed (torch: {str(exc).strip().splitlines()[0]})"
    state = disk_state(path)
    return what + (f"; {state}" if state else "")
