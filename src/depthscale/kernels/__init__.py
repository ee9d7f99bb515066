"""Fused GPU kernels. Importing this package never imports triton: CPU-only installs work unchanged.

The AttnRes ops in `model/attnres_ops.py` use `attnres_triton` for CUDA inputs when triton
imports. `use_triton` overrides that choice: to test the kernels on CPU under `TRITON_INTERPRET=1`,
or to compare them with the PyTorch ops on a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

_override: bool | None = None


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
