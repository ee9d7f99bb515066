"""Every AttnRes Triton kernel, in every variant a launch can choose at the production shapes,
compiled ahead of time for sm_90a and sm_80 with Triton's own ptxas (no GPU needed), within the
hardware's limits: no local memory (spill stores and loads, stack), registers ≤ 255 and within the
SM's 64 K at the variant's warps, shared memory within the SM's (228 KB sm_90, 164 KB sm_80), and
each compile bounded in time.

The grid — d ∈ {1024, 2048, 4096, 8192, 16384}, S ∈ 1…32, fp32 and bf16 — comes from
`attnres_triton_config.grid_variants`, which calls the very functions the launcher calls (no table
of its own here) and deduplicates: d is a runtime argument, so about sixty variants cover it, each
~0.5 CPU-second per architecture. Nothing is cached across runs (`aot.compile_variant` compiles
into a temporary cache). The first design held whole rows per program: at d = 8192, S = 1 its
forward took minutes to compile into 43 KB/thread of local memory, and from d = 4096 on every read
spilled (1–9 KB/thread); this test fails on it.

The second test proves that a launch compiles exactly these signatures: Triton's own JIT binder,
given real arguments — misaligned pointers, scalars equal to 1 and to 16 — specialises nothing, so
the variant is what the config says and nothing else.
"""

import inspect

import pytest
import torch

from depthscale.kernels import aot
from depthscale.kernels import attnres_triton_config as config

COMPILE_S = 30.0
"""Per variant and architecture: ~0.5 CPU-s measured; generous for a shared 2-core machine."""

GRID = config.grid_variants()


def test_every_grid_variant_compiles_for_sm90_and_sm80_within_the_limits():
    failures = []
    for variant, arch, usage in aot.compile_many(list(GRID), archs=(90, 80)):
        where = f"{variant.describe()} on sm_{arch} (first chosen at d, S, dtype = {GRID[variant]})"
        if isinstance(usage, str):
            failures.append(f"{where}: {usage}")
            continue
        problems = usage.problems()
        if usage.compile_s > COMPILE_S:
            problems.append(f"compile took {usage.compile_s:.1f} s > {COMPILE_S} s")
        failures += [f"{where}: {p}" for p in problems]
    assert not failures, "\n".join(failures)


def test_the_grid_holds_every_kernel_and_the_shapes_that_broke_the_first_design():
    kernels = {
        name
        for name, fn in vars(aot.compilable_kernels()).items()
        if name.endswith("_kernel") and hasattr(fn, "params")
    }
    assert {v.kernel for v in GRID} == kernels
    for d, S in ((8192, 1), (4096, 16), (8192, 20), (16384, 32)):
        for dtype in ("fp32", "bf16"):
            chosen = (*config.read_forward_variants(d, S, dtype),
                      *config.read_backward_variants(d, S, dtype))  # fmt: skip
            assert set(chosen) <= set(GRID)
            assert all(dict(v.constexprs).get("ALIGNED", True) for v in chosen)


_TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "i64": torch.int64}


@pytest.mark.parametrize("scalar", [1, 16])
def test_launches_specialise_nothing_beyond_the_variant(scalar):
    """Triton's JIT turns an integer argument equal to 1 into a constant and marks multiples of 16
    and 16-byte aligned pointers; each would be a variant the AOT test never compiled (S = 1 made
    the first design's 43 KB/thread forward). With every runtime argument annotated and in
    `do_not_specialize`, the binder's signature for real arguments is the variant's."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", 90, 32))
    for variant in GRID:
        fn = getattr(aot.compilable_kernels(), variant.kernel)
        sig, consts = aot.signature(variant)
        args = []
        for param in fn.params:
            if param.is_constexpr:
                continue
            kind = sig[param.name]
            if kind.startswith("*"):  # one element past an aligned address
                args.append(torch.zeros(16, dtype=_TORCH[kind[1:]])[1:])
            else:
                args.append(float(scalar) if kind.startswith("fp") else scalar)
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        _, specialization, _ = binder(*args, **consts)
        got = dict(zip(inspect.signature(fn.fn).parameters, specialization, strict=True))
        for name, (kind, attribute) in got.items():
            if kind == "constexpr":
                assert consts[name] == attribute, (variant.kernel, name)
            else:
                assert (kind, attribute) == (sig[name], None), (variant.kernel, name, kind)
