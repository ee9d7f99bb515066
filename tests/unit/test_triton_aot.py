"""Every AttnRes Triton kernel, in every variant a launch can choose at the production shapes,
compiled ahead of time for sm_90a and sm_80 with Triton's own ptxas (no GPU needed), with the
specialisation the JIT applies at run time (every pointer 16-byte aligned: `aot.attributes`;
scalars unspecialised), and held to what running at the roofline needs: no local memory (spill
stores and loads, stack), registers below the 128 cap at the variant's warps (two programs of 8
warps per SM), shared memory within the SM's, and — read from the PTX — every aligned variant
moves its tensor data (sources, outputs, gradients: the loads and stores with no cache qualifier,
`aot.plain`) in vector accesses of at least 64 bits, never element by element.

The grid — d ∈ {1024, 2048, 4096, 8192, 16384}, S ∈ 1…32, fp32 and bf16 — comes from
`attnres_triton_config.grid_variants`, which calls the very functions the launcher calls (no table
of its own here) and deduplicates: d is a runtime argument, so a few dozen variants cover it. The
compiles run once per test session (`_compiled`, shared by the tests below).

The last test proves that a launch compiles exactly these signatures: Triton's own JIT binder,
given the arguments a launch passes — aligned tensors, scalars equal to 1 and to 16 — marks the
pointers aligned and specialises no scalar, and a misaligned tensor is refused before launch.
"""

import inspect

import pytest
import torch

from depthscale.kernels import aot
from depthscale.kernels import attnres_triton_config as config

COMPILE_S = 30.0
"""Per variant and architecture: ~0.5–2 CPU-s measured; generous for a shared 2-core machine."""

REGISTER_CAP = 128
"""`attnres_triton_config._MAX_REGISTERS`: a variant at the cap is one ptxas squeezed."""

GRID = config.grid_variants()


@pytest.fixture(scope="module")
def compiled():
    """Every grid variant compiled for sm_90a and sm_80, once for this module's tests."""
    return aot.compile_many(list(GRID), archs=(90, 80))


def test_every_grid_variant_compiles_for_sm90_and_sm80_within_the_limits(compiled):
    failures = []
    for variant, arch, usage in compiled:
        where = f"{variant.describe()} on sm_{arch} (first chosen at d, S, dtype = {GRID[variant]})"
        if isinstance(usage, str):
            failures.append(f"{where}: {usage}")
            continue
        problems = usage.problems()
        if usage.compile_s > COMPILE_S:
            problems.append(f"compile took {usage.compile_s:.1f} s > {COMPILE_S} s")
        if usage.regs >= min(REGISTER_CAP, variant.max_registers):
            problems.append(f"{usage.regs} registers: at the cap of {variant.max_registers}")
        failures += [f"{where}: {p}" for p in problems]
    assert not failures, "\n".join(failures)


def test_every_aligned_variant_moves_its_data_in_vectors_of_64_bits_or_more(compiled):
    """Read from the PTX: the narrowest plain load and store of an ALIGNED variant is ≥ 64 bits
    (a bf16 element alone is 16, the scalar code the first kernels compiled to) and its widest
    load a vector (`ld.global.v2`/`v4`)."""
    failures = []
    for variant, arch, usage in compiled:
        if isinstance(usage, str) or not dict(variant.constexprs).get("ALIGNED", False):
            continue
        narrow_load, narrow_store, wide_load = usage.data_access_bits()
        if narrow_load < 64 or wide_load < 64 or 0 < narrow_store < 64:
            failures.append(
                f"{variant.describe()} on sm_{arch}: loads {usage.global_loads}, "
                f"stores {usage.global_stores}"
            )
    assert not failures, "\n".join(failures)


def test_the_ptx_reader_tells_vectors_from_elements():
    """`aot.global_accesses` and `plain` on PTX lines of the forms the kernels compile to."""
    ptx = """
        @%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
        @%p2 ld.global.b16 { %rs1 }, [ %rd2 + 0 ];
        ld.global.cg.b32 { %r5 }, [ %rd3 + 0 ];
        ld.global.L1::evict_last.L2::cache_hint.v2.b32 { %r6, %r7 }, [ %rd4 + 0 ], %rd5;
        @%p3 st.global.v2.b32 [ %rd6 + 0 ], { %r8, %r9 };
    """
    loads, stores = aot.global_accesses(ptx)
    assert loads == {"v4.b32": 1, "b16": 1, "cg.b32": 1, "L1::evict_last.L2::cache_hint.v2.b32": 1}
    assert stores == {"v2.b32": 1}
    assert [aot.plain(f) for f in loads] == [True, True, False, False]
    usage = aot.Usage(90, 40, 0, 0, 0, 0, 0, 8, 1.0, 1, loads, stores)
    assert usage.data_access_bits() == (16, 64, 128)


def test_the_grid_holds_every_kernel_and_the_shapes_that_broke_the_first_design():
    kernels = {
        name
        for name, fn in vars(aot.compilable_kernels()).items()
        if name.endswith("_kernel") and hasattr(fn, "params")
    }
    assert {v.kernel for v in GRID} == kernels
    for d, S in ((8192, 1), (4096, 16), (8192, 20), (16384, 32)):
        for dtype in ("fp32", "bf16"):
            chosen = (config.read_forward_variant(d, S, dtype),
                      *config.read_backward_variants(d, S, dtype))  # fmt: skip
            assert set(chosen) <= set(GRID)
            assert all(dict(v.constexprs).get("ALIGNED", True) for v in chosen)


_TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "i64": torch.int64,
          "i32": torch.int32}  # fmt: skip


@pytest.mark.parametrize("scalar", [1, 16])
def test_launches_compile_the_aot_signature(scalar):
    """Triton's JIT turns an integer argument equal to 1 into a constant and marks multiples of 16
    and 16-byte aligned pointers. Every scalar is annotated and in `do_not_specialize` (S = 1 made
    the first design's 43 KB/thread forward); every pointer a launch passes is aligned, so the
    binder marks each one "D" (tt.divisibility = 16) — exactly `aot.attributes`, what the AOT
    compile uses."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", 90, 32))
    for variant in GRID:
        fn = getattr(aot.compilable_kernels(), variant.kernel)
        sig, consts = aot.signature(variant)
        attrs = aot.attributes(variant)
        args = []
        for param in fn.params:
            if param.is_constexpr:
                continue
            kind = sig[param.name]
            if kind.startswith("*"):  # a fresh allocation: aligned
                args.append(torch.zeros(16, dtype=_TORCH[kind[1:]]))
            else:
                args.append(float(scalar) if kind.startswith("fp") else scalar)
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        _, specialization, _ = binder(*args, **consts)
        got = dict(zip(inspect.signature(fn.fn).parameters, specialization, strict=True))
        for index, (name, (kind, attribute)) in enumerate(got.items()):
            if kind == "constexpr":
                assert consts[name] == attribute, (variant.kernel, name)
            elif kind.startswith("*"):
                assert (kind, attribute) == (sig[name], "D"), (variant.kernel, name, attribute)
                assert attrs[(index,)] == [["tt.divisibility", 16]], (variant.kernel, name)
            else:
                assert (kind, attribute) == (sig[name], None), (variant.kernel, name, kind)
        assert len(attrs) == sum(k.startswith("*") for k in sig.values()), variant.kernel


def test_a_misaligned_tensor_is_refused_before_launch():
    """The launcher's side of the contract: a tensor at an address that is not 16-byte aligned
    never reaches a kernel compiled for aligned pointers."""
    from depthscale.kernels import attnres_triton_launch as launch

    variant = config.merge_forward_variant(64, "fp32", "fp32")
    odd = torch.zeros(17)[1:]
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        launch._launch(variant, 1, odd)
