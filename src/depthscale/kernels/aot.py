"""Ahead-of-time compiles of the AttnRes Triton kernels for a GPU this machine does not have.

`compile_variant(variant, arch)` compiles one `attnres_triton_config.Variant` for `sm_<arch>`
(90 → sm_90a, 80 → sm_80) with Triton's own toolchain (`triton.compile(ASTSource(...),
target=GPUTarget("cuda", arch, 32))`: its bundled ptxas and cuobjdump, no GPU, no driver) and reads
what matters for running it from the compiled artefacts, not by eye: registers and spill bytes
from ptxas's report, stack (local memory per thread) from `cuobjdump -res-usage`, shared memory
from Triton's metadata, and the compile's seconds. Used by tests/unit/test_triton_aot.py and
usable from a script (`python -m depthscale.kernels.aot` prints every grid variant's numbers).

Works with Triton 3.6 (the GPU image's) and 3.9: both take `ASTSource(fn, signature, constexprs)`
and `GPUTarget(backend, arch, warp_size)`. The kernels are compiled from a fresh copy of
`attnres_triton_jit`, loaded with the interpreter off, because under TRITON_INTERPRET=1 (the
tests) `@triton.jit` makes interpreter functions, which cannot be compiled. Nothing is cached:
each call compiles into a temporary cache directory and removes it.

`python -m depthscale.kernels.aot [90 80]` prints one JSON line per grid variant and architecture;
benchmarks/results/attnres_triton_aot.jsonl holds its output for Triton 3.9 (the one-launch forward and
backward, vector accesses: `global_loads` / `global_stores` per access form).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from types import SimpleNamespace

from depthscale.kernels.attnres_triton_config import Variant

ARCH_LIMITS = {
    90: {"smem_bytes": 228 * 1024, "regs_per_sm": 64 * 1024},
    80: {"smem_bytes": 164 * 1024, "regs_per_sm": 64 * 1024},
}
"""Per-SM shared memory a block can use (227 KB + the 1 KB the system reserves on sm_90; 163 + 1
on sm_80) and the 32-bit registers of one SM."""

MAX_REGS_PER_THREAD = 255


@dataclass(frozen=True)
class Usage:
    """What one compiled variant uses on `arch`."""

    arch: int
    regs: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    local_bytes: int
    shared_bytes: int
    num_warps: int
    compile_s: float
    ptx_bytes: int
    global_loads: dict[str, int]
    global_stores: dict[str, int]

    def data_access_bits(self) -> tuple[int, int, int]:
        """(narrowest plain load, narrowest plain store, widest plain load) in bits: plain accesses
        (`plain`) move tensor data; 0 where there is none."""
        loads = [_access_bits(k) for k in self.global_loads if plain(k)]
        stores = [_access_bits(k) for k in self.global_stores if plain(k)]
        return min(loads, default=0), min(stores, default=0), max(loads, default=0)

    def problems(self) -> list[str]:
        """What breaks a limit: spills or stack, registers past 255 or past the SM's register file
        at this many warps, shared memory past the SM's."""
        limits = ARCH_LIMITS[self.arch]
        found = []
        if self.spill_store_bytes or self.spill_load_bytes or self.stack_bytes or self.local_bytes:
            found.append(
                f"local memory: {self.spill_store_bytes} B spill stores, {self.spill_load_bytes} B "
                f"spill loads, {self.stack_bytes} B stack, {self.local_bytes} B local per thread"
            )
        if self.regs > MAX_REGS_PER_THREAD:
            found.append(f"{self.regs} registers per thread > {MAX_REGS_PER_THREAD}")
        if self.regs * self.num_warps * 32 > limits["regs_per_sm"]:
            found.append(
                f"{self.regs} registers × {self.num_warps * 32} threads > {limits['regs_per_sm']}"
            )
        if self.shared_bytes > limits["smem_bytes"]:
            found.append(f"{self.shared_bytes} B shared memory > {limits['smem_bytes']}")
        return found


_JIT_MODULES = ("attnres_triton_jit", "attnres_triton_jit_backward")


@cache
def compilable_kernels() -> SimpleNamespace:
    """Fresh copies of `attnres_triton_jit` and `attnres_triton_jit_backward` whose kernels are
    `JITFunction`s, whatever TRITON_INTERPRET says (the interpreter decides at decoration time),
    as one namespace of both modules' names. The backward calls the shared helpers through its
    global `jit`, which Triton resolves when it compiles: pointed at the fresh copy here."""
    from triton import knobs

    fresh = {}
    with knobs.runtime.scope():
        knobs.runtime.interpret = False
        for name in _JIT_MODULES:
            path = Path(__file__).with_name(f"{name}.py")
            spec = importlib.util.spec_from_file_location(f"_depthscale_aot_{name}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            fresh[name] = module
    fresh["attnres_triton_jit_backward"].jit = fresh["attnres_triton_jit"]
    return SimpleNamespace(**{k: v for m in fresh.values() for k, v in vars(m).items()})


_ACCESS = re.compile(r"\b(ld|st)\.global\.([A-Za-z0-9_:.]+)")
_WIDTH = re.compile(r"(?:^|\.)(?:v([248])\.)?[bfsu](8|16|32|64)$")


def _access_bits(form: str) -> int:
    """Bits moved by one PTX access form: "v4.b32" 128, "b16" 16, "cg.b32" 32."""
    vec, scalar = _WIDTH.search(form).groups()
    return int(vec or 1) * int(scalar)


def plain(form: str) -> bool:
    """An access with no cache qualifier: tensor data. The kernels mark everything else —
    fp32 scratch `.cg`, queries `evict_last`, the ticket and flags atomic — so a plain access
    is a source, output or gradient element (or an address-table entry, b64)."""
    return _WIDTH.fullmatch(form) is not None


def global_accesses(ptx: str) -> tuple[dict[str, int], dict[str, int]]:
    """(loads, stores): how many `ld.global` / `st.global` instructions of each form
    ("v4.b32", "b16", "cg.b32", "L1::evict_last.L2::cache_hint.b32", ...) the PTX holds."""
    found: dict[str, dict[str, int]] = {"ld": {}, "st": {}}
    for op, form in _ACCESS.findall(ptx):
        found[op][form] = found[op].get(form, 0) + 1
    return found["ld"], found["st"]


def attributes(variant: Variant) -> dict[tuple[int], list[list]]:
    """What Triton's JIT adds to a launch's signature: tt.divisibility = 16 on every pointer
    argument, because the launcher passes only 16-byte aligned tensors (scalars are in each
    kernel's `do_not_specialize`, so nothing else)."""
    fn = getattr(compilable_kernels(), variant.kernel)
    pointers = dict(variant.pointers)
    return {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params) if p.name in pointers}


def signature(variant: Variant) -> tuple[dict[str, str], dict[str, object]]:
    """(signature, constexprs) of the variant's kernel as `ASTSource` takes them: pointer types
    from the variant, scalar types from the kernel's annotations (every runtime scalar of these
    kernels is annotated and not specialised, so a launch compiles this very signature)."""
    fn = getattr(compilable_kernels(), variant.kernel)
    pointers, consts = dict(variant.pointers), dict(variant.constexprs)
    sig: dict[str, str] = {}
    for param in fn.params:
        if param.is_constexpr:
            sig[param.name] = "constexpr"
        elif param.name in pointers:
            sig[param.name] = pointers[param.name]
        elif param.annotation:
            sig[param.name] = param.annotation
        else:
            raise ValueError(f"{variant.kernel}: argument {param.name} has no type")
    if set(consts) != {p.name for p in fn.params if p.is_constexpr}:
        raise ValueError(f"{variant.kernel}: constexprs {sorted(consts)} do not match the kernel")
    return sig, consts


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def _resources(cubin: bytes) -> dict[str, int]:
    """REG, STACK, SHARED, LOCAL of the cubin's one kernel, from `cuobjdump -res-usage`."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    line = next(x for x in out.splitlines() if "REG:" in x)
    return {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", line)}


def _spills(ptxas_log: str) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) from ptxas -v."""
    regs = re.search(r"Used (\d+) registers", ptxas_log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas_log)
    if regs is None or spills is None:
        raise RuntimeError(f"unreadable ptxas report:\n{ptxas_log}")
    return int(regs.group(1)), int(spills.group(1)), int(spills.group(2))


def compile_variant(variant: Variant, arch: int = 90) -> Usage:
    """Compile `variant` for sm_<arch> (no cache) and read its resource usage."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile

    fn = getattr(compilable_kernels(), variant.kernel)
    sig, consts = signature(variant)
    source = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attributes(variant))
    options = variant.compile_options()
    log = io.StringIO()
    with (
        tempfile.TemporaryDirectory() as cache_dir,
        knobs.cache.scope(),
        knobs.compilation.scope(),
        knobs.nvidia.scope(),
        contextlib.redirect_stdout(log),
    ):
        knobs.cache.dir = cache_dir
        knobs.compilation.always_compile = True
        knobs.nvidia.dump_ptxas_log = True  # printed: caught by redirect_stdout
        start = time.perf_counter()
        compiled = triton_compile(source, target=GPUTarget("cuda", arch, 32), options=options)
        seconds = time.perf_counter() - start
    regs, spill_stores, spill_loads = _spills(log.getvalue())
    res = _resources(compiled.asm["cubin"])
    loads, stores = global_accesses(compiled.asm["ptx"])
    return Usage(
        arch=arch,
        regs=max(regs, res["REG"]),
        stack_bytes=res["STACK"],
        spill_store_bytes=spill_stores,
        spill_load_bytes=spill_loads,
        local_bytes=res.get("LOCAL", 0),
        shared_bytes=max(compiled.metadata.shared, 0),
        num_warps=variant.num_warps,
        compile_s=seconds,
        ptx_bytes=len(compiled.asm["ptx"]),
        global_loads=loads,
        global_stores=stores,
    )


def _compile_one(job: tuple[Variant, int]) -> tuple[Variant, int, Usage | str]:
    variant, arch = job
    try:
        return variant, arch, compile_variant(variant, arch)
    except Exception as e:  # reported with its variant, not as a pool traceback
        return variant, arch, f"{type(e).__name__}: {e}"


def compile_many(
    variants: list[Variant], archs: tuple[int, ...] = (90, 80), workers: int = 0
) -> list[tuple[Variant, int, Usage | str]]:
    """`compile_variant` for every (variant, arch), in `workers` fresh processes (spawned: a forked
    child of a process running torch's threads can deadlock; default: one per CPU this process may
    use), each result a `Usage` or the compile error as text, in job order."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    jobs = [(v, arch) for v in variants for arch in archs]
    workers = workers or max(1, min(len(os.sched_getaffinity(0)), len(jobs)))
    if workers == 1:
        return [_compile_one(job) for job in jobs]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_quiet) as pool:
        return list(pool.map(_compile_one, jobs))


def _quiet() -> None:
    """Workers compile for a GPU, never interpret; and Triton 3.9's note that its FP-fusion
    default will change says nothing about these kernels (they keep the default, as launches do)."""
    import warnings

    os.environ.pop("TRITON_INTERPRET", None)
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")


def main(argv: list[str]) -> int:
    """Print one JSON line per grid variant and architecture; exit 1 if any breaks a limit."""
    import json

    import triton

    from depthscale.kernels.attnres_triton_config import grid_variants

    archs = tuple(int(a) for a in argv) or (90, 80)
    grid = grid_variants()
    failed = False
    for variant, arch, usage in compile_many(list(grid), archs):
        d, S, dtype = grid[variant]
        record = {"triton": triton.__version__, "variant": variant.describe(),
                  "first_shape": {"d": d, "S": S, "dtype": dtype}}  # fmt: skip
        if isinstance(usage, str):
            record |= {"arch": arch, "problems": [usage]}
        else:
            record |= asdict(usage) | {"problems": usage.problems()}
        failed |= bool(record["problems"])
        print(json.dumps(record), flush=True)
    return int(failed)


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    sys.exit(main(sys.argv[1:]))
