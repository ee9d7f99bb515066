"""Which attention kernel runs where (`model/attention_dispatch.py`), proven without a GPU:

* the choosers: on CUDA in bf16 ring tiles go to SDPA's flash op (unmasked, causal) or its
  memory-efficient op (masked), windows to flash's sliding window (or FlexAttention); CPU keeps its
  kernels; everything else takes the reference;
* the fused ops' schemas in this torch are the ones our calls are written for (a mismatch falls
  back instead of failing), and our calls run against the real ops on the meta device;
* the CUDA tile wrappers' own logic (GQA heads stacked for the efficient kernel, its aligned bias and
  padded LSE, causal tiles cut square) against the reference, with the CUDA ops replaced by
  emulations that enforce each kernel's input contract;
* FlexAttention's sliding-window block mask (forward, uncompiled: CPU has no flex backward).

Tests marked `cuda` run the real kernels against fp64 where a GPU exists (scripts/gpu_check.py
runs them); their tolerance is measured beside them: the same inputs through SDPA with a dense
mask in bf16 (each within twice the other's error from fp64, plus one bf16 ulp, 2^-8).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from depthscale.model import attention_dispatch as dispatch
from depthscale.model import attention_tiles
from depthscale.model import window_attention as wa
from depthscale.model.layers import attention_mask
from depthscale.parallel.ring_schedule import RingPlan, Span
from depthscale.parallel.sequence_layout import positions_for
from tolerances import check, fp32_sum_bound, scaled_err

ALL = dispatch.Capabilities(flash=True, efficient=True, flash_window=True, flex=True)
BF16, FP32 = torch.bfloat16, torch.float32
cuda = pytest.mark.cuda  # deselected where there is no CUDA device (tests/conftest.py)


# ------------------------------------------------------------------------------------ choosers


@pytest.mark.parametrize(
    "device, dtype, mask, head, caps, want",
    [
        ("cuda", BF16, "none", 128, ALL, "cuda_flash"),
        ("cuda", BF16, "causal", 64, ALL, "cuda_flash"),
        ("cuda", torch.float16, "causal", 128, ALL, "cuda_flash"),
        ("cuda", BF16, "masked", 128, ALL, "cuda_efficient"),
        ("cuda", BF16, "causal", 128, dispatch.Capabilities(efficient=True), "cuda_efficient"),
        ("cuda", BF16, "masked", 128, dispatch.Capabilities(flash=True), "reference"),
        ("cuda", BF16, "none", 128, dispatch.Capabilities(), "reference"),
        ("cuda", FP32, "none", 128, ALL, "reference"),
        ("cuda", BF16, "none", 100, ALL, "reference"),  # not a multiple of 8
        ("cuda", BF16, "none", 512, ALL, "reference"),  # over flash's 256
        ("cpu", FP32, "masked", 128, ALL, "cpu_flash"),
        ("cpu", FP32, "causal", 128, dispatch.Capabilities(), "cpu_flash"),
        ("mps", BF16, "none", 128, ALL, "reference"),
    ],
)
def test_tile_path(device, dtype, mask, head, caps, want):
    assert dispatch.tile_path(device, dtype, mask, head, caps) == want


@pytest.mark.parametrize(
    "device, dtype, head, caps, band, want",
    [
        ("cuda", BF16, 128, ALL, False, "cuda_flash_window"),
        ("cuda", torch.float16, 64, ALL, False, "cuda_flash_window"),
        ("cuda", FP32, 128, ALL, False, "flex"),
        ("cuda", BF16, 128, dispatch.Capabilities(flex=True), False, "flex"),
        ("cuda", BF16, 100, ALL, False, "flex"),
        ("cuda", BF16, 128, dispatch.Capabilities(), False, "sdpa_blocks"),
        ("cpu", FP32, 128, ALL, True, "cpu_band"),
        ("cpu", FP32, 128, ALL, False, "cpu_tiles"),
        ("cpu", BF16, 128, ALL, True, "cpu_tiles"),
        ("cpu", torch.float16, 128, ALL, True, "sdpa_blocks"),
        ("xpu", BF16, 128, ALL, False, "sdpa_blocks"),
    ],
)
def test_window_path(device, dtype, head, caps, band, want):
    assert dispatch.window_path(device, dtype, head, caps, band) == want


def test_tiles_compute_in_the_half_dtype_on_cuda_only():
    assert dispatch.tile_dtype("cuda", BF16) == BF16
    assert dispatch.tile_dtype("cuda", FP32) == FP32
    assert dispatch.tile_dtype("cpu", BF16) == FP32


def test_capabilities_on_cuda_follow_the_build_and_the_sdpa_switches(monkeypatch):
    """With the build probe answering as an H100 would, every fused kernel is offered on 'cuda';
    switching SDPA's flash backend off takes the flash op and flash's window away, and the
    memory-efficient backend the efficient op. Off CUDA nothing is offered."""
    monkeypatch.setattr(dispatch, "_cuda_build", lambda device: (True, True, True))
    device = torch.device("cuda")
    assert dispatch.capabilities(device) == ALL
    flash, efficient = (
        torch.backends.cuda.flash_sdp_enabled(),
        (torch.backends.cuda.mem_efficient_sdp_enabled()),
    )
    try:
        torch.backends.cuda.enable_flash_sdp(False)
        assert dispatch.capabilities(device) == dispatch.Capabilities(efficient=True, flex=True)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        assert dispatch.capabilities(device) == dispatch.Capabilities(flex=True)
    finally:
        torch.backends.cuda.enable_flash_sdp(flash)
        torch.backends.cuda.enable_mem_efficient_sdp(efficient)
    assert dispatch.capabilities(torch.device("cpu")) == dispatch.Capabilities()


def test_choosing_a_cuda_path_does_not_break_a_compiled_graph(monkeypatch):
    """Under torch.compile the capability probe is a trace-time constant: a layer that picks its
    window kernel on 'cuda' compiles into one graph."""

    def h100(device):
        return True, True, True

    monkeypatch.setattr(dispatch, "_cuda_build", h100)

    def layer(x):
        caps = dispatch.capabilities(torch.device("cuda"))
        kernel = dispatch.window_path("cuda", BF16, 128, caps, False)
        return x + (kernel == "cuda_flash_window")

    assert torch.equal(
        torch.compile(layer, backend="eager", fullgraph=True)(torch.zeros(2)), torch.ones(2)
    )


def test_the_fused_ops_schemas_are_the_ones_our_calls_are_written_for():
    """Pinned for this torch (2.13 here; the same names in 2.11): were an argument renamed or moved,
    `capabilities` would drop that op (falling back) instead of calling it wrongly."""
    for name, (positional, keywords) in dispatch.SCHEMAS.items():
        assert dispatch.schema_matches(name, positional, keywords), name
    positional, keywords = dispatch.SCHEMAS["_scaled_dot_product_flash_attention"]
    op = "_scaled_dot_product_flash_attention"
    assert not dispatch.schema_matches(op, positional[1:], keywords)  # an argument moved
    assert not dispatch.schema_matches(op, positional, ("window_size_left",))  # one missing
    assert not dispatch.schema_matches("_no_such_attention_op", positional, keywords)


@pytest.mark.parametrize("window", [0, 24])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_on_cuda_ring_tiles_take_flash_and_only_window_edges_the_efficient_op(layout, window):
    """Every tile of causal ring plans (cp = 4) on 'cuda' in bf16: without a window all run
    FlashAttention; with one only the tiles at a window's edge (an arbitrary mask) take the
    efficient op. The plan builds masks for CUDA in the fused form, as for CPU."""
    assert attention_tiles.fused(torch.device("cuda"))
    cp, T = 4, 256
    pos = [positions_for(T, r, cp, layout) for r in range(cp)]
    paths = []
    for rank in range(cp):
        plan = RingPlan.of(pos, rank, Span.of(window, True, None), 16, torch.device("cpu"))
        for step in range(cp):
            if plan.holds(step):
                for tile in plan.tiles(step):
                    kind = attention_tiles.mask_kind(plan.tile_mask(tile))
                    paths.append(dispatch.tile_path("cuda", BF16, kind, 128, ALL))
    assert paths
    if window == 0:
        assert set(paths) == {"cuda_flash"}
    else:
        assert set(paths) == {"cuda_flash", "cuda_efficient"}


def test_on_cuda_a_window_is_one_flash_call(monkeypatch):
    """The window path for a bf16 tensor on 'cuda' is flash's window: one kernel call a layer."""
    monkeypatch.setattr(dispatch, "capabilities", lambda device: ALL)
    q = SimpleNamespace(device=torch.device("cuda"), dtype=BF16, shape=(1, 4, 64, 128))
    assert wa.path(q) == "cuda_flash_window"


# ------------------------------------------------------------- our calls against the real ops (meta)


def _meta(*shape, dtype=BF16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def test_flash_tile_calls_match_the_op_on_meta():
    B, H, Hkv, T, d = 2, 8, 2, 48, 64
    q, k, v = _meta(B, H, T, d), _meta(B, Hkv, T, d), _meta(B, Hkv, T, d)
    out, lse = attention_tiles.cuda_flash_forward(q, k, v, True, 0.125)
    assert out.shape == q.shape and out.dtype == BF16
    assert lse.shape == (B, H, T) and lse.dtype == FP32
    dq, dk, dv = attention_tiles.cuda_flash_backward(q, q, k, v, out, lse, True, 0.125)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_efficient_tile_calls_match_the_op_on_meta():
    B, H, Hkv, Tq, Tk, d = 2, 6, 2, 24, 40, 64
    q, k, v = _meta(B, H, Tq, d), _meta(B, Hkv, Tk, d), _meta(B, Hkv, Tk, d)
    bias = _meta(Tq, Tk, dtype=FP32)
    out, lse = attention_tiles.cuda_efficient_forward(q, k, v, bias, 0.125)
    assert out.shape == q.shape and out.dtype == BF16
    assert lse.shape == (B, H, Tq) and lse.dtype == FP32
    grads = attention_tiles.cuda_efficient_backward(q, q, k, v, out, lse, bias, 0.125)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


def test_varlen_document_call_matches_the_op_on_meta_with_its_backward():
    """`document_attention.varlen` (packed documents on CUDA) against the real op's schema: rows
    laid end to end, int32 cumulative lengths, with and without a window, and its backward."""
    from depthscale.model import document_attention as da
    from depthscale.model.documents import Documents

    B, H, Hkv, T, d = 2, 8, 2, 32, 64
    tokens = torch.full((B, T), 5)
    tokens[0, [7, 20]] = tokens[1, 3] = 1
    docs = Documents.of(tokens, 1, "meta")
    for window in (0, 8):
        leaves = [_meta(B, T, h, d).transpose(1, 2).requires_grad_() for h in (H, Hkv, Hkv)]
        out = da.varlen(*leaves, window, docs)
        assert out.shape == (B, H, T, d) and out.dtype == BF16
        out.backward(torch.empty_like(out))
        assert [t.grad.shape for t in leaves] == [t.shape for t in leaves]
    cum, longest = da.cumulative_lengths(docs, torch.device("cpu"))
    assert cum.tolist() == [0, 7, 20, 32, 35, 64] and longest == 29 and cum.dtype == torch.int32


def test_flash_window_call_matches_the_op_on_meta_with_its_backward():
    B, H, Hkv, T, d = 2, 8, 2, 96, 64
    leaves = [_meta(B, T, h, d).transpose(1, 2).requires_grad_() for h in (H, Hkv, Hkv)]
    out = wa.flash_window(*leaves, 16)
    assert out.shape == (B, H, T, d) and out.dtype == BF16
    out.backward(torch.empty_like(out))
    assert [t.grad.shape for t in leaves] == [t.shape for t in leaves]


# ------------------------------------------- the CUDA tile wrappers against emulated CUDA kernels


def _ref(q, k, v, visible, scale):
    return attention_tiles.reference_forward(q.double(), k.double(), v.double(), visible, scale)


def _ref_grads(do, q, k, v, out, lse, visible, scale):
    args = (t.double() for t in (do, q, k, v, out))
    return attention_tiles.reference_backward(*args, lse.double(), visible, scale)


def _rng(seed, offset):
    assert seed.dtype == offset.dtype and seed.device == offset.device
    return seed


class FakeCuda:
    """SDPA's CUDA flash and memory-efficient ops, computed in fp64 on CPU and rounded to the
    inputs' dtype, each asserting its kernel's input contract (what the real kernel would reject,
    or silently misread): half precision; flash takes GQA, a causal tile only square; efficient
    takes no GQA, a 4-D bias of the query's dtype with 16-byte aligned rows, and its LSE padded to
    a multiple of 32 rows; the backward's LSE contiguous."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def __getattr__(self, name):
        return getattr(self.real, name)

    def _scaled_dot_product_flash_attention(self, q, k, v, dropout, causal, debug, *, scale):
        self.calls.append("flash")
        assert q.dtype in dispatch.HALF and dropout == 0.0 and not debug
        assert q.shape[1] % k.shape[1] == 0
        assert not causal or q.shape[2] == k.shape[2], "causal tiles reach the kernel square"
        mask = _causal(q, k) if causal else None
        out, lse = _ref(q, k, v, mask, scale)
        Tq, Tk = q.shape[2], k.shape[2]
        return out.to(q.dtype), lse.float(), None, None, Tq, Tk, None, None, None

    def _scaled_dot_product_flash_attention_backward(
        self, do, q, k, v, out, lse, cq, ck, mq, mk, dropout, causal, seed, offset, *, scale
    ):
        self.calls.append("flash_backward")
        assert lse.is_contiguous() and (mq, mk) == (q.shape[2], k.shape[2]) and dropout == 0.0
        assert seed.dtype == torch.uint64 and seed.shape == (2,) and offset.shape == ()
        assert not causal or q.shape[2] == k.shape[2]
        mask = _causal(q, k) if causal else None
        grads = _ref_grads(do, q, k, v, out, lse, mask, scale)
        return tuple(g.to(q.dtype) for g in grads)

    @staticmethod
    def _check_bias(bias, q, k):
        if bias is None:
            return None
        B, H, M, N = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        assert bias.dim() == 4 and bias.shape == (B, H, M, N) and bias.dtype == q.dtype
        assert bias.stride(-1) == 1 and bias.stride(2) % 8 == 0, "bias rows must be aligned"
        visible = (
            bias == 0
        )  # one mask per row of the batch (packed documents), the same for all heads
        assert torch.equal(visible, visible[:, :1].expand_as(visible))
        return visible[:, :1]

    def _scaled_dot_product_efficient_attention(
        self, q, k, v, bias, compute_lse, dropout, causal, *, scale
    ):
        self.calls.append("efficient")
        assert q.dtype in dispatch.HALF and compute_lse and dropout == 0.0 and not causal
        assert q.shape[1] == k.shape[1], "the efficient kernel takes no GQA"
        out, lse = _ref(q, k, v, self._check_bias(bias, q, k), scale)
        M = q.shape[2]
        padded = torch.full((*lse.shape[:2], math.ceil(M / 32) * 32), float("nan"))
        padded[..., :M] = lse
        return out.to(q.dtype), padded, None, None

    def _scaled_dot_product_efficient_attention_backward(
        self, do, q, k, v, bias, out, lse, seed, offset, dropout, grad_mask, causal, *, scale
    ):
        self.calls.append("efficient_backward")
        assert list(grad_mask) == [True, True, True, False] and not causal and dropout == 0.0
        assert q.shape[1] == k.shape[1]
        M = q.shape[2]
        assert lse.shape[-1] == math.ceil(M / 32) * 32 and lse.is_contiguous()
        assert not lse[..., M:].isnan().any()
        _rng(seed, offset)
        grads = _ref_grads(do, q, k, v, out, lse[..., :M], self._check_bias(bias, q, k), scale)
        return (*(g.to(q.dtype) for g in grads), None)


def _causal(q, k):
    return torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()


def _tile_case(seed, B=2, Hkv=2, G=3, Tq=24, Tk=37, d=16):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(B, Tq + 8, Hkv * G, d, generator=g).transpose(1, 2)
    q = base[:, :, 4 : 4 + Tq]  # a strided view, as the ring's row selections are
    k, v = torch.randn(2, B, Hkv, Tk, d, generator=g)
    do = torch.randn(B, Hkv * G, Tq, d, generator=g)
    return [t.to(BF16) for t in (q, k, v, do)]


def _tile_masks(Tq, Tk):
    q_pos, k_pos = torch.arange(Tq), torch.arange(Tk)
    causal = attention_mask(q_pos, k_pos, 0)
    band = attention_mask(q_pos + Tk - Tq, k_pos, 9)
    # packed documents: one mask per row of the batch, [B, 1, Tq, Tk] (a document starts at key
    # 20 in row 0, at key 10 in row 1; every query row still sees a key)
    starts = torch.tensor([20, 10])[:, None, None]
    q_doc = (q_pos + Tk - Tq)[None, :, None] >= starts
    docs = (attention_mask(q_pos + Tk - Tq, k_pos, 0) & (q_doc == (k_pos >= starts))).unsqueeze(1)
    return {
        "none": (attention_tiles.TileMask(False, None, None), None),
        "causal": (attention_tiles.TileMask(True, None, None), causal),
        "band": (attention_tiles.TileMask(False, attention_tiles.additive_bias(band), None), band),
        "documents": (
            attention_tiles.TileMask(False, attention_tiles.additive_bias(docs), None),
            docs,
        ),
    }


@pytest.mark.parametrize(
    "kernel, kind",  # masked tiles never take the flash op
    [(k, m) for k in ("cuda_flash", "cuda_efficient") for m in ("none", "causal", "band", "documents")
     if (k, m) not in (("cuda_flash", "band"), ("cuda_flash", "documents"))],
)  # fmt: skip
def test_cuda_tile_wrappers_match_the_reference(monkeypatch, kernel, kind):
    """forward/backward on the chosen CUDA kernel (emulated: same numbers as the reference up to
    the kernel's rounding of its outputs to bf16, 2^-9 of their magnitude) give the tile's output,
    LSE and gradients: GQA (3 query heads per KV head), Tq = 24 rows (LSE padding), Tk = 37 keys
    (bias alignment), a causal tile with more keys than rows (cut square)."""
    fake = FakeCuda(attention_tiles.aten)
    monkeypatch.setattr(attention_tiles, "aten", fake)
    monkeypatch.setattr(attention_tiles, "path", lambda q, mask: kernel)
    q, k, v, do = _tile_case(0)
    mask, visible = _tile_masks(q.shape[2], k.shape[2])[kind]
    scale = q.shape[-1] ** -0.5
    want_out, want_lse = _ref(q, k, v, visible, scale)
    out, lse = attention_tiles.forward(q, k, v, mask, scale)
    assert out.dtype == BF16 and lse.dtype == FP32 and lse.shape == q.shape[:3]
    bf16_rounding = 2.0**-8
    check(scaled_err(out, want_out), bf16_rounding, f"{kind} out")
    check(scaled_err(lse, want_lse), fp32_sum_bound(k.shape[2] + q.shape[-1]), f"{kind} lse")
    want = _ref_grads(do, q, k, v, out, lse, visible, scale)  # from the out/lse given
    got = attention_tiles.backward(do, q, k, v, out, lse, mask, scale)
    for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert a.shape == b.shape and a.dtype == BF16, name
        check(scaled_err(a, b), bf16_rounding, f"{kind} {name}")
    stem = "flash" if kernel == "cuda_flash" else "efficient"
    assert fake.calls == [stem, f"{stem}_backward"]


def test_the_reference_takes_every_mask_form():
    """The fallback (CUDA fp32, other devices) gets the plan's fused-form masks on CUDA: the causal
    flag and the additive bias give the same result as the boolean mask."""
    q, k, v, _ = (t.float() for t in _tile_case(1))
    for kind, (mask, vis) in _tile_masks(q.shape[2], k.shape[2]).items():
        want = attention_tiles.reference_forward(q, k, v, vis, 0.25)
        got = attention_tiles.reference_forward(
            q, k, v, attention_tiles.visible(mask, q.shape[2], k.shape[2], q.device), 0.25
        )
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), kind


# ----------------------------------------------------------------- FlexAttention's window (CPU)


def _dense(q, k, v, window):
    T = q.shape[2]
    mask = attention_mask(
        torch.arange(T, device=q.device), torch.arange(T, device=q.device), window
    )
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1]
    )


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_window_block_mask_is_the_window():
    """FlexAttention over the sliding-window block mask (uncompiled: its reference) equals SDPA
    with the dense window mask, for a length that is not a multiple of flex's 128-row blocks and
    GQA; the mask is built once per (T, window, device)."""
    g = torch.Generator().manual_seed(2)
    T, window = 200, 24
    q = torch.randn(1, 4, T, 16, generator=g)
    k, v = (torch.randn(1, 2, T, 16, generator=g) for _ in range(2))
    got = wa.flex_window(q, k, v, window, compiled=False)
    want = _dense(q.double(), k.double(), v.double(), window)
    check(scaled_err(got, want), fp32_sum_bound(2 * (T + 16)), "flex window")
    assert wa._window_block_mask(T, window, q.device) is wa._window_block_mask(T, window, q.device)


@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
def test_a_compiled_cpu_window_is_one_graph(cpu_ops):
    """While torch.compile traces, a CPU window takes torch's flash kernel per tile, not the
    banded kernel (its op has no fake kernel: tracing it failed), in one graph, with the same
    result (fp32 bound of the softmax chain, as tests/unit/test_window_attention.py)."""
    g = torch.Generator().manual_seed(6)
    T, window = 48, 8
    q = torch.randn(1, 4, T, 16, generator=g)
    k, v = (torch.randn(1, 2, T, 16, generator=g) for _ in range(2))
    assert wa.path(q) == "cpu_band"

    def layer(q, k, v):
        return wa.window_attention(q, k, v, window)

    got = torch.compile(layer, backend="eager", fullgraph=True)(q, k, v)
    want = _dense(q.double(), k.double(), v.double(), window)
    check(scaled_err(got, want), fp32_sum_bound(2 * (window + 16)), "compiled window")


# -------------------------------------------------------------------- the real kernels (CUDA)


def _grads(fn, *inputs, do):
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(do)
    return [out.detach(), *(t.grad for t in leaves)]


def _tile_as_function(mask, scale):
    """A tile's forward and backward (from its own out/lse) as an autograd function."""

    class Tile(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse = attention_tiles.forward(q, k, v, mask, scale)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, do):
            return attention_tiles.backward(do, *ctx.saved_tensors, mask, scale)

    return Tile.apply


@cuda
@pytest.mark.parametrize("kind", ["none", "causal", "band"])
def test_cuda_tiles_on_the_real_kernels(kind):
    """The fused tile kernels in bf16 round no worse than SDPA with the dense mask in bf16."""
    q, k, v, do = (t.cuda() for t in _tile_case(3, Hkv=2, G=4, Tq=200, Tk=328, d=64))
    mask, visible = _tile_masks(q.shape[2], k.shape[2])[kind]
    mask = attention_tiles.TileMask(
        mask.causal, None if mask.bias is None else mask.bias.cuda(), None
    )
    assert attention_tiles.path(q, mask) == ("cuda_efficient" if kind == "band" else "cuda_flash")
    scale = q.shape[-1] ** -0.5
    vis = None if visible is None else visible.cuda()

    def dense(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=vis, scale=scale, enable_gqa=True)

    exact = _grads(dense, *(t.double() for t in (q, k, v)), do=do.double())
    sdpa = _grads(dense, q, k, v, do=do)
    fused = _grads(_tile_as_function(mask, scale), q, k, v, do=do)
    for name, a, s, e in zip(("out", "dq", "dk", "dv"), fused, sdpa, exact, strict=True):
        check(scaled_err(a, e), 2 * scaled_err(s, e) + 2.0**-8, f"cuda {kind} {name}")


@cuda
def test_cuda_window_on_flash():
    g = torch.Generator().manual_seed(4)
    T, window = 1000, 128
    q, do = (torch.randn(2, 8, T, 64, generator=g).cuda().to(BF16) for _ in range(2))
    k, v = (torch.randn(2, 2, T, 64, generator=g).cuda().to(BF16) for _ in range(2))
    assert wa.path(q) == "cuda_flash_window"
    exact = _grads(lambda *t: _dense(*t, window), *(t.double() for t in (q, k, v)), do=do.double())
    dense = _grads(lambda *t: _dense(*t, window), q, k, v, do=do)
    fused = _grads(lambda *t: wa.window_attention(*t, window), q, k, v, do=do)
    for name, a, d, e in zip(("out", "dq", "dk", "dv"), fused, dense, exact, strict=True):
        check(scaled_err(a, e), 2 * scaled_err(d, e) + 2.0**-8, f"cuda window {name}")


@cuda
@pytest.mark.slow  # compiles FlexAttention's forward and backward (tens of seconds)
def test_cuda_window_on_flex():
    g = torch.Generator().manual_seed(5)
    T, window = 384, 100
    q, do = (torch.randn(1, 4, T, 64, generator=g).cuda() for _ in range(2))
    k, v = (torch.randn(1, 2, T, 64, generator=g).cuda() for _ in range(2))
    exact = _grads(lambda *t: _dense(*t, window), *(t.double() for t in (q, k, v)), do=do.double())
    dense = _grads(lambda *t: _dense(*t, window), q, k, v, do=do)
    flex = _grads(lambda *t: wa.flex_window(*t, window), q, k, v, do=do)
    for name, a, d, e in zip(("out", "dq", "dk", "dv"), flex, dense, exact, strict=True):
        check(scaled_err(a, e), 2 * scaled_err(d, e) + 2.0**-8, f"cuda flex {name}")
