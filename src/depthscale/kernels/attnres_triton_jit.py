"""The AttnRes Triton kernels themselves (`@triton.jit` only: this module imports triton and nothing
else, so `kernels/aot.py` can load a fresh copy of it outside the interpreter and compile it ahead
of time). The design, the math and the launch rules are in `attnres_triton.py` and
`attnres_triton_config.py`.

Conventions shared by every kernel:
- d is chunked: a program loops over d in BLOCK_D columns, so no tile holds a whole row and d is a
  runtime argument (one compiled variant serves every d).
- Every runtime argument is typed by annotation and listed in `do_not_specialize`: Triton's JIT
  then neither turns a 1 into a constant nor adds alignment attributes, so the signature a launch
  compiles is exactly the one `aot.py` compiles (the first design's 3-minute, 43 KB/thread forward
  at d = 8192, S = 1 was Triton 3.6 compiling S = 1 into the kernel: the same kernel with S a
  runtime argument used 109 registers and no stack). Alignment is asserted explicitly
  instead, by the ALIGNED constexpr: every address 16-byte aligned and d a multiple of BLOCK_D
  (so no column masks, and loads vectorise).
- Sources, outputs and gradients are reached through an int64 address table on the device (see
  `_write_table_kernel`); `ref` is a pointer argument of their dtype, used only for its type.
- Arithmetic is fp32; results are stored in their tensors' dtypes.
- Scratch tensors hold per-token scalars (logits, softmax weights, ...) between kernels, padded
  to S_PAD queries (no load needs a query mask) and to rows of zn = N rounded up to 16 (aligned);
  their offsets are int32 (the launcher refuses scratch past 2^31 elements), row offsets int64.
"""

from __future__ import annotations

import triton
import triton.language as tl

TABLE_SLOTS = 16
"""Addresses `_write_table_kernel` writes per launch."""

_TABLE_RUNTIME = ["table", "start", "n", *(f"a{j}" for j in range(TABLE_SLOTS))]


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
def _address(table, j, ref, ALIGNED: tl.constexpr):
    """Entry j of the address table as a pointer of ref's type."""
    base = tl.load(table + j).to(ref.dtype)
    if ALIGNED:
        base = tl.multiple_of(base, 16)
    return base


@triton.jit
def _addresses(table, j0, qs, count, ref, ALIGNED: tl.constexpr):
    """Entries j0 + qs (qs < count; 0 beyond) as a vector of pointers of ref's type, and which
    are not 0 (an absent tensor)."""
    base = tl.load(table + j0 + qs, mask=qs < count, other=0)
    present = base != 0
    if ALIGNED:
        base = tl.multiple_of(base, 16)
    return base.to(ref.dtype), present


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


# ---------------------------------------------------------------------------------------------
# Phase-1 read (S queries over m sources). Forward: logits, then the weighted sum.

_READ_LOGITS_RUNTIME = ["table", "ref", "w_ptr", "z_ptr", "N", "zn", "d", "m", "eps"]


@triton.jit(do_not_specialize=_READ_LOGITS_RUNTIME)
def _read_logits_kernel(table, ref, w_ptr, z_ptr, N: tl.int32, zn: tl.int32, d: tl.int32,
                        m: tl.int32, eps: tl.float32, S_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_D: tl.constexpr, ALIGNED: tl.constexpr):  # fmt: skip
    """z[i, s, n] = r_i (v_i · w_s) for source i = pid % m over BLOCK_N tokens (the m programs of
    one token block are neighbours: they share w in cache). w: [S_PAD, d] fp32, zero-padded."""
    pid = tl.program_id(0)
    i = pid % m
    rows = (pid // m) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    if ALIGNED:
        d = tl.multiple_of(d, 16)
    row_off = rows.to(tl.int64) * d
    qs = tl.arange(0, S_PAD)
    base = _address(table, i, ref, ALIGNED)
    if ALIGNED:
        w_ptr = tl.multiple_of(w_ptr, 16)
    dot = tl.zeros((S_PAD, BLOCK_N), tl.float32)
    sq = tl.zeros((BLOCK_N,), tl.float32)
    for k in range(0, d, BLOCK_D):
        cols = k + tl.arange(0, BLOCK_D)
        v = _rows_tile(base, row_off, row_ok, cols, d, ALIGNED)
        if ALIGNED:
            w = tl.load(w_ptr + qs[:, None] * d + cols[None, :])
        else:
            w = tl.load(w_ptr + qs[:, None] * d + cols[None, :], mask=cols[None, :] < d, other=0.0)
        dot += tl.sum(w[:, None, :] * v[None, :, :], axis=2)
        sq += tl.sum(v * v, axis=1)
    r = tl.rsqrt(sq / d + eps)
    z_rows = (i * S_PAD + qs[:, None]) * tl.multiple_of(zn, 16)
    tl.store(z_ptr + z_rows + rows[None, :], dot * r[None, :], mask=row_ok[None, :])


_READ_SUM_RUNTIME = ["table", "ref", "z_ptr", "lse_ptr", "N", "zn", "d", "m", "S", "n_chunks"]


@triton.jit(do_not_specialize=_READ_SUM_RUNTIME)
def _read_sum_kernel(table, ref, z_ptr, lse_ptr, N: tl.int32, zn: tl.int32, d: tl.int32,
                     m: tl.int32, S: tl.int32, n_chunks: tl.int32, S_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_D: tl.constexpr, ALIGNED: tl.constexpr):  # fmt: skip
    """out_s[n, chunk] = Σ_i softmax_i(z_si) v_i[n, chunk] for BLOCK_N tokens and one d-chunk
    (pid % n_chunks; the chunks of a token block are neighbours: they share z in cache); lse_s
    written by chunk 0. Table: m sources, then S outputs."""
    pid = tl.program_id(0)
    chunk = pid % n_chunks
    rows = (pid // n_chunks) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    if ALIGNED:
        d = tl.multiple_of(d, 16)
    row_off = rows.to(tl.int64) * d
    cols = chunk * BLOCK_D + tl.arange(0, BLOCK_D)
    qs = tl.arange(0, S_PAD)
    zn = tl.multiple_of(zn, 16)
    z_at = qs[:, None] * zn + rows[None, :]
    zs = zn * S_PAD
    top = tl.full((S_PAD, BLOCK_N), float("-inf"), tl.float32)
    total = tl.zeros((S_PAD, BLOCK_N), tl.float32)
    for i in range(m):
        z = tl.load(z_ptr + i * zs + z_at, mask=row_ok[None, :], other=0.0)
        new_top = tl.maximum(top, z)
        total = total * tl.exp(top - new_top) + tl.exp(z - new_top)
        top = new_top
    lse = top + tl.log(total)
    if chunk == 0:
        tl.store(
            lse_ptr + qs[:, None].to(tl.int64) * N + rows[None, :],
            lse,
            mask=(qs[:, None] < S) & row_ok[None, :],
        )
    acc = tl.zeros((S_PAD, BLOCK_N, BLOCK_D), tl.float32)
    for i in range(m):
        a = tl.exp(tl.load(z_ptr + i * zs + z_at, mask=row_ok[None, :], other=0.0) - lse)
        v = _rows_tile(_address(table, i, ref, ALIGNED), row_off, row_ok, cols, d, ALIGNED)
        acc += a[:, :, None] * v[None, :, :]
    outs, _ = _addresses(table, m, qs, S, ref, ALIGNED)
    mask = (qs[:, None, None] < S) & row_ok[None, :, None]
    if not ALIGNED:
        mask = mask & (cols[None, None, :] < d)
    offsets = row_off[None, :, None] + cols[None, None, :]
    tl.store(outs[:, None, None] + offsets, acc.to(ref.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# Phase-1 read, backward: per-token scalars (z, P = do·v, r), then softmax weights and g, then the
# source gradients and the queries' gradient partials.

_READ_GRAD_LOGITS_RUNTIME = ["table", "ref", "w_ptr", "z_ptr", "p_ptr", "r_ptr", "N", "zn", "d",
                             "m", "S", "eps"]  # fmt: skip


@triton.jit(do_not_specialize=_READ_GRAD_LOGITS_RUNTIME)
def _read_grad_logits_kernel(table, ref, w_ptr, z_ptr, p_ptr, r_ptr, N: tl.int32, zn: tl.int32,
                             d: tl.int32, m: tl.int32, S: tl.int32, eps: tl.float32, S_PAD: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                             ALIGNED: tl.constexpr):  # fmt: skip
    """For source i = pid % m over BLOCK_N tokens: z_si = r_i (v_i · w_s), P_si = do_s · v_i and
    r_i. Table: m sources, m gradients, m chained gradients, then S upstream gradients do_s (0 for
    none: zero)."""
    pid = tl.program_id(0)
    i = pid % m
    rows = (pid // m) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    if ALIGNED:
        d = tl.multiple_of(d, 16)
    row_off = rows.to(tl.int64) * d
    qs = tl.arange(0, S_PAD)
    base = _address(table, i, ref, ALIGNED)
    if ALIGNED:
        w_ptr = tl.multiple_of(w_ptr, 16)
    d_outs, d_out_ok = _addresses(table, 3 * m, qs, S, ref, ALIGNED)
    dot = tl.zeros((S_PAD, BLOCK_N), tl.float32)
    p = tl.zeros((S_PAD, BLOCK_N), tl.float32)
    sq = tl.zeros((BLOCK_N,), tl.float32)
    for k in range(0, d, BLOCK_D):
        cols = k + tl.arange(0, BLOCK_D)
        v = _rows_tile(base, row_off, row_ok, cols, d, ALIGNED)
        if ALIGNED:
            w = tl.load(w_ptr + qs[:, None] * d + cols[None, :])
        else:
            w = tl.load(w_ptr + qs[:, None] * d + cols[None, :], mask=cols[None, :] < d, other=0.0)
        do = _queries_tile(d_outs, d_out_ok, row_off, row_ok, cols, d, ALIGNED)
        dot += tl.sum(w[:, None, :] * v[None, :, :], axis=2)
        p += tl.sum(do * v[None, :, :], axis=2)
        sq += tl.sum(v * v, axis=1)
    r = tl.rsqrt(sq / d + eps)
    zn = tl.multiple_of(zn, 16)
    at = (i * S_PAD + qs[:, None]) * zn + rows[None, :]
    tl.store(z_ptr + at, dot * r[None, :], mask=row_ok[None, :])
    tl.store(p_ptr + at, p, mask=row_ok[None, :])
    tl.store(r_ptr + i * zn + rows, r, mask=row_ok)


_READ_GRAD_WEIGHTS_RUNTIME = ["z_ptr", "p_ptr", "r_ptr", "lse_ptr", "dlse_ptr", "N", "zn", "d",
                              "m", "S"]  # fmt: skip


@triton.jit(do_not_specialize=_READ_GRAD_WEIGHTS_RUNTIME)
def _read_grad_weights_kernel(z_ptr, p_ptr, r_ptr, lse_ptr, dlse_ptr, N: tl.int32, zn: tl.int32,
                              d: tl.int32, m: tl.int32, S: tl.int32, S_PAD: tl.constexpr,
                              BLOCK_N: tl.constexpr):  # fmt: skip
    """In place over the scratch, per token: z → a_si = exp(z_si − lse_s), P → g_si =
    a_si (P_si − D_s + dlse_s) r_i with D_s = Σ_i a_si P_si, r → c_i = (Σ_s g_si z_si) r_i / d.
    lse and dlse: [S, N] fp32 (dlse zero where unused)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    qs = tl.arange(0, S_PAD)
    sq_at = qs[:, None].to(tl.int64) * N + rows[None, :]
    sq_ok = (qs[:, None] < S) & row_ok[None, :]
    lse = tl.load(lse_ptr + sq_at, mask=sq_ok, other=float("inf"))  # padded queries: a = 0
    dlse = tl.load(dlse_ptr + sq_at, mask=sq_ok, other=0.0)
    zn = tl.multiple_of(zn, 16)
    at = qs[:, None] * zn + rows[None, :]
    zs = zn * S_PAD
    D = tl.zeros((S_PAD, BLOCK_N), tl.float32)
    for i in range(m):
        z = tl.load(z_ptr + i * zs + at, mask=row_ok[None, :], other=0.0)
        p = tl.load(p_ptr + i * zs + at, mask=row_ok[None, :], other=0.0)
        D += tl.exp(z - lse) * p
    for i in range(m):
        z = tl.load(z_ptr + i * zs + at, mask=row_ok[None, :], other=0.0)
        p = tl.load(p_ptr + i * zs + at, mask=row_ok[None, :], other=0.0)
        r = tl.load(r_ptr + i * zn + rows, mask=row_ok, other=0.0)
        a = tl.exp(z - lse)
        g = a * (p - D + dlse) * r[None, :]
        tl.store(z_ptr + i * zs + at, a, mask=row_ok[None, :])
        tl.store(p_ptr + i * zs + at, g, mask=row_ok[None, :])
        c = tl.sum(g * z, axis=0) * r / d
        tl.store(r_ptr + i * zn + rows, c, mask=row_ok)


_READ_GRAD_SOURCES_RUNTIME = ["table", "ref", "w_ptr", "a_ptr", "g_ptr", "c_ptr", "dw_ptr", "N",
                              "zn", "d", "m", "S", "n_chunks", "n_blocks", "n_progs"]  # fmt: skip


@triton.jit(do_not_specialize=_READ_GRAD_SOURCES_RUNTIME)
def _read_grad_sources_kernel(table, ref, w_ptr, a_ptr, g_ptr, c_ptr, dw_ptr, N: tl.int32,
                              zn: tl.int32, d: tl.int32, m: tl.int32, S: tl.int32, n_chunks: tl.int32,
                              n_blocks: tl.int32, n_progs: tl.int32, S_PAD: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                              ALIGNED: tl.constexpr):  # fmt: skip
    """dv_i = Σ_s a_si do_s + Σ_s g_si w_s − c_i v_i (+ the chained gradient) for one d-chunk
    (pid % n_chunks) over the token blocks pid // n_chunks + k·n_progs; the program's share of
    dw_s = Σ_tokens Σ_i g_si v_i stays in registers and is written once, to its row of the
    [n_progs, S_PAD, d] partials (a torch sum over rows finishes it: deterministic, bounded)."""
    pid = tl.program_id(0)
    chunk = pid % n_chunks
    prog = pid // n_chunks
    if ALIGNED:
        d = tl.multiple_of(d, 16)
    cols = chunk * BLOCK_D + tl.arange(0, BLOCK_D)
    qs = tl.arange(0, S_PAD)
    if ALIGNED:
        w = tl.load(tl.multiple_of(w_ptr, 16) + qs[:, None] * d + cols[None, :])
    else:
        w = tl.load(w_ptr + qs[:, None] * d + cols[None, :], mask=cols[None, :] < d, other=0.0)
    d_outs, d_out_ok = _addresses(table, 3 * m, qs, S, ref, ALIGNED)
    zn = tl.multiple_of(zn, 16)
    zs = zn * S_PAD
    dw = tl.zeros((S_PAD, BLOCK_D), tl.float32)
    for block in range(prog, n_blocks, n_progs):
        rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        row_off = rows.to(tl.int64) * d
        at = qs[:, None] * zn + rows[None, :]
        if ALIGNED:
            tile_ok = row_ok[:, None]
        else:
            tile_ok = row_ok[:, None] & (cols[None, :] < d)
        tile = row_off[:, None] + cols[None, :]
        do = _queries_tile(d_outs, d_out_ok, row_off, row_ok, cols, d, ALIGNED)
        for i in range(m):
            a = tl.load(a_ptr + i * zs + at, mask=row_ok[None, :], other=0.0)
            g = tl.load(g_ptr + i * zs + at, mask=row_ok[None, :], other=0.0)
            c = tl.load(c_ptr + i * zn + rows, mask=row_ok, other=0.0)
            v = _rows_tile(_address(table, i, ref, ALIGNED), row_off, row_ok, cols, d, ALIGNED)
            dv = tl.sum(a[:, :, None] * do + g[:, :, None] * w[:, None, :], axis=0)
            dv -= c[:, None] * v
            dw += tl.sum(g[:, :, None] * v[None, :, :], axis=1)
            dv = dv.to(ref.dtype.element_ty)
            up = tl.load(table + 2 * m + i)
            if up != 0:  # chained: up + this read's gradient, rounded as autograd adds them
                up_rows = _rows_tile(_address(table, 2 * m + i, ref, ALIGNED), row_off, row_ok,
                                     cols, d, ALIGNED)  # fmt: skip
                dv = (up_rows + dv.to(tl.float32)).to(ref.dtype.element_ty)
            tl.store(_address(table, m + i, ref, ALIGNED) + tile, dv, mask=tile_ok)
    at_dw = (prog * S_PAD + qs[:, None]).to(tl.int64) * d + cols[None, :]
    if ALIGNED:
        tl.store(dw_ptr + at_dw, dw)
    else:
        tl.store(dw_ptr + at_dw, dw, mask=cols[None, :] < d)


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
            w = tl.load(w_ptr + cols)
        else:
            w = tl.load(w_ptr + cols, mask=cols < d, other=0.0)
        dot += tl.sum(p * w[None, :], axis=1)
        sq += tl.sum(p * p, axis=1)
    r = tl.rsqrt(sq / d + eps)
    return dot * r, r


_MERGE_FWD_RUNTIME = ["o_ptr", "lse_ptr", "p_ptr", "w_ptr", "h_ptr", "N", "d", "eps"]


@triton.jit(do_not_specialize=_MERGE_FWD_RUNTIME)
def _merge_fwd_kernel(o_ptr, lse_ptr, p_ptr, w_ptr, h_ptr, N: tl.int32, d: tl.int32,
                      eps: tl.float32, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                      ALIGNED: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    if ALIGNED:
        d = tl.multiple_of(d, 16)
        o_ptr = tl.multiple_of(o_ptr, 16)
        p_ptr = tl.multiple_of(p_ptr, 16)
        w_ptr = tl.multiple_of(w_ptr, 16)
        h_ptr = tl.multiple_of(h_ptr, 16)
    row_off = rows.to(tl.int64) * d
    z, r = _merge_logit(p_ptr, w_ptr, row_off, row_ok, d, eps, BLOCK_N, BLOCK_D, ALIGNED)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
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


_MERGE_BWD_RUNTIME = ["o_ptr", "lse_ptr", "p_ptr", "w_ptr", "dh_ptr", "up_ptr", "do_ptr",
                      "dlse_ptr", "dp_ptr", "dw_ptr", "N", "d", "eps", "has_up", "n_blocks",
                      "n_progs"]  # fmt: skip


@triton.jit(do_not_specialize=_MERGE_BWD_RUNTIME)
def _merge_bwd_kernel(o_ptr, lse_ptr, p_ptr, w_ptr, dh_ptr, up_ptr, do_ptr, dlse_ptr, dp_ptr,
                      dw_ptr, N: tl.int32, d: tl.int32, eps: tl.float32, has_up: tl.int32,
                      n_blocks: tl.int32, n_progs: tl.int32, BLOCK_N: tl.constexpr,
                      BLOCK_D: tl.constexpr, ALIGNED: tl.constexpr):  # fmt: skip
    """Token blocks pid + k·n_progs: pass 1 over d for the per-token scalars, pass 2 for d_o, d_p
    (+ the chained gradient up when has_up) and the program's row of the [n_progs, d] dw partials
    (accumulated in place by this program alone: deterministic, bounded)."""
    prog = tl.program_id(0)
    if ALIGNED:
        d = tl.multiple_of(d, 16)
        o_ptr = tl.multiple_of(o_ptr, 16)
        p_ptr = tl.multiple_of(p_ptr, 16)
        w_ptr = tl.multiple_of(w_ptr, 16)
        dh_ptr = tl.multiple_of(dh_ptr, 16)
        up_ptr = tl.multiple_of(up_ptr, 16)
        do_ptr = tl.multiple_of(do_ptr, 16)
        dp_ptr = tl.multiple_of(dp_ptr, 16)
        dw_ptr = tl.multiple_of(dw_ptr, 16)
    dw_row = dw_ptr + prog * d
    for k in range(0, d, BLOCK_D):
        cols = k + tl.arange(0, BLOCK_D)
        if ALIGNED:
            tl.store(dw_row + cols, tl.zeros((BLOCK_D,), tl.float32))
        else:
            tl.store(dw_row + cols, tl.zeros((BLOCK_D,), tl.float32), mask=cols < d)
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
                w = tl.load(w_ptr + cols)
            else:
                w = tl.load(w_ptr + cols, mask=cols < d, other=0.0)
            dot += tl.sum(p * w[None, :], axis=1)
            sq += tl.sum(p * p, axis=1)
            dh_o += tl.sum(dh * o, axis=1)
            dh_p += tl.sum(dh * p, axis=1)
        r = tl.rsqrt(sq / d + eps)
        z = dot * r
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        top = tl.maximum(lse, z)
        a_o = tl.exp(lse - top)
        a_p = tl.exp(z - top)
        alpha = a_o / (a_o + a_p)
        beta = a_p / (a_o + a_p)
        dh_h = alpha * dh_o + beta * dh_p
        g = beta * (dh_p - dh_h) * r  # dz r
        rms = g * z * r / d
        tl.store(dlse_ptr + rows, alpha * (dh_o - dh_h), mask=row_ok)
        for k in range(0, d, BLOCK_D):
            cols = k + tl.arange(0, BLOCK_D)
            if ALIGNED:
                mask = row_ok[:, None]
                w = tl.load(w_ptr + cols)
            else:
                mask = row_ok[:, None] & (cols[None, :] < d)
                w = tl.load(w_ptr + cols, mask=cols < d, other=0.0)
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
                tl.store(dw_row + cols, tl.load(dw_row + cols) + tl.sum(g[:, None] * p, axis=0))
            else:
                dw_old = tl.load(dw_row + cols, mask=cols < d, other=0.0)
                tl.store(dw_row + cols, dw_old + tl.sum(g[:, None] * p, axis=0), mask=cols < d)
