"""Which implementation runs an AttnRes read, and a record of what ran.

`triton_ops` / `cpu_ops` return the fused kernels' module when they apply to the given tensors
(else None, and the read runs the PyTorch ops in `attnres_ops`); every read records the path it took
(`record`), so `kernel_paths()` can say — and the log says once — which kernels a run used and, for
the PyTorch fallback, why (`fallback_reason`). A silent fallback is how a slow bf16 run goes
unnoticed.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger("depthscale.kernels")

_PLAIN = (Tensor, torch.nn.Parameter)
"""Tensor types the kernels take: not DTensors (e.g. AttnRes queries under tp + dp) nor other
subclasses, which the custom ops have no sharding rules for."""


def triton_ops(values: list[Tensor], *others: Tensor) -> ModuleType | None:
    """The Triton kernels module when it applies, else None: plain CUDA tensors (any device under
    `kernels.use_triton(True)`, none under `use_triton(False)`), values of one dtype, no float64
    (gradcheck), triton importable. Imported lazily: model/ must not need triton."""
    from depthscale import kernels

    override = kernels.triton_override()
    if override is False:
        return None
    tensors = [*values, *others]
    if any(type(t) not in _PLAIN for t in tensors):
        return None
    if override is None and not all(t.is_cuda for t in tensors):
        return None
    if len({v.dtype for v in values}) != 1 or any(t.dtype == torch.float64 for t in tensors):
        return None
    return kernels.load_attnres_triton()


_CPU_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def cpu_ops(values: list[Tensor], *fp32: Tensor, inter_out: Tensor | None = None) -> Any:
    """The CPU kernels' ops when they apply, else None: plain CPU tensors (not DTensors, e.g. the
    AttnRes queries under tp + dp, nor other subclasses: the ops have no sharding rules), `values`
    of one dtype among fp32/bf16/fp16, the `fp32` tensors (queries, log-sum-exps) in fp32 (so
    float64, e.g. gradcheck, runs in PyTorch), a phase-1 `inter_out` in the values' dtype or fp32,
    not under `use_cpu_kernels(False)`, and not while torch.compile traces (the compiler fuses the
    PyTorch ops itself; an opaque op would break the graph)."""
    from depthscale import kernels

    if kernels.cpu_kernels_override() is False or torch.compiler.is_compiling():
        return None
    dtype = values[0].dtype
    if dtype not in _CPU_KERNEL_DTYPES:
        return None
    for v in values:  # called per read: plain attribute checks, no device objects
        if type(v) not in _PLAIN or not v.is_cpu or v.dtype != dtype:
            return None
    for t in fp32:
        if type(t) not in _PLAIN or not t.is_cpu or t.dtype != torch.float32:
            return None
    if inter_out is not None and (
        type(inter_out) not in _PLAIN
        or not inter_out.is_cpu
        or (inter_out.dtype != dtype and inter_out.dtype != torch.float32)
    ):
        return None
    return kernels.load_attnres_cpu()


# ---------------------------------------------------------------------------------------------
# Which path ran. `record` runs on every read: one tuple and one dict lookup, no formatting (the
# reason is a constant string or a tuple of a %-format and its arguments, formatted when first
# logged). It is marked constant for torch.compile: dynamo runs it once while tracing (the read is
# recorded then) and leaves it out of the graph, so it neither breaks the graph nor recompiles.

_paths: dict[tuple[str, str, Any], None] = {}
"""(read type, path, fallback reason or None) in the order first seen."""


def _describe(reason: Any) -> str:
    def name(x: Any) -> str:
        if isinstance(x, torch.dtype):
            return str(x).removeprefix("torch.")
        if isinstance(x, type):
            return x.__name__
        if isinstance(x, tuple):
            return "/".join(name(y) for y in x)
        return str(x)

    if isinstance(reason, tuple):
        return reason[0] % tuple(name(x) for x in reason[1:])
    return str(reason)


def record(kind: str, path: str, reason: Any = None) -> bool:
    """Note that a `kind` read took `path` (with the fallback `reason`); log it the first time."""
    key = (kind, path, reason)
    if key not in _paths:
        _paths[key] = None
        if reason is None:
            log.info("AttnRes %s path: %s", kind, path)
        else:
            log.info("AttnRes %s path: %s (%s)", kind, path, _describe(reason))
    return True


# What `torch.compiler.assume_constant_result` does (torch 2.11–2.13), without importing dynamo at
# import time: that would import triton too, before a test can choose TRITON_INTERPRET=1, and add
# a second to every `import depthscale.model`.
record._dynamo_marked_constant = True  # type: ignore[attr-defined]


def kernel_paths(reasons: bool = False) -> dict[str, str]:
    """The paths the AttnRes reads took so far in this process, per read type ("phase1": two-phase
    inter-block reads, "merge": two-phase merges, "read": memory-efficient reads): "triton", "cpu"
    (the C++ kernels) or "torch", several joined by "+" in the order first taken. reasons=True:
    torch entries carry why, e.g. "torch (mixed source dtypes float32/bfloat16)"."""
    found: dict[str, list[str]] = {}
    for kind, path, reason in list(_paths):  # a snapshot: reads may record meanwhile
        label = f"{path} ({_describe(reason)})" if reasons and reason is not None else path
        labels = found.setdefault(kind, [])
        if label not in labels:
            labels.append(label)
    return {kind: "+".join(labels) for kind, labels in found.items()}


def reset_kernel_paths() -> None:
    """Forget the paths seen (tests; each is then logged again the next time it is taken)."""
    _paths.clear()


def fallback_reason(
    values: list[Tensor],
    query: Tensor,
    lse: Tensor | None = None,
    inter_out: Tensor | None = None,
) -> Any:
    """Why neither kernel took a read (called on the PyTorch path only): the Triton kernels'
    reason for tensors off the CPU, the CPU kernels' for CPU tensors, in the order they check."""
    from depthscale import kernels
    from depthscale.kernels import attnres_cpu

    role = "source" if lse is None else "partial sum"
    named = [(role, v) for v in values] + [("query", query)]
    named += [
        (r, t) for r, t in (("phase-1 lse", lse), ("phase-1 output", inter_out)) if t is not None
    ]
    on_cpu = values[0].is_cpu
    if on_cpu:
        if kernels.cpu_kernels_override() is False:
            return "use_cpu_kernels(False)"
        if torch.compiler.is_compiling():
            return "torch.compile tracing"
    elif kernels.triton_override() is False:
        return "use_triton(False)"
    for r, t in named:
        if type(t) not in _PLAIN:
            return ("%s %s", type(t), r)
    for r, t in named:
        if t.is_cpu != on_cpu:
            return ("%s on %s, sources on %s", r, t.device.type, values[0].device.type)
    dtypes = tuple(dict.fromkeys(v.dtype for v in values))
    if len(dtypes) > 1:
        return ("mixed %s dtypes %s", role, dtypes)
    for r, t in named:
        if t.dtype == torch.float64:
            return ("float64 %s", r)
    if not on_cpu:
        if kernels.triton_override() is None and not values[0].is_cuda:
            return ("%s tensors", values[0].device.type)
        return "triton not installed"
    if dtypes[0] not in _CPU_KERNEL_DTYPES:
        return ("%s %s", dtypes[0], role)
    for r, t in named[len(values) : len(values) + 2]:  # query, lse: fp32
        if t.dtype != torch.float32:
            return ("%s %s", t.dtype, r)
    if inter_out is not None and inter_out.dtype not in (dtypes[0], torch.float32):
        return ("phase-1 output %s, partial sum %s", inter_out.dtype, dtypes[0])
    if not attnres_cpu.enabled_by_env():
        return "DEPTHSCALE_CPU_KERNELS=0"
    return "CPU kernels not built"


# ---------------------------------------------------------------------------------------------
