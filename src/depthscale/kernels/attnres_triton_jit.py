"""The AttnRes Triton kernels themselves (`@triton.jit` only: this module imports triton and nothing
else, so `kernels/aot.py` can load a fresh copy of it outside the interpreter and compile it ahead
of time). The design, the math and the launch rules are in `attnres_triton.py` and
`attnres_triton_config.py`.

Conventions shared by every kernel:
- d is chunked: a program loops over d in BLOCK_D columns, so no tile holds a whole row and d is a
  runtime argument (one compiled variant serves every d).
- Every scalar argument is typed by annotation and listed in `do_not_specialize`: Triton's JIT
  then neither turns a 1 into a constant nor marks a multiple of 16 (the first design's 3-minute,
  43 KB/thread forward at d = 8192, S = 1 was Triton 3.6 compiling S = 1 into the kernel). Pointer
  arguments are specialised, as the JIT does by default: the launcher passes only 16-byte aligned
  tensors (`attnres_triton_launch.aligned`, checked at every launch), so every launch compiles the
  one signature `aot.py` compiles (`aot.signature`: pointers with tt.divisibility = 16).
- Alignment is proved, not hinted: the address table's entries get `tl.multiple_of` on the loaded
  value, and d is rewritten as `d // 16 * 16` under ALIGNED (`_aligned`), so row offsets are
  provably multiples of 16 bytes and every aligned load and store is a vector access (the AOT test
  reads the PTX). ALIGNED itself means d is a multiple of every BLOCK_D of the variant (no column
  masks).
- Sources, outputs and gradients are reached through an int64 address table on the device (see
  `_write_table_kernel`); `ref` is a pointer argument of their dtype, used only for its type.
- Arithmetic is fp32; results are stored in their tensors' dtypes.
- Scratch tensors hold per-token scalars (logits, softmax weights, ...) between programs, padded
  to S_PAD queries (no load needs a query mask) and to rows of zn = N rounded up to 16 (aligned);
  their offsets are int32 (the launcher refuses scratch past 2^31 elements), row offsets int64.
"""

from __future__ import annotations

import triton
import triton.language as tl

TABLE_SLOTS = 16
"""Addresses `_write_table_kernel` writes per launch."""

_TABLE_RUNTIME = ["start", "n", *(f"a{j}" for j in range(TABLE_SLOTS))]


@triton.jit(do_not_specialize=_TABLE_RUNTIME)
def _write_table_kernel(table, start: tl.int32, n: tl.int32,
                        a0: tl.int64, a1: tl.int64, a2: tl.int64, a3: tl.int64,
                        a4: tl.int64, a5: tl.int64, a6: tl.int64, a7: tl.int64,
                        a8: tl.int64, a9: tl.int64, a10: tl.int64, a11: tl.int64,
                        a12: tl.int64, a13: tl.int64, a14: tl.int64, a15: tl.int64):  # fmt: skip
    """table[start + j] = a_j for j < n. The addresses are kernel arguments, passed by value: a CUDA
    graph captures them in its launch node (they are the graph's static addresses), so a replay
    rebuilds the same table, with no host memory involved (a pinned buffer copied to the device
    would be read again at every replay, long after it was freed or reused)."""
    row = table + start
    tl.store(row + 0, a0, mask=n > 0)
    tl.store(row + 1, a1, mask=n > 1)
    tl.store(row + 2, a2, mask=n > 2)
    tl.store(row + 3, a3, mask=n > 3)
    tl.store(row + 4, a4, mask=n > 4)
    tl.store(row + 5, a5, mask=n > 5)
    tl.store(row + 6, a6, mask=n > 6)
    tl.store(row + 7, a7, mask=n > 7)
    tl.store(row + 8, a8, mask=n > 8)
    tl.store(row + 9, a9, mask=n > 9)
    tl.store(row + 10, a10, mask=n > 10)
    tl.store(row + 11, a11, mask=n > 11)
    tl.store(row + 12, a12, mask=n > 12)
    tl.store(row + 13, a13, mask=n > 13)
    tl.store(row + 14, a14, mask=n > 14)
    tl.store(row + 15, a15, mask=n > 15)


@triton.jit
def _aligned(x, MULTIPLE: tl.constexpr, ALIGNED: tl.constexpr):
    """x, which under ALIGNED the launcher guarantees is a multiple of MULTIPLE, rewritten so that
    Triton's alignment analysis proves it: `x // M * M` is divisible by M, while `tl.multiple_of`
    on a scalar argument carries nothing (it annotates an op, and an argument has none). Row
    offsets `rows * d` then are multiples of 16 bytes and loads and stores vectorise."""
    if ALIGNED:
        x = x // MULTIPLE * MULTIPLE
    return x


@triton.jit
def _address(table, j, ref):
    """Entry j of the address table as a pointer of ref's type. Every address the launcher puts
    in a table is 16-byte aligned (`attnres_triton_launch.aligned`), and `tl.multiple_of` on the
    loaded value (an op, unlike an argument) says so to the alignment analysis."""
    return tl.multiple_of(tl.load(table + j).to(ref.dtype), 16)


@triton.jit
def _addresses(table, j0, qs, count, ref):
    """Entries j0 + qs (qs < count; 0 beyond) as a vector of pointers of ref's type (16-byte
    aligned, as `_address`), and which are not 0 (an absent tensor)."""
    base = tl.load(table + j0 + qs, mask=qs < count, other=0)
    present = base != 0
    return tl.multiple_of(base.to(ref.dtype), 16), present


@triton.jit
def _rows_tile(base, row_off, row_ok, cols, d, ALIGNED: tl.constexpr):
    """[BLOCK_N, BLOCK_D] fp32 tile of a row-major [N, d] tensor at `base`."""
    if ALIGNED:
        mask = row_ok[:, None]
    else:
        mask = row_ok[:, None] & (cols[None, :] < d)
    return tl.load(base + row_off[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _queries_tile(bases, base_ok, row_off, row_ok, cols, d, ALIGNED: tl.constexpr):
    """[S_PAD, BLOCK_N, BLOCK_D] fp32 tile of S tensors [N, d] at `bases` (zeros where not
    base_ok: an absent upstream gradient counts as zero)."""
    mask = base_ok[:, None, None] & row_ok[None, :, None]
    if not ALIGNED:
        mask = mask & (cols[None, None, :] < d)
    offsets = row_off[None, :, None] + cols[None, None, :]
    return tl.load(bases[:, None, None] + offsets, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _scratch(ptr, at, ok):
    """fp32 scratch written by another program of the same launch: `.cg` reads through L2 only (an
    SM's L1 may hold a stale copy of the line from a neighbouring token block's read)."""
    return tl.load(ptr + at, mask=ok, other=0.0, cache_modifier=".cg")


@triton.jit
def _query_dots(w_ptr, v, qs, cols, d, dot, S_PAD: tl.constexpr, ALIGNED: tl.constexpr):
    """dot + w·vᵀ: [S_PAD, BLOCK_N] query dots of a [BLOCK_N, BLOCK_D] source tile, from S_PAD = 16
    an fp32 FMA `tl.dot` (no [S_PAD, BLOCK_N, BLOCK_D] product in registers). Forward and
    backward (`attnres_triton_jit_backward`) alike."""
    if ALIGNED:
        w = tl.load(w_ptr + qs[:, None] * d + cols[None, :], eviction_policy="evict_last")
    else:
        w = tl.load(
            w_ptr + qs[:, None] * d + cols[None, :],
            mask=cols[None, :] < d,
            other=0.0,
            eviction_policy="evict_last",
        )
    if S_PAD >= 16:
        dot = tl.dot(w, tl.trans(v), dot, input_precision="ieee")
    else:
        dot += tl.sum(w[:, None, :] * v[None, :, :], axis=2)
    return dot


# ---------------------------------------------------------------------------------------------
# Phase-1 read, forward: one launch whose programs take work items in ticket order (see
# `_read_forward_kernel`).

_READ_FORWARD_RUNTIME = ["N", "zn", "d", "m", "S", "part", "n_parts", "n_chunks", "n_blocks",
                         "eps"]  # fmt: skip


@triton.jit(do_not_specialize=_READ_FORWARD_RUNTIME)
def _read_forward_kernel(table, ref, w_ptr, dot_ptr, sq_ptr, z_ptr, lse_ptr, sync_ptr,
                         N: tl.int32, zn: tl.int32, d: tl.int32, m: tl.int32, S: tl.int32,
                         part: tl.int32, n_parts: tl.int32, n_chunks: tl.int32,
                         n_blocks: tl.int32, eps: tl.float32, S_PAD: tl.constexpr,
                         BLOCK_N: tl.constexpr, LOGIT_D: tl.constexpr, SUM_Q: tl.constexpr,
                         SUM_N: tl.constexpr, SUM_D: tl.constexpr,
                         ALIGNED: tl.constexpr):  # fmt: skip
    """out_s = Σ_i softmax_i(z_si) v_i and lse_s for BLOCK_N-token blocks, each source row read
    from HBM once. A program takes a ticket (an atomic counter: the order programs start in) and
    the ticket names its work item; token block b's items are, in ticket order:
    - m · n_parts logits items (source i, columns [k·part, (k+1)·part)): partial dots with the
      queries and partial sums of squares into the [n_parts, m, S_PAD | 1, zn] scratch; the last
      to arrive (an acq_rel counter per block) sums the parts in order k = 0, 1, … (deterministic,
      whatever the arrival order), writes z and lse, and sets the block's ready flag (release);
    - n_chunks weighted-sum items (SUM_D columns each): wait for the flag (acquire), then stream
      Σ_i exp(z_si − lse_s) v_i over the chunk — the source bytes the logits items read moments
      before, still in L2 (a block's items are adjacent tickets; `benchmarks/attnres_traffic.py`
      models the reuse distance).
    A program waits only on items of smaller tickets, which have started (they took their tickets)
    and wait on nothing, so the launch cannot deadlock however many programs are resident.
    Table: m sources, then S outputs. w: [S_PAD, d] fp32, zero-padded. sync: int32 zeros
    [1 + 2·n_blocks] (ticket counter, arrivals, ready flags)."""
    ticket = tl.atomic_add(sync_ptr, 1)
    n_logits = m * n_parts
    items = n_logits + n_chunks
    block = ticket // items
    j = ticket % items
    d = _aligned(d, 16, ALIGNED)
    zn = _aligned(zn, 16, True)
    if j < n_logits:
        _logits_part(table, ref, w_ptr, dot_ptr, sq_ptr, block, j // n_parts, j % n_parts, N, zn,
                     d, m, _aligned(part, LOGIT_D, True), S_PAD, BLOCK_N, LOGIT_D, ALIGNED)  # fmt: skip
        tl.debug_barrier()  # every thread's partials stored before the release below
        if tl.atomic_add(sync_ptr + 1 + block, 1, sem="acq_rel") == n_logits - 1:
            _logits_finish(dot_ptr, sq_ptr, z_ptr, lse_ptr, block, N, zn, d, m, S, n_parts, eps,
                           S_PAD, BLOCK_N)  # fmt: skip
            tl.debug_barrier()
            tl.atomic_xchg(sync_ptr + 1 + n_blocks + block, 1, sem="release")
    else:
        while tl.atomic_add(sync_ptr + 1 + n_blocks + block, 0, sem="acquire") == 0:
            pass
        _weighted_sum(table, ref, z_ptr, lse_ptr, block, j - n_logits, N, zn, d, m, S, S_PAD,
                      BLOCK_N, SUM_Q, SUM_N, SUM_D, ALIGNED)  # fmt: skip


@triton.jit
def _logits_part(table, ref, w_ptr, dot_ptr, sq_ptr, block, i, k, N, zn, d, m, part,
                 S_PAD: tl.constexpr, BLOCK_N: tl.constexpr, LOGIT_D: tl.constexpr,
                 ALIGNED: tl.constexpr):  # fmt: skip
    """Partial v_i · w_s and Σ v_i² of BLOCK_N tokens over columns [k·part, (k+1)·part)."""
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    row_off = rows.to(tl.int64) * d
    qs = tl.arange(0, S_PAD)
    base = _address(table, i, ref)
    dot = tl.zeros((S_PAD, BLOCK_N), tl.float32)
    sq = tl.zeros((BLOCK_N,), tl.float32)
    start = k * part
    for c in range(start, tl.minimum(start + part, d), LOGIT_D):
        cols = c + tl.arange(0, LOGIT_D)
        v = _rows_tile(base, row_off, row_ok, cols, d, ALIGNED)
        dot = _query_dots(w_ptr, v, qs, cols, d, dot, S_PAD, ALIGNED)
        sq += tl.sum(v * v, axis=1)
    slot = k * m + i
    tl.store(
        dot_ptr + (slot * S_PAD + qs[:, None]) * zn + rows[None, :],
        dot,
        mask=row_ok[None, :],
        cache_modifier=".cg",
    )
    tl.store(sq_ptr + slot * zn + rows, sq, mask=row_ok, cache_modifier=".cg")


@triton.jit
def _logits_finish(dot_ptr, sq_ptr, z_ptr, lse_ptr, block, N, zn, d, m, S, n_parts, eps,
                   S_PAD: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """z_si = r_i (v_i · w_s) from the parts (summed in part order) and lse_s = logsumexp_i z_si
    (an online maximum over sources) for one token block."""
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    qs = tl.arange(0, S_PAD)
    at = qs[:, None] * zn + rows[None, :]
    top = tl.full((S_PAD, BLOCK_N), float("-inf"), tl.float32)
    total = tl.zeros((S_PAD, BLOCK_N), tl.float32)
    for i in range(m):
        dot = tl.zeros((S_PAD, BLOCK_N), tl.float32)
        sq = tl.zeros((BLOCK_N,), tl.float32)
        for k in range(n_parts):
            slot = k * m + i
            dot += _scratch(dot_ptr + slot * S_PAD * zn, at, row_ok[None, :])
            sq += _scratch(sq_ptr + slot * zn, rows, row_ok)
        z = dot * tl.rsqrt(sq / d + eps)[None, :]
        tl.store(z_ptr + i * S_PAD * zn + at, z, mask=row_ok[None, :], cache_modifier=".cg")
        new_top = tl.maximum(top, z)
        total = total * tl.exp(top - new_top) + tl.exp(z - new_top)
        top = new_top
    lse = top + tl.log(total)
    tl.store(lse_ptr + qs[:, None].to(tl.int64) * N + rows[None, :], lse,
             mask=(qs[:, None] < S) & row_ok[None, :], cache_modifier=".cg")  # fmt: skip


@triton.jit
def _weighted_sum(table, ref, z_ptr, lse_ptr, block, chunk, N, zn, d, m, S, S_PAD: tl.constexpr,
                  BLOCK_N: tl.constexpr, SUM_Q: tl.constexpr, SUM_N: tl.constexpr,
                  SUM_D: tl.constexpr, ALIGNED: tl.constexpr):  # fmt: skip
    """out_s[rows, chunk] = Σ_i exp(z_si − lse_s) v_i[rows, chunk] for the block's tokens, SUM_N
    tokens and SUM_Q queries at a time: the [SUM_Q, SUM_N, SUM_D] accumulator bounds the registers
    while the [SUM_N, SUM_D] source tile stays ≥ 4 elements per thread (vector loads); query
    groups after the first re-read the chunk from L1/L2, not HBM."""
    cols = chunk * SUM_D + tl.arange(0, SUM_D)
    for q0 in range(0, S_PAD, SUM_Q):
        qs = q0 + tl.arange(0, SUM_Q)
        outs, _ = _addresses(table, m, qs, S, ref)
        for sub in range(0, BLOCK_N, SUM_N):
            rows = block * BLOCK_N + sub + tl.arange(0, SUM_N)
            row_ok = rows < N
            row_off = rows.to(tl.int64) * d
            at = qs[:, None] * zn + rows[None, :]
            lse = _scratch(lse_ptr + qs[:, None].to(tl.int64) * N, rows[None, :],
                           (qs[:, None] < S) & row_ok[None, :])  # fmt: skip
            acc = tl.zeros((SUM_Q, SUM_N, SUM_D), tl.float32)
            for i in range(m):
                a = tl.exp(_scratch(z_ptr + i * S_PAD * zn, at, row_ok[None, :]) - lse)
                v = _rows_tile(_address(table, i, ref), row_off, row_ok, cols, d, ALIGNED)
                acc += a[:, :, None] * v[None, :, :]
            mask = (qs[:, None, None] < S) & row_ok[None, :, None]
            if not ALIGNED:
                mask = mask & (cols[None, None, :] < d)
            offsets = row_off[None, :, None] + cols[None, None, :]
            tl.store(outs[:, None, None] + offsets, acc.to(ref.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# Phase-2 merge: h = α o + β p, α = softmax weight of the phase-1 result (logit lse), β = 1 − α of
# the partial sum (logit z = r (p · w)).


@triton.jit
def _merge_logit(p_ptr, w_ptr, row_off, row_ok, d, eps, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, ALIGNED: tl.constexpr):  # fmt: skip
    """z and r of the partial sum's rows: one pass over d."""
    dot = tl.zeros((BLOCK_N,), tl.float32)
    sq = tl.zeros((BLOCK_N,), tl.float32)
    for k in range(0, d, BLOCK_D):
        cols = k + tl.arange(0, BLOCK_D)
        p = _rows_tile(p_ptr, row_off, row_ok, cols, d, ALIGNED)
        if ALIGNED:
            w = tl.load(w_ptr + cols, eviction_policy="evict_last")
        else:
            w = tl.load(w_ptr + cols, mask=cols < d, other=0.0, eviction_policy="evict_last")
        dot += tl.sum(p * w[None, :], axis=1)
        sq += tl.sum(p * p, axis=1)
    r = tl.rsqrt(sq / d + eps)
    return dot * r, r


_MERGE_FWD_RUNTIME = ["N", "d", "eps"]


@triton.jit(do_not_specialize=_MERGE_FWD_RUNTIME)
def _merge_fwd_kernel(o_ptr, lse_ptr, p_ptr, w_ptr, h_ptr, N: tl.int32, d: tl.int32,
                      eps: tl.float32, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                      ALIGNED: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    d = _aligned(d, 16, ALIGNED)
    row_off = rows.to(tl.int64) * d
    z, r = _merge_logit(p_ptr, w_ptr, row_off, row_ok, d, eps, BLOCK_N, BLOCK_D, ALIGNED)
    lse = _scratch(lse_ptr, rows, row_ok)
    top = tl.maximum(lse, z)
    a_o = tl.exp(lse - top)
    a_p = tl.exp(z - top)
    alpha = a_o / (a_o + a_p)
    beta = a_p / (a_o + a_p)
    for k in range(0, d, BLOCK_D):
        cols = k + tl.arange(0, BLOCK_D)
        o = _rows_tile(o_ptr, row_off, row_ok, cols, d, ALIGNED)
        p = _rows_tile(p_ptr, row_off, row_ok, cols, d, ALIGNED)
        h = alpha[:, None] * o + beta[:, None] * p
        if ALIGNED:
            mask = row_ok[:, None]
        else:
            mask = row_ok[:, None] & (cols[None, :] < d)
        tl.store(h_ptr + row_off[:, None] + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)


_MERGE_BWD_RUNTIME = ["N", "d", "eps", "has_up", "n_blocks", "n_progs"]


@triton.jit(do_not_specialize=_MERGE_BWD_RUNTIME)
def _merge_bwd_kernel(o_ptr, lse_ptr, p_ptr, w_ptr, dh_ptr, up_ptr, do_ptr, dlse_ptr, dp_ptr,
                      dw_ptr, N: tl.int32, d: tl.int32, eps: tl.float32, has_up: tl.int32,
                      n_blocks: tl.int32, n_progs: tl.int32, BLOCK_N: tl.constexpr,
                      BLOCK_D: tl.constexpr, ALIGNED: tl.constexpr):  # fmt: skip
    """Token blocks pid + k·n_progs: pass 1 over d for the per-token scalars, pass 2 for d_o, d_p
    (+ the chained gradient up when has_up) and the program's row of the [n_progs, d] dw partials
    (accumulated in place by this program alone: deterministic, bounded)."""
    prog = tl.program_id(0)
    d = _aligned(d, 16, ALIGNED)
    dw_row = dw_ptr + prog * d
    for k in range(0, d, BLOCK_D):
        cols = k + tl.arange(0, BLOCK_D)
        if ALIGNED:
            tl.store(dw_row + cols, tl.zeros((BLOCK_D,), tl.float32), cache_modifier=".cg")
        else:
            tl.store(
                dw_row + cols, tl.zeros((BLOCK_D,), tl.float32), mask=cols < d, cache_modifier=".cg"
            )
    for block in range(prog, n_blocks, n_progs):
        rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        row_off = rows.to(tl.int64) * d
        dot = tl.zeros((BLOCK_N,), tl.float32)
        sq = tl.zeros((BLOCK_N,), tl.float32)
        dh_o = tl.zeros((BLOCK_N,), tl.float32)
        dh_p = tl.zeros((BLOCK_N,), tl.float32)
        for k in range(0, d, BLOCK_D):
            cols = k + tl.arange(0, BLOCK_D)
            p = _rows_tile(p_ptr, row_off, row_ok, cols, d, ALIGNED)
            o = _rows_tile(o_ptr, row_off, row_ok, cols, d, ALIGNED)
            dh = _rows_tile(dh_ptr, row_off, row_ok, cols, d, ALIGNED)
            if ALIGNED:
                w = tl.load(w_ptr + cols, eviction_policy="evict_last")
            else:
                w = tl.load(w_ptr + cols, mask=cols < d, other=0.0, eviction_policy="evict_last")
            dot += tl.sum(p * w[None, :], axis=1)
            sq += tl.sum(p * p, axis=1)
            dh_o += tl.sum(dh * o, axis=1)
            dh_p += tl.sum(dh * p, axis=1)
        r = tl.rsqrt(sq / d + eps)
        z = dot * r
        lse = _scratch(lse_ptr, rows, row_ok)
        top = tl.maximum(lse, z)
        a_o = tl.exp(lse - top)
        a_p = tl.exp(z - top)
        alpha = a_o / (a_o + a_p)
        beta = a_p / (a_o + a_p)
        dh_h = alpha * dh_o + beta * dh_p
        g = beta * (dh_p - dh_h) * r  # dz r
        rms = g * z * r / d
        tl.store(dlse_ptr + rows, alpha * (dh_o - dh_h), mask=row_ok, cache_modifier=".cg")
        for k in range(0, d, BLOCK_D):
            cols = k + tl.arange(0, BLOCK_D)
            if ALIGNED:
                mask = row_ok[:, None]
                w = tl.load(w_ptr + cols, eviction_policy="evict_last")
            else:
                mask = row_ok[:, None] & (cols[None, :] < d)
                w = tl.load(w_ptr + cols, mask=cols < d, other=0.0, eviction_policy="evict_last")
            tile = row_off[:, None] + cols[None, :]
            p = _rows_tile(p_ptr, row_off, row_ok, cols, d, ALIGNED)
            dh = _rows_tile(dh_ptr, row_off, row_ok, cols, d, ALIGNED)
            tl.store(do_ptr + tile, (alpha[:, None] * dh).to(do_ptr.dtype.element_ty), mask=mask)
            dp = beta[:, None] * dh + g[:, None] * w[None, :] - rms[:, None] * p
            dp = dp.to(dp_ptr.dtype.element_ty)
            if has_up != 0:  # chained: up + this merge's gradient, rounded as autograd adds them
                up = _rows_tile(up_ptr, row_off, row_ok, cols, d, ALIGNED)
                dp = (up + dp.to(tl.float32)).to(dp_ptr.dtype.element_ty)
            tl.store(dp_ptr + tile, dp, mask=mask)
            if ALIGNED:
                dw_old = tl.load(dw_row + cols, cache_modifier=".cg")
                tl.store(
                    dw_row + cols, dw_old + tl.sum(g[:, None] * p, axis=0), cache_modifier=".cg"
                )
            else:
                dw_old = _scratch(dw_row, cols, cols < d)
                tl.store(
                    dw_row + cols,
                    dw_old + tl.sum(g[:, None] * p, axis=0),
                    mask=cols < d,
                    cache_modifier=".cg",
                )
