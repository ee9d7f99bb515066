"""Which implementation runs an AttnRes read, and a record of what ran.

One rule, `choose(kind, values, query, lse, inter_out)`, picks the path of every read and is the
only place that decides, records and refuses: the Triton kernels (`triton`) for plain CUDA tensors
when triton imports (any device under `kernels.use_triton(True)`), else the C++ CPU kernels (`cpu`)
for plain CPU tensors of one dtype among fp32/bf16/fp16, else the PyTorch ops (`torch`) with the
reason (`fallback_reason`). `_triton` / `_cpu` are its eligibility checks, nothing more.

Every choice is recorded (`kernel_paths()`), and logged to `depthscale.kernels` the first time a
read type takes a path for a given reason, so once per read type in a run whose reads all take
one path (a read type that later takes another path, or falls back for another reason, logs that
once too: a fallback must never hide behind an earlier fused read). INFO for a fused path or a
fallback without a kernel, WARNING for a missed kernel (a silent fallback is how a slow bf16 run
goes unnoticed). After the first time a read costs a tuple and a dict lookup: no formatting.

Fallbacks are of two kinds:

- *chosen or without a kernel* — never an error: `use_triton(False)` / `use_cpu_kernels(False)` /
  `DEPTHSCALE_CPU_KERNELS=0`, torch.compile tracing (the compiler fuses the PyTorch ops itself),
  float64 (gradcheck), tensor subclasses such as DTensor queries under tp + dp (the ops have no
  sharding rules), source dtypes no kernel takes (e.g. integer), and devices with no kernel at all
  (neither CPU nor CUDA, e.g. meta);
- *missed* — a kernel exists for this device and these dtypes, but this read could not use it:
  mixed source dtypes, a log-sum-exp not in fp32, a phase-1 output in a third dtype, tensors on
  different devices, triton missing for CUDA tensors, CPU kernels that did not build.

Strict mode (`kernels.strict(True)` for the process, `with kernels.strict():` for a block, or
`DEPTHSCALE_STRICT_KERNELS=1` for a process and its children) turns a missed fallback into a
`KernelFallbackError` naming the read type, the reason and how to turn strict mode off; the other
kind still falls back. The test suite runs strict (tests/conftest.py).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from depthscale import kernels

log = logging.getLogger("depthscale.kernels")

_PLAIN = (Tensor, torch.nn.Parameter)
"""Tensor types the kernels take: not DTensors (e.g. AttnRes queries under tp + dp) nor other
subclasses, which the custom ops have no sharding rules for."""

_CPU_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class KernelFallbackError(RuntimeError):
    """A read fell back to the PyTorch ops where a fused kernel exists, in strict mode."""


def choose(
    kind: str,
    values: list[Tensor],
    query: Tensor,
    lse: Tensor | None = None,
    inter_out: Tensor | None = None,
) -> tuple[str, Any, Any]:
    """The path of one `kind` read ("read", "phase1", "merge"), what runs it and why: ("triton",
    the Triton kernels' module, None), ("cpu", the CPU kernels' ops, None) or ("torch", None,
    the fallback reason: a string, or a %-format and its arguments; `describe` formats it).
    `values`: the sources (a read) or the partial sum (a merge); `query`: the queries as the
    caller holds them; `lse` / `inter_out`: a merge's phase-1 results. Records the choice; raises
    `KernelFallbackError` for a missed kernel in strict mode. Called per read: attribute checks
    only, until a fallback needs its reason."""
    ops = _triton(values, query, lse, inter_out)
    if ops is not None:
        record(kind, "triton")
        return "triton", ops, None
    ops = _cpu(values, query, lse, inter_out)
    if ops is not None:
        record(kind, "cpu")
        return "cpu", ops, None
    missed, reason = fallback_reason(values, query, lse, inter_out)
    record(kind, "torch", reason, missed)
    if missed and kernels.strict_mode():
        raise KernelFallbackError(
            f"AttnRes {kind} read fell back to the PyTorch ops: {describe(reason)}. A fused "
            "kernel exists for this device; strict mode (kernels.strict(True) or "
            "DEPTHSCALE_STRICT_KERNELS=1) refuses the fallback — fix the inputs, or turn strict "
            "mode off with kernels.strict(False) / DEPTHSCALE_STRICT_KERNELS=0"
        )
    return "torch", None, reason


def _triton(
    values: list[Tensor], query: Tensor, lse: Tensor | None, inter_out: Tensor | None
) -> Any:
    """The Triton kernels module when it applies: plain CUDA tensors (any device under
    `use_triton(True)`, none under `use_triton(False)`), values of one dtype, no float64, triton
    importable. Imported lazily: model/ must not need triton."""
    override = kernels.triton_override()
    if override is False:
        return None
    tensors = [*values, query]
    if lse is not None:
        tensors.append(lse)
    if inter_out is not None:
        tensors.append(inter_out)
    if any(type(t) not in _PLAIN for t in tensors):
        return None
    if override is None and not all(t.is_cuda for t in tensors):
        return None
    if len({v.dtype for v in values}) != 1 or any(t.dtype == torch.float64 for t in tensors):
        return None
    return kernels.load_attnres_triton()


def _cpu(values: list[Tensor], query: Tensor, lse: Tensor | None, inter_out: Tensor | None) -> Any:
    """The CPU kernels' ops when they apply: plain CPU tensors, `values` of one dtype among
    fp32/bf16/fp16, a query of any float dtype but float64 (it is taken in fp32), a log-sum-exp in
    fp32, a phase-1 output in the values' dtype or fp32; not under `use_cpu_kernels(False)` nor
    while torch.compile traces (an opaque op would break the graph)."""
    if kernels.cpu_kernels_override() is False or torch.compiler.is_compiling():
        return None
    dtype = values[0].dtype
    if dtype not in _CPU_KERNEL_DTYPES:
        return None
    for v in values:
        if type(v) not in _PLAIN or not v.is_cpu or v.dtype != dtype:
            return None
    if type(query) not in _PLAIN or not query.is_cpu or query.dtype == torch.float64:
        return None
    if lse is not None and (
        type(lse) not in _PLAIN or not lse.is_cpu or lse.dtype != torch.float32
    ):
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


def describe(reason: Any) -> str:
    """A fallback reason as text, e.g. "mixed source dtypes float32/bfloat16"."""

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


def record(kind: str, path: str, reason: Any = None, missed: bool = False) -> bool:
    """Note that a `kind` read took `path` (with the fallback `reason`); log it the first time, at
    WARNING for a `missed` fused kernel."""
    key = (kind, path, reason)
    if key not in _paths:
        _paths[key] = None
        if reason is None:
            log.info("AttnRes %s path: %s", kind, path)
        else:
            level = logging.WARNING if missed else logging.INFO
            log.log(level, "AttnRes %s path: %s (%s)", kind, path, describe(reason))
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
        label = f"{path} ({describe(reason)})" if reasons and reason is not None else path
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
) -> tuple[bool, Any]:
    """(missed, reason): why neither kernel took a read (called on the PyTorch path only), and
    whether a kernel for this device was missed (see the module docstring). The Triton kernels'
    reason for tensors off the CPU, the CPU kernels' for CPU tensors, in the order they check."""
    from depthscale.kernels import attnres_cpu

    role = "source" if lse is None else "partial sum"
    named = [(role, v) for v in values] + [("query", query)]
    named += [
        (r, t) for r, t in (("phase-1 lse", lse), ("phase-1 output", inter_out)) if t is not None
    ]
    on_cpu = values[0].is_cpu
    if on_cpu:
        if kernels.cpu_kernels_override() is False:
            return False, "use_cpu_kernels(False)"
        if torch.compiler.is_compiling():
            return False, "torch.compile tracing"
    elif kernels.triton_override() is False:
        return False, "use_triton(False)"
    for r, t in named:
        if type(t) not in _PLAIN:
            return False, ("%s %s", type(t), r)
    if not on_cpu and kernels.triton_override() is None and not values[0].is_cuda:
        return False, ("%s tensors", values[0].device.type)
    for r, t in named:
        if t.is_cpu != on_cpu:
            return True, ("%s on %s, sources on %s", r, t.device.type, values[0].device.type)
    for r, t in named:
        if t.dtype == torch.float64:
            return False, ("float64 %s", r)
    dtypes = tuple(dict.fromkeys(v.dtype for v in values))
    if len(dtypes) > 1:
        return True, ("mixed %s dtypes %s", role, dtypes)
    if not on_cpu:
        return True, "triton not installed"
    if dtypes[0] not in _CPU_KERNEL_DTYPES:
        return False, ("%s %s", dtypes[0], role)
    if lse is not None and lse.dtype != torch.float32:
        return True, ("%s phase-1 lse", lse.dtype)
    if inter_out is not None and inter_out.dtype not in (dtypes[0], torch.float32):
        return True, ("phase-1 output %s, partial sum %s", inter_out.dtype, dtypes[0])
    if not attnres_cpu.enabled_by_env():
        return False, "DEPTHSCALE_CPU_KERNELS=0"
    return True, "CPU kernels not built"
