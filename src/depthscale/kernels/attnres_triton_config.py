"""Which compiled variant of each AttnRes Triton kernel a launch uses: the one rule that the
launcher (`attnres_triton.py`) and the ahead-of-time compile test (`tests/unit/test_triton_aot.py`,
through `kernels/aot.py`) both call, so the test compiles exactly what a GPU would run.

A variant is (kernel, data dtype, S_PAD, BLOCK_N, BLOCK_D, ALIGNED, warps, stages) — never d, N or
m, which are runtime arguments: over d ∈ {1024 … 16384}, S ∈ 1…32 and two dtypes there are a few
dozen variants, each a small kernel that compiles in about a second.

Tile sizes (checked with ptxas for sm_80 and sm_90a by the AOT test: no local memory, registers
within the SM's budget): every kernel loops over d in BLOCK_D columns, and each program's largest
live tile, [S_PAD, BLOCK_N, BLOCK_D] fp32, is kept near `_TILE` elements, i.e. ~32 per thread at
8 warps; where S_PAD grows, BLOCK_N (then BLOCK_D) shrinks. Parallelism then comes from tokens ×
sources (logits) or tokens × d-chunks (weighted sum, source gradients), not from BLOCK_N, so a
read at S = 32 still fills the GPU. Pure Python: no torch, no triton.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("fp32", "bf16", "fp16")
"""Triton names of the data dtypes the kernels take."""

_TILE = 8192
"""Target fp32 elements of a program's largest live [S_PAD, BLOCK_N, BLOCK_D] tile."""

_WARPS = 8

_STAGES = 2
"""Software pipelining depth of the d-chunk loops (double buffering: the next chunk's loads are
issued while the current one is reduced)."""

ALIGN = 16
"""Bytes: addresses this aligned (and d a multiple of BLOCK_D) let loads vectorise (ALIGNED)."""


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
    meta: dict[str, int] = field(default_factory=dict, compare=False, hash=False)

    def launch_options(self) -> dict[str, int | bool]:
        return {**dict(self.constexprs), "num_warps": self.num_warps, "num_stages": self.num_stages}

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


def _aligned(addresses_aligned: bool, d: int, block_d: int) -> bool:
    return addresses_aligned and d % block_d == 0


def table_variant() -> Variant:
    return Variant("_write_table_kernel", (("table", "*i64"),), (), num_warps=1, num_stages=1)


def read_forward_variants(
    d: int, S: int, dtype: str, addresses_aligned: bool
) -> tuple[Variant, Variant]:
    """(logits, weighted sum) for S queries over sources of `dtype` and width d.

    Logits (grid: token blocks × sources): the [S_PAD, BLOCK_N, BLOCK_D] product of queries and
    rows; BLOCK_N stays ≥ 16 so that each d-chunk of the queries is reused by 16+ tokens.
    Weighted sum (grid: token blocks × d-chunks): the [S_PAD, BLOCK_N, BLOCK_D] accumulator;
    BLOCK_D ≥ 2·S_PAD keeps the softmax weights' reloads (S_PAD per token and source) below half
    the bytes of the rows they weigh."""
    s_pad = _check(S, dtype)
    logits_n = 32 if s_pad <= 4 else 16
    logits_d = _clamp(_TILE // (s_pad * logits_n), 16, 128)
    sum_d = 128 if s_pad <= 4 else 64
    sum_n = _clamp(_TILE // (s_pad * sum_d), 1, 64)
    return (
        _variant("_read_logits_kernel", dtype, s_pad, logits_n, logits_d, d, addresses_aligned),
        _variant("_read_sum_kernel", dtype, s_pad, sum_n, sum_d, d, addresses_aligned),
    )


def read_backward_variants(
    d: int, S: int, dtype: str, addresses_aligned: bool
) -> tuple[Variant, Variant, Variant]:
    """(logits and upstream dots, softmax weights and g, source gradients) — see
    `attnres_triton.py`. The first and last hold the upstream gradient tile [S_PAD, BLOCK_N,
    BLOCK_D] and two or three products of its size: half the forward's tile."""
    s_pad = _check(S, dtype)
    tile = _TILE // 2
    logits_n = 16 if s_pad <= 16 else 8
    logits_d = _clamp(tile // (s_pad * logits_n), 16, 128)
    sources_d = 64
    sources_n = _clamp(tile // (s_pad * sources_d), 1, 64)
    weights_n = _clamp(2048 // s_pad, 16, 256)
    weights = Variant(
        "_read_grad_weights_kernel",
        (("z_ptr", "*fp32"), ("p_ptr", "*fp32"), ("r_ptr", "*fp32"), ("lse_ptr", "*fp32"),
         ("dlse_ptr", "*fp32")),
        (("S_PAD", s_pad), ("BLOCK_N", weights_n)),
        num_warps=4,
        meta={"S_PAD": s_pad, "BLOCK_N": weights_n},
    )  # fmt: skip
    return (
        _variant(
            "_read_grad_logits_kernel", dtype, s_pad, logits_n, logits_d, d, addresses_aligned
        ),
        weights,
        _variant(
            "_read_grad_sources_kernel", dtype, s_pad, sources_n, sources_d, d, addresses_aligned
        ),
    )


_MERGE_N, _MERGE_D = 16, 128


def merge_forward_variant(d: int, dtype: str, o_dtype: str, addresses_aligned: bool) -> Variant:
    """The merge of a phase-1 output (`o_dtype`: the partial sum's dtype or fp32) with the partial
    sum (`dtype`): [BLOCK_N, BLOCK_D] tiles, two passes over d per token block."""
    _check(1, dtype)
    _check(1, o_dtype)
    aligned = _aligned(addresses_aligned, d, _MERGE_D)
    pointers = (("o_ptr", f"*{o_dtype}"), ("lse_ptr", "*fp32"), ("p_ptr", f"*{dtype}"),
                ("w_ptr", "*fp32"), ("h_ptr", f"*{dtype}"))  # fmt: skip
    return Variant(
        "_merge_fwd_kernel",
        pointers,
        (("BLOCK_N", _MERGE_N), ("BLOCK_D", _MERGE_D), ("ALIGNED", aligned)),
        num_warps=4,
        meta={"BLOCK_N": _MERGE_N, "BLOCK_D": _MERGE_D},
    )


def merge_backward_variant(d: int, dtype: str, o_dtype: str, addresses_aligned: bool) -> Variant:
    """The merge's backward: token blocks strided over a bounded grid (see `merge_programs`)."""
    _check(1, dtype)
    _check(1, o_dtype)
    aligned = _aligned(addresses_aligned, d, _MERGE_D)
    pointers = (("o_ptr", f"*{o_dtype}"), ("lse_ptr", "*fp32"), ("p_ptr", f"*{dtype}"),
                ("w_ptr", "*fp32"), ("dh_ptr", f"*{dtype}"), ("up_ptr", f"*{dtype}"),
                ("do_ptr", f"*{o_dtype}"), ("dlse_ptr", "*fp32"), ("dp_ptr", f"*{dtype}"),
                ("dw_ptr", "*fp32"))  # fmt: skip
    return Variant(
        "_merge_bwd_kernel",
        pointers,
        (("BLOCK_N", _MERGE_N), ("BLOCK_D", _MERGE_D), ("ALIGNED", aligned)),
        num_warps=4,
        meta={"BLOCK_N": _MERGE_N, "BLOCK_D": _MERGE_D},
    )


_POINTERS = {
    "_read_logits_kernel": ("w_ptr", "z_ptr"),
    "_read_sum_kernel": ("z_ptr", "lse_ptr"),
    "_read_grad_logits_kernel": ("w_ptr", "z_ptr", "p_ptr", "r_ptr"),
    "_read_grad_sources_kernel": ("w_ptr", "a_ptr", "g_ptr", "c_ptr", "dw_ptr"),
}
"""fp32 pointer arguments of the table-driven kernels (besides `table` and `ref`)."""


def _variant(
    kernel: str, dtype: str, s_pad: int, block_n: int, block_d: int, d: int, addresses_aligned: bool
) -> Variant:
    pointers = (("table", "*i64"), ("ref", f"*{dtype}"), *((p, "*fp32") for p in _POINTERS[kernel]))
    aligned = _aligned(addresses_aligned, d, block_d)
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
    """Every variant a launch can choose over the grid (both address alignments; for the merge,
    the phase-1 output in the partial sum's dtype or fp32), each with the first (d, S, dtype) that
    chooses it: the set the AOT test compiles."""
    found: dict[Variant, tuple[int, int, str]] = {table_variant(): (ds[0], 1, dtypes[0])}
    for dtype in dtypes:
        for d in ds:
            for aligned in (True, False):
                for S in queries:
                    for v in (*read_forward_variants(d, S, dtype, aligned),
                              *read_backward_variants(d, S, dtype, aligned)):  # fmt: skip
                        found.setdefault(v, (d, S, dtype))
                for o_dtype in dict.fromkeys((dtype, "fp32")):
                    for v in (merge_forward_variant(d, dtype, o_dtype, aligned),
                              merge_backward_variant(d, dtype, o_dtype, aligned)):  # fmt: skip
                        found.setdefault(v, (d, 1, dtype))
    return found
