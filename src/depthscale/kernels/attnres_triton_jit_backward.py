"""The AttnRes phase-1 read's backward as one Triton launch (`@triton.jit` only; the conventions —
chunked d, unspecialised scalars, proved alignment, the address table, fp32 scratch — are those of
`attnres_triton_jit`, whose helpers it calls through `jit`; `kernels/aot.py` points `jit` at its
own fresh copy of that module). The math is in `attnres_triton.py`, the launch plan in
`attnres_triton_config.read_backward_launch`.

Rows of every tile are (source, token) pairs: 16 rows hold 16 // block_n sources (a "group") of a
block_n-token block, so a small block (large rows: many sources, many queries, wide d) still
gives 16-row tiles, `tl.dot`-sized, and ≥ 4 elements per thread (vector loads).
"""

from __future__ import annotations

import triton
import triton.language as tl

import depthscale.kernels.attnres_triton_jit as jit


@triton.jit
def _pairs(table, group, block, N, m, d, ref, block_n):
    """The 16 (source, token) rows of `group` in token block `block`: each row's source, token,
    validity, source base pointer (16-byte aligned, `jit._addresses`) and row offset."""
    ps = tl.arange(0, 16)
    src = group * (16 // block_n) + ps // block_n
    tok = block * block_n + ps % block_n
    ok = (src < m) & (tok < N)
    bases, _ = jit._addresses(table, 0, src, m, ref)
    return src, tok, ok, bases, tok.to(tl.int64) * d


@triton.jit
def _pair_tile(bases, row_off, ok, cols, d, ALIGNED: tl.constexpr):
    """[16, D] fp32 tile of rows `bases + row_off` (each row its own tensor)."""
    mask = ok[:, None]
    if not ALIGNED:
        mask = mask & (cols[None, :] < d)
    ptrs = bases[:, None] + row_off[:, None] + cols[None, :]
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


_READ_BACKWARD_RUNTIME = ["N", "zn", "d", "m", "S", "block_n", "part", "n_parts", "n_groups",
                          "n_chunks", "n_blocks", "n_lanes", "eps"]  # fmt: skip


@triton.jit(do_not_specialize=_READ_BACKWARD_RUNTIME)
def _read_backward_kernel(table, ref, w_ptr, lse_ptr, dlse_ptr, part_ptr, wt_ptr, lane_ptr,
                          sync_ptr, N: tl.int32, zn: tl.int32, d: tl.int32, m: tl.int32,
                          S: tl.int32, block_n: tl.int32, part: tl.int32, n_parts: tl.int32, n_groups: tl.int32,
                          n_chunks: tl.int32, n_blocks: tl.int32, n_lanes: tl.int32,
                          eps: tl.float32, S_PAD: tl.constexpr, DW_ROWS: tl.constexpr,
                          LOGIT_D: tl.constexpr, GRAD_D: tl.constexpr,
                          ALIGNED: tl.constexpr):  # fmt: skip
    """The read's backward for block_n-token blocks, each source and upstream gradient row read
    from HBM once. Tickets name work items as in `jit._read_forward_kernel`; token block b's items
    are, in ticket order:
    - n_parts · n_groups logits items (part k, group: columns [k·part, (k+1)·part)), part-major so
      the groups reading one part's upstream gradients are neighbours: partial w·v, do·v and Σ v²
      into the [n_parts, m, 2·S_PAD + 1, zn] scratch; the last to arrive (acq_rel counter) sums
      the parts in order (deterministic), writes the softmax weights a, g and c
      (`_weights`) and sets the block's ready flag (release);
    - n_chunks gradient items (GRAD_D columns): wait for the flag, then write each source's
      gradient over the chunk from the bytes the logits items read moments before (L2 hits,
      `benchmarks/attnres_traffic.py` models the reuse distance), and add the block's dw share
      to lane b mod n_lanes of the [n_lanes, S_PAD, d] partials once block b − n_lanes's item of
      the chunk has added its own (a chain per lane and chunk: a fixed order, deterministic; a
      torch sum over the lanes finishes dw).
    A program waits only on smaller tickets (its block's logits items, the chunk's item of block
    b − n_lanes), which have started and finish: no deadlock. Table: m sources, m gradients, m
    chained gradients (0: none), S upstream gradients (0: zero). sync: int32 zeros
    [1 + 2·n_blocks + n_lanes·n_chunks] (ticket, arrivals, ready flags, lane turns)."""
    ticket = tl.atomic_add(sync_ptr, 1)
    n_logits = n_groups * n_parts
    items = n_logits + n_chunks
    block = ticket // items
    j = ticket % items
    d = jit._aligned(d, 16, ALIGNED)
    zn = jit._aligned(zn, 16, True)
    if j < n_logits:
        _logits_part(table, ref, w_ptr, part_ptr, block, j % n_groups, j // n_groups, N, zn, d,
                     m, S, block_n, jit._aligned(part, LOGIT_D, True), S_PAD, LOGIT_D,
                     ALIGNED)  # fmt: skip
        tl.debug_barrier()  # every thread's partials stored before the release below
        if tl.atomic_add(sync_ptr + 1 + block, 1, sem="acq_rel") == n_logits - 1:
            _weights(lse_ptr, dlse_ptr, part_ptr, wt_ptr, block, N, zn, d, m, S, block_n, n_parts,
                     eps, S_PAD)  # fmt: skip
            tl.debug_barrier()
            tl.atomic_xchg(sync_ptr + 1 + n_blocks + block, 1, sem="release")
    else:
        while tl.atomic_add(sync_ptr + 1 + n_blocks + block, 0, sem="acquire") == 0:
            pass
        chunk = j - n_logits
        dw = _gradients(table, ref, w_ptr, wt_ptr, block, chunk, N, zn, d, m, S, block_n,
                        n_groups, S_PAD, DW_ROWS, GRAD_D, ALIGNED)  # fmt: skip
        lane = block % n_lanes
        turn = block // n_lanes
        turns = sync_ptr + 1 + 2 * n_blocks + lane * n_chunks + chunk
        qs = tl.arange(0, DW_ROWS)
        cols = chunk * GRAD_D + tl.arange(0, GRAD_D)
        at = (lane * S_PAD + qs[:, None]).to(tl.int64) * d + cols[None, :]
        if ALIGNED:
            ok = qs[:, None] < S_PAD
        else:
            ok = (qs[:, None] < S_PAD) & (cols[None, :] < d)
        if turn > 0:  # add to the lane after its previous block's item (a smaller ticket)
            while tl.atomic_add(turns, 0, sem="acquire") < turn:
                pass
            dw += jit._scratch(lane_ptr, at, ok)
        tl.store(lane_ptr + at, dw, mask=ok, cache_modifier=".cg")
        tl.debug_barrier()
        tl.atomic_xchg(turns, turn + 1, sem="release")


@triton.jit
def _logits_part(table, ref, w_ptr, part_ptr, block, group, k, N, zn, d, m, S, block_n, part,
                 S_PAD: tl.constexpr, LOGIT_D: tl.constexpr, ALIGNED: tl.constexpr):  # fmt: skip
    """Partial w_s · v, do_s · v and Σ v² of the group's rows over columns [k·part, (k+1)·part).
    The upstream tiles are read one query at a time ([16, LOGIT_D] rows of the block's tokens),
    each query's dot added to its row of P."""
    src, tok, ok, bases, row_off = _pairs(table, group, block, N, m, d, ref, block_n)
    qs = tl.arange(0, S_PAD)
    dot = tl.zeros((S_PAD, 16), tl.float32)
    p = tl.zeros((S_PAD, 16), tl.float32)
    sq = tl.zeros((16,), tl.float32)
    start = k * part
    for c in range(start, tl.minimum(start + part, d), LOGIT_D):
        cols = c + tl.arange(0, LOGIT_D)
        v = _pair_tile(bases, row_off, ok, cols, d, ALIGNED)
        dot = jit._query_dots(w_ptr, v, qs, cols, d, dot, S_PAD, ALIGNED)
        sq += tl.sum(v * v, axis=1)
        for s in range(S):
            if tl.load(table + 3 * m + s) != 0:  # an absent upstream gradient is zero
                up = jit._address(table, 3 * m + s, ref)
                do = jit._rows_tile(up, row_off, ok, cols, d, ALIGNED)
                p += tl.where(qs[:, None] == s, tl.sum(do * v, axis=1)[None, :], 0.0)
    rows = 2 * S_PAD + 1
    at = ((k * m + src[None, :]) * rows + qs[:, None]) * zn + tok[None, :]
    tl.store(part_ptr + at, dot, mask=ok[None, :], cache_modifier=".cg")
    tl.store(part_ptr + at + S_PAD * zn, p, mask=ok[None, :], cache_modifier=".cg")
    tl.store(part_ptr + ((k * m + src) * rows + 2 * S_PAD) * zn + tok, sq, mask=ok,
             cache_modifier=".cg")  # fmt: skip


@triton.jit
def _weights(lse_ptr, dlse_ptr, part_ptr, wt_ptr, block, N, zn, d, m, S, block_n, n_parts, eps,
             S_PAD: tl.constexpr):  # fmt: skip
    """Per token of the block, from the parts (summed in part order): a_si = exp(z_si − lse_s),
    g_si = a_si (P_si − D_s + dlse_s) r_i with D_s = Σ_i a_si P_si, c_i = (Σ_s g_si z_si) r_i / d,
    into the [m, 2·S_PAD + 1, zn] scratch (a rows, g rows, c). The first pass leaves z in part 0's
    dot rows, P in the g rows and r in the c row for the second. lse and dlse: [S, N] fp32."""
    lanes = tl.arange(0, 16)  # the block's tokens, 16 wide whatever block_n
    rows = block * block_n + lanes
    row_ok = (lanes < block_n) & (rows < N)
    qs = tl.arange(0, S_PAD)
    sq_at = qs[:, None].to(tl.int64) * N + rows[None, :]
    sq_ok = (qs[:, None] < S) & row_ok[None, :]
    lse = tl.load(lse_ptr + sq_at, mask=sq_ok, other=float("inf"), cache_modifier=".cg")  # a = 0
    dlse = jit._scratch(dlse_ptr, sq_at, sq_ok)
    n_rows = 2 * S_PAD + 1
    at = qs[:, None] * zn + rows[None, :]
    ok = row_ok[None, :]
    D = tl.zeros((S_PAD, 16), tl.float32)
    for i in range(m):
        dot = tl.zeros((S_PAD, 16), tl.float32)
        p = tl.zeros((S_PAD, 16), tl.float32)
        sq = tl.zeros((16,), tl.float32)
        for k in range(n_parts):
            slot = part_ptr + (k * m + i) * n_rows * zn
            dot += jit._scratch(slot, at, ok)
            p += jit._scratch(slot + S_PAD * zn, at, ok)
            sq += jit._scratch(slot + 2 * S_PAD * zn, rows, row_ok)
        r = tl.rsqrt(sq / d + eps)
        z = dot * r[None, :]
        a = tl.exp(z - lse)
        D += a * p
        tl.store(part_ptr + i * n_rows * zn + at, z, mask=ok, cache_modifier=".cg")
        weights = wt_ptr + i * n_rows * zn
        tl.store(weights + at, a, mask=ok, cache_modifier=".cg")
        tl.store(weights + S_PAD * zn + at, p, mask=ok, cache_modifier=".cg")
        tl.store(weights + 2 * S_PAD * zn + rows, r, mask=row_ok, cache_modifier=".cg")
    for i in range(m):
        weights = wt_ptr + i * n_rows * zn
        z = jit._scratch(part_ptr + i * n_rows * zn, at, ok)
        a = jit._scratch(weights, at, ok)
        p = jit._scratch(weights + S_PAD * zn, at, ok)
        r = jit._scratch(weights + 2 * S_PAD * zn, rows, row_ok)
        g = a * (p - D + dlse) * r[None, :]
        tl.store(weights + S_PAD * zn + at, g, mask=ok, cache_modifier=".cg")
        c = tl.sum(g * z, axis=0) * r / d
        tl.store(weights + 2 * S_PAD * zn + rows, c, mask=row_ok, cache_modifier=".cg")


@triton.jit
def _gradients(table, ref, w_ptr, wt_ptr, block, chunk, N, zn, d, m, S, block_n, n_groups,
               S_PAD: tl.constexpr, DW_ROWS: tl.constexpr, GRAD_D: tl.constexpr,
               ALIGNED: tl.constexpr):  # fmt: skip
    """dv_i = Σ_s a_si do_s + Σ_s g_si w_s − c_i v_i (+ the chained gradient) over one chunk for
    the block's rows, group by group, one query at a time for the upstream tiles; returns the
    block's [DW_ROWS, GRAD_D] share of dw_s = Σ_rows g_si v_i. Where DW_ROWS ≥ 16 (S_PAD ≥ 4,
    zero query rows past S_PAD) the query contractions are fp32 `tl.dot`s: Σ_s g_si w_s as
    [16, Q] × [Q, GRAD_D] and dw as [Q, 16] × [16, GRAD_D]."""
    cols = chunk * GRAD_D + tl.arange(0, GRAD_D)
    col_ok = cols < d
    qs = tl.arange(0, DW_ROWS)
    q_ok = qs < S_PAD
    n_rows = 2 * S_PAD + 1
    dw = tl.zeros((DW_ROWS, GRAD_D), tl.float32)
    if DW_ROWS >= 16:  # the queries, zero rows past S_PAD
        w = tl.load(w_ptr + qs[:, None] * d + cols[None, :], mask=q_ok[:, None] & col_ok[None, :],
                    other=0.0, eviction_policy="evict_last")  # fmt: skip
    for group in range(n_groups):
        src, tok, ok, bases, row_off = _pairs(table, group, block, N, m, d, ref, block_n)
        weights = wt_ptr + src * n_rows * zn + tok  # [16]: each row's a, g, c column
        c = jit._scratch(weights + 2 * S_PAD * zn, 0, ok)
        v = _pair_tile(bases, row_off, ok, cols, d, ALIGNED)
        g = jit._scratch(weights[None, :] + (S_PAD + qs[:, None]) * zn, 0,
                         q_ok[:, None] & ok[None, :])  # fmt: skip
        dv = -c[:, None] * v
        if DW_ROWS >= 16:
            dv = tl.dot(tl.trans(g), w, dv, input_precision="ieee")
            dw = tl.dot(g, v, dw, input_precision="ieee")
        else:
            dw += tl.sum(g[:, :, None] * v[None, :, :], axis=1)
        for s in range(S):
            if DW_ROWS < 16:
                g_s = jit._scratch(weights + (S_PAD + s) * zn, 0, ok)
                w_s = tl.load(w_ptr + s * d + cols, mask=col_ok, other=0.0,
                              eviction_policy="evict_last")  # fmt: skip
                dv += g_s[:, None] * w_s[None, :]
            if tl.load(table + 3 * m + s) != 0:  # an absent upstream gradient is zero
                a_s = jit._scratch(weights + s * zn, 0, ok)
                up = jit._address(table, 3 * m + s, ref)
                dv += a_s[:, None] * jit._rows_tile(up, row_off, ok, cols, d, ALIGNED)
        dv = dv.to(ref.dtype.element_ty)
        chained, present = jit._addresses(table, 2 * m, src, m, ref)
        if tl.max(present.to(tl.int32), axis=0) != 0:  # chained: up + this read's, rounded so
            up_rows = _pair_tile(chained, row_off, ok & present, cols, d, ALIGNED)
            summed = (up_rows + dv.to(tl.float32)).to(ref.dtype.element_ty)
            dv = tl.where(present[:, None], summed, dv)
        out, _ = jit._addresses(table, m, src, m, ref)
        mask = ok[:, None]
        if not ALIGNED:
            mask = mask & col_ok[None, :]
        tl.store(out[:, None] + row_off[:, None] + cols[None, :], dv, mask=mask)
    return dw
