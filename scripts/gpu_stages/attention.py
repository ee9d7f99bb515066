"""Stage attention: which attention kernels depthscale's CUDA paths run, and what they cost.

- full_causal: SDPA's causal GQA attention as the model calls it (the baseline every other number
  here is read against);
- window: `window_attention` at llama-1b's head size, against full causal at the same length:
  a window of T/8 should cost well under full causal (~0.25 of it when the kernel skips the blocks
  outside the band), in a handful of kernel launches, not T/64 SDPA calls;
- ring_tile: one ring-attention tile (`attention_tiles.forward` / `backward`, as context
  parallelism calls them: LSE out, global output and LSE back in) against SDPA's flash attention
  on the same causal block: close to 1× when the tile runs on the flash op;
- documents: `document_attention` (`data.document_mask`) on rows of 8 packed documents each, with
  and without a window, against full causal: FlashAttention-2's varlen kernel computes nothing
  across documents, so ~1/8 of full causal; and a ring tile under a per-row document bias
  [B, 1, Tq, Tk] (the memory-efficient op) against the fp32 reference.
- unfused: Megatron's attention with its scores in memory (QKᵀ, softmax, dropout 0.1, PV) in bf16
  at GPT-sized heads and two micro-batches, less the same GEMMs alone: the bytes/s its score
  passes reach against the bytes per score element `plan/kernels.py` charges (13 forward, 19
  backward) — the planner's check of that charge on an H100/H200 (issue #42, mechanism 2).

Each names the path depthscale chose (`path`), the backends its kernels belong to (from the
profiler's kernel names) and its launches per forward + backward, and checks its output against
fp32 attention with a dense mask (bf16 bound 2e-2).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from gpu_stages.common import Context, OutOfBounds, profile_kernels, rel_err, sig, time_ms

REAL = {"B": 2, "H": 32, "Hkv": 8, "T": 4096, "d": 64, "window": 512, "tile": 2048,
        "T_err": 1024, "warmup": 3, "reps": 10}  # fmt: skip
DRY = {"B": 1, "H": 4, "Hkv": 2, "T": 128, "d": 16, "window": 32, "tile": 64,
       "T_err": 128, "warmup": 1, "reps": 2}  # fmt: skip
BOUND = 2e-2
REAL_UNFUSED = {"heads": 32, "T": 2048, "d": 128, "micro_batches": (1, 4), "warmup": 2, "reps": 5}
DRY_UNFUSED = {"heads": 2, "T": 64, "d": 16, "micro_batches": (1, 2), "warmup": 1, "reps": 2}


def run(ctx: Context) -> None:
    shapes = DRY if ctx.dry_run else REAL
    full = ctx.measure("full_causal", lambda: full_causal(ctx, shapes))
    ctx.measure("window", lambda: window(ctx, shapes, full))
    ctx.measure("ring_tile", lambda: ring_tile(ctx, shapes))
    ctx.measure("documents", lambda: documents(ctx, shapes, full))
    ctx.measure("unfused", lambda: unfused(ctx, DRY_UNFUSED if ctx.dry_run else REAL_UNFUSED))


def _qkv(ctx: Context, s: dict, T: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator(ctx.device).manual_seed(seed)
    shapes = [
        (s["B"], s["H"], T, s["d"]),
        (s["B"], s["Hkv"], T, s["d"]),
        (s["B"], s["Hkv"], T, s["d"]),
    ]
    return [
        torch.randn(*shape, generator=gen, device=ctx.device).to(dtype).requires_grad_()
        for shape in shapes
    ]


def _timed(ctx: Context, s: dict, fn, inputs: list[torch.Tensor]) -> dict[str, Any]:
    """fwd and fwd+bwd median ms, and the kernels of one fwd+bwd."""
    gen = torch.Generator(ctx.device).manual_seed(7)
    out = fn()
    upstream = torch.randn(out.shape, generator=gen, device=ctx.device).to(out.dtype)

    def fwd():
        with torch.no_grad():
            fn()

    def fwd_bwd():
        torch.autograd.grad(fn(), inputs, upstream)

    fwd_ms = time_ms(ctx, fwd, s["warmup"], s["reps"])
    all_ms = time_ms(ctx, fwd_bwd, s["warmup"], s["reps"])
    return {"fwd_ms": sig(fwd_ms), "fwd_bwd_ms": sig(all_ms), **profile_kernels(ctx, fwd_bwd)}


def _dense_reference(q, k, v, window: int) -> torch.Tensor:
    """fp32 SDPA with a dense boolean causal (window) mask: the truth."""
    from depthscale.model.layers import attention_mask

    pos = torch.arange(q.shape[2], device=q.device)
    mask = attention_mask(pos, pos, window)
    q, k, v = (t.detach().float() for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def full_causal(ctx: Context, s: dict) -> dict[str, Any]:
    q, k, v = _qkv(ctx, s, s["T"], torch.bfloat16, 0)
    values = {"shape": [s["B"], s["H"], s["Hkv"], s["T"], s["d"]], "dtype": "bfloat16"}
    values |= _timed(ctx, s, lambda: F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True), [q, k, v])  # fmt: skip
    return values


def window(ctx: Context, s: dict, full: dict | None) -> dict[str, Any]:
    from depthscale.model import window_attention as wa

    q, k, v = _qkv(ctx, s, s["T_err"], torch.bfloat16, 1)
    err = rel_err(wa.window_attention(q, k, v, s["window"]), _dense_reference(q, k, v, s["window"]))
    q, k, v = _qkv(ctx, s, s["T"], torch.bfloat16, 2)
    values: dict[str, Any] = {"window": s["window"], "T": s["T"], "rel_err": sig(err, 3)}
    path = getattr(wa, "path", None)
    values["path"] = path(q) if path else "unknown (no window_attention.path)"
    values |= _timed(ctx, s, lambda: wa.window_attention(q, k, v, s["window"]), [q, k, v])
    if full:
        values["fwd_bwd_over_full_causal"] = sig(values["fwd_bwd_ms"] / full["fwd_bwd_ms"], 3)
    if not err <= BOUND:
        raise OutOfBounds(f"window output rel error {err:.2e} > {BOUND:.0e}", values)
    return values


def _tile_mask(tiles, T: int, device: torch.device):
    """A top-left causal TileMask, whatever fields it has grown (unknown ones None)."""
    dense = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    known = {"causal": True, "bias": None, "dense": dense}
    return tiles.TileMask(**{f: known.get(f) for f in tiles.TileMask._fields})


def ring_tile(ctx: Context, s: dict) -> dict[str, Any]:
    from depthscale.model import attention_tiles as tiles

    try:
        from depthscale.model.attention_dispatch import tile_dtype

        dtype = tile_dtype(ctx.device.type, torch.bfloat16)
    except ImportError:
        dtype = torch.bfloat16 if ctx.cuda else torch.float32
    T = s["tile"]
    q, k, v = _qkv(ctx, s, T, dtype, 3)
    mask = _tile_mask(tiles, T, ctx.device)
    scale = s["d"] ** -0.5
    values: dict[str, Any] = {"T": T, "dtype": str(dtype).removeprefix("torch.")}
    path = getattr(tiles, "path", None)
    values["path"] = path(q, mask) if path else "unknown (no attention_tiles.path)"
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    out, lse = tiles.forward(qd, kd, vd, mask, scale)
    values["rel_err"] = sig(rel_err(out, _dense_reference(q, k, v, 0)), 3)
    gen = torch.Generator(ctx.device).manual_seed(11)
    do = torch.randn(out.shape, generator=gen, device=ctx.device).to(out.dtype)
    out, lse = out.to(q.dtype), lse.float()

    def tile_fwd():
        return tiles.forward(qd, kd, vd, mask, scale)

    def tile_bwd():
        return tiles.backward(do, qd, kd, vd, out, lse, mask, scale)

    values["tile_fwd_ms"] = sig(time_ms(ctx, tile_fwd, s["warmup"], s["reps"]))
    values["tile_bwd_ms"] = sig(time_ms(ctx, tile_bwd, s["warmup"], s["reps"]))
    values["tile_kernels"] = profile_kernels(ctx, lambda: (tile_fwd(), tile_bwd()))
    q2, k2, v2 = _qkv(ctx, s, T, torch.bfloat16, 3)
    flash = _timed(ctx, s, lambda: F.scaled_dot_product_attention(
        q2, k2, v2, is_causal=True, enable_gqa=True), [q2, k2, v2])  # fmt: skip
    values["sdpa_fwd_bwd_ms"] = flash["fwd_bwd_ms"]
    values["sdpa_backends"] = flash["backends"]
    tile_ms = values["tile_fwd_ms"] + values["tile_bwd_ms"]
    values["tile_over_sdpa"] = sig(tile_ms / flash["fwd_bwd_ms"], 3)
    if not values["rel_err"] <= BOUND:
        raise OutOfBounds(f"tile output rel error {values['rel_err']:.2e} > {BOUND:.0e}", values)
    return values


def _packed_documents(ctx: Context, s: dict, T: int):
    """Rows of T tokens holding 8 documents of seeded lengths each (EOS = 1 starts one)."""
    from depthscale.model.documents import Documents

    gen = torch.Generator().manual_seed(5)
    tokens = torch.full((s["B"], T), 7)
    for row in tokens:
        cuts = torch.randperm(T - 1, generator=gen)[:7] + 1
        row[cuts] = 1
    return Documents.of(tokens, 1, ctx.device)


def _dense_documents(q, k, v, window: int, docs) -> torch.Tensor:
    from depthscale.model.document_attention import visible

    pos = torch.arange(q.shape[2], device=q.device)
    q, k, v = (t.detach().float() for t in (q, k, v))
    mask = visible(docs, pos, pos, window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def documents(ctx: Context, s: dict, full: dict | None) -> dict[str, Any]:
    from depthscale.model import attention_tiles as tiles
    from depthscale.model import document_attention as da

    values: dict[str, Any] = {"T": s["T"], "documents_per_row": 8}
    for window in (0, s["window"]):
        q, k, v = _qkv(ctx, s, s["T_err"], torch.bfloat16, 4)
        docs = _packed_documents(ctx, s, s["T_err"])
        err = rel_err(da.document_attention(q, k, v, window, docs),
                      _dense_documents(q, k, v, window, docs))  # fmt: skip
        q, k, v = _qkv(ctx, s, s["T"], torch.bfloat16, 5)
        docs = _packed_documents(ctx, s, s["T"])
        run = {"path": da.path(q), "rel_err": sig(err, 3)}
        call = lambda q=q, k=k, v=v, w=window, d=docs: da.document_attention(q, k, v, w, d)  # noqa: E731
        run |= _timed(ctx, s, call, [q, k, v])
        if full:
            run["fwd_bwd_over_full_causal"] = sig(run["fwd_bwd_ms"] / full["fwd_bwd_ms"], 3)
        values[f"window_{window}"] = run
        if not err <= BOUND:
            raise OutOfBounds(f"document attention rel error {err:.2e} > {BOUND:.0e}", values)
    T = s["tile"]  # a ring tile whose rows span documents: a bias per row of the batch
    q, k, v = (t.detach() for t in _qkv(ctx, s, T, torch.bfloat16, 6))
    docs = _packed_documents(ctx, s, T)
    pos = torch.arange(T, device=ctx.device)
    seen = da.visible(docs, pos, pos, 0)
    mask = tiles.TileMask(False, tiles.additive_bias(seen), None)
    out, _ = tiles.forward(q, k, v, mask, s["d"] ** -0.5)
    tile_err = rel_err(out, _dense_documents(q, k, v, 0, docs))
    values["ring_tile"] = {"path": tiles.path(q, mask), "rel_err": sig(tile_err, 3)}
    if not tile_err <= BOUND:
        raise OutOfBounds(f"document tile rel error {tile_err:.2e} > {BOUND:.0e}", values)
    return values


def unfused(ctx: Context, s: dict) -> dict[str, Any]:
    from depthscale.plan.kernels import UnfusedAttention

    charge = UnfusedAttention(2, True)
    per_score = charge.forward_bytes + charge.backward_bytes
    values: dict[str, Any] = {"bytes_per_score": [charge.forward_bytes, charge.backward_bytes]}
    rows = []
    for mb in s["micro_batches"]:
        gen = torch.Generator(ctx.device).manual_seed(mb)
        shape = (mb * s["heads"], s["T"], s["d"])
        q, k, v = (
            torch.randn(shape, generator=gen, device=ctx.device).to(torch.bfloat16).requires_grad_()
            for _ in range(3)
        )
        grad = torch.randn(shape, generator=gen, device=ctx.device).to(torch.bfloat16)

        def attention(score_passes: bool, q=q, k=k, v=v, grad=grad):
            probs = torch.bmm(q, k.transpose(1, 2))
            if score_passes:  # else the GEMMs alone: the passes cost the difference
                probs = torch.native_dropout(torch.softmax(probs, dim=-1), 0.1, True)[0]
            torch.autograd.grad(torch.bmm(probs, v), (q, k, v), grad)

        full = time_ms(ctx, lambda: attention(True), s["warmup"], s["reps"])
        gemms = time_ms(ctx, lambda: attention(False), s["warmup"], s["reps"])
        scores = mb * s["heads"] * s["T"] ** 2
        passes_s = max(full - gemms, 1e-6) / 1e3
        rows.append({
            "micro_batch": mb, "fwd_bwd_ms": sig(full), "gemms_ms": sig(gemms),
            "score_passes_GBps": sig(scores * per_score / passes_s / 1e9, 4),
        })  # fmt: skip
    values["rows"] = rows
    return values
