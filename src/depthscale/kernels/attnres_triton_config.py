"""Which compiled variant of each AttnRes Triton kernel a launch uses: the one rule that the
launcher (`attnres_triton.py`) and the ahead-of-time compile test (`tests/unit/test_triton_aot.py`,
through `kernels/aot.py`) both call, so the test compiles exactly what a GPU would run.

A variant is (kernel, data dtype, S_PAD, BLOCK_N, BLOCK_D, ALIGNED, warps, stages) — never d, N or
m, which are runtime arguments: over d ∈ {1024 … 16384}, S ∈ 1…32 and two dtypes there are a few
dozen variants, each a small kernel that compiles in about a second.

Tile sizes (`_READ_TILES`, `_MERGE_FWD`, `_MERGE_BWD`) were chosen from ptxas's register counts
for sm_90a, and the AOT test holds every variant to them on sm_90a and sm_80: no local memory,
registers within the SM's budget. Every kernel loops over d in BLOCK_D columns; where S_PAD grows,
BLOCK_N (then BLOCK_D) shrinks so that the [S_PAD, BLOCK_N, BLOCK_D] tiles stay near 4–8 K fp32
elements per program. Parallelism comes from tokens × sources (logits) or tokens × d-chunks
(weighted sum, source gradients), not from BLOCK_N alone, so a read at S = 32 still fills the GPU.
Pure Python: no torch, no triton.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("fp32", "bf16", "fp16")
"""Triton names of the data dtypes the kernels take."""

_WARPS = 8

_STAGES = 1
"""Triton pipelines (through shared memory) only loads that feed `tl.dot`, which these kernels do
not use, so more stages would change nothing but the compile; latency is hidden by two or more
programs per SM and by the independent loads of each loop iteration."""

_MAX_REGISTERS = 128
"""Registers per thread, passed to ptxas as `.maxnreg`: two programs of 8 warps per SM. Without an
explicit cap ptxas trades a few bytes of spill for occupancy on its own (Triton 3.6, sm_80: 64
registers and 8 B of stack for the backward logits at S_PAD = 8, which need 90); with it ptxas
allocates what a tile needs up to the cap, and the AOT test proves every variant fits."""

ALIGN = 16
"""Bytes: the launcher gives the kernels only addresses this aligned (it copies a view at an odd
offset; fresh allocations always are), so ALIGNED — no column masks, vector loads — depends on d
alone: d a multiple of BLOCK_D, as every production d is."""


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class Variant:
    """One compiled variant: `kernel` names a `@triton.jit` function of `attnres_triton_jit`;
    `pointers` gives each pointer argument's Triton type (the others' types are their
    annotations); `constexprs` are passed by name at launch."""

    kernel: str
    pointers: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, int | bool], ...]
    num_warps: int
    num_stages: int = _STAGES
    max_registers: int = _MAX_REGISTERS
    meta: dict[str, int] = field(default_factory=dict, compare=False, hash=False)

    def compile_options(self) -> dict[str, int]:
        """What `triton.compile` takes besides the source, for the launch and the AOT compile."""
        return {
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
            "maxnreg": self.max_registers,
        }

    def launch_options(self) -> dict[str, int | bool]:
        return {**dict(self.constexprs), **self.compile_options()}

    def describe(self) -> str:
        """e.g. "_read_sum_kernel[ref=*bf16 S_PAD=4 BLOCK_N=16 BLOCK_D=128 ALIGNED=True w8 s2]"."""
        data = " ".join(f"{k}={v}" for k, v in self.pointers if not v.startswith(("*fp32", "*i64")))
        consts = " ".join(f"{k}={v}" for k, v in self.constexprs)
        return f"{self.kernel}[{data} {consts} w{self.num_warps} s{self.num_stages}]".replace(
            "[ ", "["
        )


def _check(S: int, dtype: str) -> int:
    if not 1 <= S <= 32:
        raise ValueError(f"the AttnRes Triton read takes 1 to 32 queries, got {S}")
    if dtype not in DTYPES:
        raise ValueError(f"the AttnRes Triton kernels take {'/'.join(DTYPES)}, got {dtype}")
    return next_power_of_2(S)


def _clamp(x: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, x))


def table_variant() -> Variant:
    return Variant("_write_table_kernel", (("table", "*i64"),), (), num_warps=1, num_stages=1)


_READ_TILES = {
    1: ((32, 64), (16, 128), (16, 64), (16, 64)),
    2: ((32, 64), (16, 128), (16, 32), (8, 64)),
    4: ((32, 32), (8, 128), (16, 32), (4, 64)),
    8: ((16, 64), (16, 64), (16, 16), (4, 64)),
    16: ((16, 32), (8, 64), (8, 16), (2, 64)),
    32: ((16, 16), (4, 64), (8, 8), (1, 64)),
}
"""S_PAD -> (BLOCK_N, BLOCK_D) of the read's logits, weighted sum, backward logits and source
gradients, at 8 warps. Chosen from ptxas's numbers (`python -m depthscale.kernels.aot`) with
Triton 3.6 and 3.9: tiles that keep every variant at or near 128 registers (two programs of 8
warps per SM) with no spills on sm_90a and sm_80 — ptxas picks 128 registers and a few bytes of
spill rather than 129+ when a tile is just too large (Triton 3.6, source gradients at S_PAD = 4
with BLOCK_N = 8, sm_80: 8 B), and larger tiles go to 255 (source gradients at S_PAD = 1 with
BLOCK_N = 64). Logits keep BLOCK_N ≥ 16 (each query chunk serves 16+ tokens, so query reloads stay
below the row bytes); the weighted sum keeps BLOCK_D ≥ 2·S_PAD (reloaded softmax weights stay
≤ ¼ of the row bytes)."""


def read_forward_variants(d: int, S: int, dtype: str) -> tuple[Variant, Variant]:
    """(logits, weighted sum) for S queries over sources of `dtype` and width d: grids tokens ×
    sources and tokens × d-chunks (`attnres_triton.py`)."""
    s_pad = _check(S, dtype)
    logits, weighted, _, _ = _READ_TILES[s_pad]
    return (
        _variant("_read_logits_kernel", dtype, s_pad, *logits, d),
        _variant("_read_sum_kernel", dtype, s_pad, *weighted, d),
    )


def read_backward_variants(d: int, S: int, dtype: str) -> tuple[Variant, Variant, Variant]:
    """(logits and upstream dots, softmax weights and g, source gradients): grids tokens × sources,
    tokens, and programs × d-chunks (`attnres_triton.py`)."""
    s_pad = _check(S, dtype)
    _, _, logits, grads = _READ_TILES[s_pad]
    weights_n = 512 // s_pad  # [S_PAD, BLOCK_N] tiles of 512: ≤ 64 registers at 4 warps
    weights = Variant(
        "_read_grad_weights_kernel",
        (("z_ptr", "*fp32"), ("p_ptr", "*fp32"), ("r_ptr", "*fp32"), ("lse_ptr", "*fp32"),
         ("dlse_ptr", "*fp32")),
        (("S_PAD", s_pad), ("BLOCK_N", weights_n)),
        num_warps=4,
        meta={"S_PAD": s_pad, "BLOCK_N": weights_n},
    )  # fmt: skip
    return (
        _variant("_read_grad_logits_kernel", dtype, s_pad, *logits, d),
        weights,
        _variant("_read_grad_sources_kernel", dtype, s_pad, *grads, d),
    )


_MERGE_FWD = (8, 128, 4)
_MERGE_BWD = (4, 128, 4)
"""(BLOCK_N, BLOCK_D, warps) of the merges (at 16 × 128 × 4 warps the backward needed 255 registers
and spilled; 8 × 256 fits sm_90a but spills 8 B on sm_80)."""


def merge_forward_variant(d: int, dtype: str, o_dtype: str) -> Variant:
    """The merge of a phase-1 output (`o_dtype`: the partial sum's dtype or fp32) with the partial
    sum (`dtype`): [BLOCK_N, BLOCK_D] tiles, two passes over d per token block."""
    _check(1, dtype)
    _check(1, o_dtype)
    pointers = (("o_ptr", f"*{o_dtype}"), ("lse_ptr", "*fp32"), ("p_ptr", f"*{dtype}"),
                ("w_ptr", "*fp32"), ("h_ptr", f"*{dtype}"))  # fmt: skip
    return _merge_variant("_merge_fwd_kernel", pointers, *_MERGE_FWD, d)


def merge_backward_variant(d: int, dtype: str, o_dtype: str) -> Variant:
    """The merge's backward: token blocks strided over a bounded grid (see `merge_programs`)."""
    _check(1, dtype)
    _check(1, o_dtype)
    pointers = (("o_ptr", f"*{o_dtype}"), ("lse_ptr", "*fp32"), ("p_ptr", f"*{dtype}"),
                ("w_ptr", "*fp32"), ("dh_ptr", f"*{dtype}"), ("up_ptr", f"*{dtype}"),
                ("do_ptr", f"*{o_dtype}"), ("dlse_ptr", "*fp32"), ("dp_ptr", f"*{dtype}"),
                ("dw_ptr", "*fp32"))  # fmt: skip
    return _merge_variant("_merge_bwd_kernel", pointers, *_MERGE_BWD, d)


def _merge_variant(kernel, pointers, block_n: int, block_d: int, warps: int, d: int) -> Variant:
    consts = (("BLOCK_N", block_n), ("BLOCK_D", block_d), ("ALIGNED", d % block_d == 0))
    return Variant(kernel, pointers, consts, warps, meta={"BLOCK_N": block_n, "BLOCK_D": block_d})


_POINTERS = {
    "_read_logits_kernel": ("w_ptr", "z_ptr"),
    "_read_sum_kernel": ("z_ptr", "lse_ptr"),
    "_read_grad_logits_kernel": ("w_ptr", "z_ptr", "p_ptr", "r_ptr"),
    "_read_grad_sources_kernel": ("w_ptr", "a_ptr", "g_ptr", "c_ptr", "dw_ptr"),
}
"""fp32 pointer arguments of the table-driven kernels (besides `table` and `ref`)."""


def _variant(kernel: str, dtype: str, s_pad: int, block_n: int, block_d: int, d: int) -> Variant:
    pointers = (("table", "*i64"), ("ref", f"*{dtype}"), *((p, "*fp32") for p in _POINTERS[kernel]))
    aligned = d % block_d == 0
    consts = (("S_PAD", s_pad), ("BLOCK_N", block_n), ("BLOCK_D", block_d), ("ALIGNED", aligned))
    return Variant(
        kernel, pointers, consts, num_warps=_WARPS, meta=dict(consts[:3]) | {"ALIGNED": aligned}
    )


def programs(work_items: int, sms: int, per_sm: int = 4) -> int:
    """Programs of a strided grid over `work_items`: enough to fill `sms` multiprocessors
    `per_sm` deep, never more than there is work."""
    return max(1, min(work_items, sms * per_sm))


def grid_variants(
    ds: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384),
    queries: tuple[int, ...] = tuple(range(1, 33)),
    dtypes: tuple[str, ...] = ("fp32", "bf16"),
) -> dict[Variant, tuple[int, int, str]]:
    """Every variant a launch can choose over the grid (for the merge, with the phase-1 output in
    the partial sum's dtype or fp32), each with the first (d, S, dtype) that chooses it: the set
    the AOT test compiles. Calls the functions the launcher calls."""
    found: dict[Variant, tuple[int, int, str]] = {table_variant(): (ds[0], 1, dtypes[0])}
    for dtype in dtypes:
        for d in ds:
            for S in queries:
                for v in (
                    *read_forward_variants(d, S, dtype),
                    *read_backward_variants(d, S, dtype),
                ):
                    found.setdefault(v, (d, S, dtype))
            for o_dtype in dict.fromkeys((dtype, "fp32")):
                for v in (merge_forward_variant(d, dtype, o_dtype),
                          merge_backward_variant(d, dtype, o_dtype)):  # fmt: skip
                    found.setdefault(v, (d, 1, dtype))
    return found
