"""Which compiled variant of each AttnRes Triton kernel a launch uses: the one rule that the
launcher (`attnres_triton.py`) and the ahead-of-time compile test (`tests/unit/test_triton_aot.py`,
through `kernels/aot.py`) both call, so the test compiles exactly what a GPU would run.

A variant is (kernel, data dtype, S_PAD, BLOCK_N, BLOCK_D, ALIGNED, warps, stages) — never d, N or
m, which are runtime arguments: over d ∈ {1024 … 16384}, S ∈ 1…32 and two dtypes there are a few
dozen variants, each a small kernel that compiles in about a second. (The backward's tokens per block,
picked by its launch plan from m, S and d, are a runtime argument too.)

Tile sizes (`_FORWARD_TILES`, `_BACKWARD_TILES`, `_MERGE_FWD`, `_MERGE_BWD`) were chosen from
ptxas's register counts and the PTX's access widths, and the AOT test holds every variant to them
on sm_90a and sm_80: no local memory, registers below the cap, 64-bit or wider vector accesses for
tensor data. Every kernel loops over d in BLOCK_D columns with source tiles of ≥ 4 elements per
thread; tiles that would grow with S are split (query groups, one upstream gradient at a time, fp32
`tl.dot` for the query contractions). The launch plans (`read_forward_launch`,
`read_backward_launch`) are the launcher's and the traffic model's (`benchmarks/attnres_traffic.py`).
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
        """e.g. "_merge_fwd_kernel[o_ptr=*bf16 p_ptr=*bf16 h_ptr=*bf16 BLOCK_N=8 ... w4 s1]"."""
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


_FORWARD_TILES = {
    1: (16, 128, 1, 16, 128),
    2: (16, 128, 2, 16, 128),
    4: (16, 64, 2, 8, 128),
    8: (16, 64, 2, 8, 128),
    16: (16, 64, 2, 8, 128),
    32: (16, 64, 2, 8, 128),
}
"""S_PAD -> (BLOCK_N, LOGIT_D, SUM_Q, SUM_N, SUM_D) of `_read_forward_kernel` at 8 warps: token
blocks of 16 (each query chunk loaded by a logits item serves 16 tokens, so query reloads — from
L1/L2 — stay within a few times the row bytes at S = 32); logits tiles [16, LOGIT_D] of sources
(from S_PAD = 16 on an fp32 `tl.dot` with the [S_PAD, LOGIT_D] queries); weighted-sum tiles
[SUM_N, SUM_D] of ≥ 1024 source elements (≥ 4 per thread: 64- or 128-bit loads) with a
[SUM_Q, SUM_N, SUM_D] accumulator of ≤ 8 K fp32 (≤ 32 registers), query groups of SUM_Q re-reading
the chunk from L1/L2. Registers and load widths are read from ptxas and the PTX by the AOT test."""

LOGIT_PART = 512
"""Columns of one logits item: small items keep the reuse distance — the bytes the GPU reads
between a logits item's read of a source chunk and the weighted-sum item's re-read of it — to
about (resident programs) × 16 tokens × 2·LOGIT_PART bytes + two token blocks' rows, within half
of an H100's L2 at every modelled shape (`benchmarks/attnres_traffic.py`); each part costs
4·(S_PAD + 1) bytes of scratch per token and source (≤ 13 % of the row bytes at S = 32)."""


@dataclass(frozen=True)
class ReadForwardLaunch:
    """The launch of `_read_forward_kernel` for N tokens: the one place its grid and work items
    are computed (the launcher and `benchmarks/attnres_traffic.py` both call
    `read_forward_launch`)."""

    variant: Variant
    N: int
    d: int
    m: int
    S: int
    n_blocks: int
    part: int
    n_parts: int
    n_chunks: int

    @property
    def items_per_block(self) -> int:
        return self.m * self.n_parts + self.n_chunks

    @property
    def grid(self) -> int:
        return self.n_blocks * self.items_per_block


def read_forward_variant(d: int, S: int, dtype: str) -> Variant:
    """The one-launch read (`_read_forward_kernel`) for S queries over sources of `dtype`, width d."""
    s_pad = _check(S, dtype)
    block_n, logit_d, sum_q, sum_n, sum_d = _FORWARD_TILES[s_pad]
    aligned = d % max(logit_d, sum_d) == 0
    consts = (("S_PAD", s_pad), ("BLOCK_N", block_n), ("LOGIT_D", logit_d), ("SUM_Q", sum_q),
              ("SUM_N", sum_n), ("SUM_D", sum_d), ("ALIGNED", aligned))  # fmt: skip
    pointers = (("table", "*i64"), ("ref", f"*{dtype}"), ("w_ptr", "*fp32"), ("dot_ptr", "*fp32"),
                ("sq_ptr", "*fp32"), ("z_ptr", "*fp32"), ("lse_ptr", "*fp32"),
                ("sync_ptr", "*i32"))  # fmt: skip
    return Variant("_read_forward_kernel", pointers, consts, num_warps=_WARPS, meta=dict(consts))


def read_forward_launch(N: int, d: int, m: int, S: int, dtype: str) -> ReadForwardLaunch:
    variant = read_forward_variant(d, S, dtype)
    meta = variant.meta
    return ReadForwardLaunch(
        variant=variant, N=N, d=d, m=m, S=S,
        n_blocks=-(-N // meta["BLOCK_N"]),
        part=LOGIT_PART,
        n_parts=-(-d // LOGIT_PART),
        n_chunks=-(-d // meta["SUM_D"]),
    )  # fmt: skip


_BACKWARD_TILES = {
    1: (128, 128),
    2: (128, 128),
    4: (64, 64),
    8: (64, 64),
    16: (64, 64),
    32: (64, 64),
}
"""S_PAD -> (LOGIT_D, GRAD_D) of `_read_backward_kernel`'s [16, LOGIT_D] logits and [16, GRAD_D]
gradient tiles at 8 warps: ≥ 1024 elements (≥ 4 per thread: vector loads) of 16 (source, token)
rows, whatever the block's tokens; the upstream gradients are walked one query at a time, so no
tile grows with S; the query contractions are fp32 `tl.dot`s from S_PAD = 16 (logits) and 4
(gradients, 16 zero-padded rows). Registers below the cap on sm_90a and sm_80 (the AOT test)."""

BACKWARD_BLOCKS = (16, 4, 1)
"""Tokens per backward token block, largest first: 16 // tokens sources share a 16-row tile."""

BACKWARD_BLOCK_BYTES = 2**20
"""A backward token block's HBM bytes (its sources and upstream gradients read, its source
gradients written: tokens × (2m + S) × d × element) stay within this: the block's bytes must
survive in L2 from its logits items' reads to its gradient items' re-reads, alongside the blocks
in flight beside it — up to 1 + ⌈resident programs / items per block⌉ blocks
(`benchmarks/attnres_traffic.py`: ≤ 25 MB, half of an H100's 50 MB L2, at every modelled shape
even with 8 programs per SM). 16 tokens where they fit, else 4, else 1 (16 sources share the
tile's rows: with fewer sources some rows are masked — compute, not traffic)."""

DW_LANE_SPACING = 8 * 2**20
"""HBM bytes between two token blocks of one dw lane: the gradient item of block b adds its dw
share to lane b mod n_lanes after block b − n_lanes's item of the same chunk (a chain, so the sum
is in a fixed order: deterministic), so enough lanes that the item it waits for ran ≥ 8 MiB of
traffic (≈ 2.5 µs at 3.35 TB/s) earlier, far longer than one link (an L2 read, add and write of
[S_PAD, GRAD_D] fp32 and a release); at most 64 lanes."""

_MAX_LANES = 64


def read_backward_variant(d: int, S: int, dtype: str) -> Variant:
    """The one-launch read backward (`_read_backward_kernel`) for S queries over sources of
    `dtype`, width d (its tokens per block, one of `BACKWARD_BLOCKS`, a runtime argument)."""
    s_pad = _check(S, dtype)
    logit_d, grad_d = _BACKWARD_TILES[s_pad]
    aligned = d % max(logit_d, grad_d) == 0
    dw_rows = max(s_pad, 16) if s_pad >= 4 else s_pad
    consts = (("S_PAD", s_pad), ("DW_ROWS", dw_rows), ("LOGIT_D", logit_d), ("GRAD_D", grad_d),
              ("ALIGNED", aligned))  # fmt: skip
    pointers = (("table", "*i64"), ("ref", f"*{dtype}"), ("w_ptr", "*fp32"), ("lse_ptr", "*fp32"),
                ("dlse_ptr", "*fp32"), ("part_ptr", "*fp32"), ("wt_ptr", "*fp32"),
                ("lane_ptr", "*fp32"), ("sync_ptr", "*i32"))  # fmt: skip
    return Variant("_read_backward_kernel", pointers, consts, num_warps=_WARPS, meta=dict(consts))


def read_backward_variants(d: int, S: int, dtype: str) -> tuple[Variant, ...]:
    """Every backward variant a read of S queries at width d can launch: one, whatever the block
    size (a runtime argument: three compiled block sizes tripled the AOT test's compiles)."""
    return (read_backward_variant(d, S, dtype),)


@dataclass(frozen=True)
class ReadBackwardLaunch:
    """The launch of `_read_backward_kernel` for N tokens (`read_backward_launch`, called by the
    launcher and `benchmarks/attnres_traffic.py`): per token block of `block_n` tokens, in ticket
    order, n_groups · n_parts logits items (part-major: the groups reading one part's upstream
    gradients are neighbours) then n_chunks gradient items; dw summed in n_lanes lanes."""

    variant: Variant
    N: int
    d: int
    m: int
    S: int
    block_n: int
    n_blocks: int
    part: int
    n_parts: int
    n_groups: int
    n_chunks: int
    n_lanes: int
    element: int

    @property
    def block_bytes(self) -> int:
        """HBM bytes of one token block: sources and upstream gradients read, gradients written."""
        return self.block_n * (2 * self.m + self.S) * self.d * self.element

    @property
    def items_per_block(self) -> int:
        return self.n_groups * self.n_parts + self.n_chunks

    @property
    def grid(self) -> int:
        return self.n_blocks * self.items_per_block


ELEMENT = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes per element of each data dtype."""


def read_backward_launch(N: int, d: int, m: int, S: int, dtype: str) -> ReadBackwardLaunch:
    row = (2 * m + S) * d * ELEMENT[dtype]
    block_n = next((b for b in BACKWARD_BLOCKS if b * row <= BACKWARD_BLOCK_BYTES),
                   BACKWARD_BLOCKS[-1])  # fmt: skip
    variant = read_backward_variant(d, S, dtype)
    n_lanes = _clamp(-(-DW_LANE_SPACING // (block_n * row)), 1, _MAX_LANES)
    n_blocks = -(-N // block_n)
    return ReadBackwardLaunch(
        variant=variant, N=N, d=d, m=m, S=S, block_n=block_n, n_blocks=n_blocks,
        part=LOGIT_PART, n_parts=-(-d // LOGIT_PART), n_groups=-(-m // (16 // block_n)),
        n_chunks=-(-d // variant.meta["GRAD_D"]), n_lanes=min(n_lanes, n_blocks),
        element=ELEMENT[dtype],
    )  # fmt: skip


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
                for v in (read_forward_variant(d, S, dtype), *read_backward_variants(d, S, dtype)):
                    found.setdefault(v, (d, S, dtype))
            for o_dtype in dict.fromkeys((dtype, "fp32")):
                for v in (merge_forward_variant(d, dtype, o_dtype),
                          merge_backward_variant(d, dtype, o_dtype)):  # fmt: skip
                    found.setdefault(v, (d, 1, dtype))
    return found
