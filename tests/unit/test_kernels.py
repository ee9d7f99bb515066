"""Fused AttnRes kernels against the PyTorch ops, forward and every gradient.

Triton: without a GPU the kernels run under TRITON_INTERPRET=1, which must be set before the
kernels are defined (at import of `depthscale.kernels.attnres_triton`, which only these tests
trigger). C++ CPU kernels: built on first use (once per process, cached on disk); the tests also
check their determinism (bitwise), the chained gradient sums, the dispatch, the env switch and the
fallback when the build fails.

Tolerances: kernels and reference do the same fp32 arithmetic on the same inputs in a different
order, so fp32 results — lse, d_queries, d_lse, and for fp32 phase-1 outputs out and d_inter_out —
differ by at most `fp32_sum_bound` of the op's reduction chain (`read_terms`, `merge_terms`; see
tests/tolerances.py), relative to the tensor's largest entry (d_queries sums over tokens and sources:
its rounding error scales with the terms, which the chain's length covers). Results stored in bf16
(fp16) — out (phase-1 outputs are in the sources' dtype), d_sources, h, d_partial, d_inter_out — can
round to a neighbouring value: one ulp, at most 2^-7 (2^-10) relative, so they are compared at two
ulps, rtol 2^-6 (2^-9), with atol 1e-4 × the largest entry for entries that cancel to near zero.
The bf16 two-phase read against the fp32 reference has its own derived bound (`bf16_bounds`).
"""

import importlib.util
import os
import shutil
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from depthscale import kernels  # noqa: E402
from depthscale.config import ModelConfig  # noqa: E402
from depthscale.model.attnres_ops import (  # noqa: E402
    KernelFallbackError,
    depth_read,
    inter_block_read,
    inter_block_read_chained,
    kernel_paths,
    merge_partial,
    merge_partial_chained,
    multi_query_read,
    reset_kernel_paths,
)
from depthscale.model.transformer import Transformer, cross_entropy  # noqa: E402
from tolerances import check, fp32_model_bound, fp32_sum_bound, scaled_err  # noqa: E402

# Triton ships wheels for Linux only; there the dev extra installs it and these tests must run.
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None and not sys.platform.startswith("linux"),
    reason="no Triton wheel for this platform",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
TOL = {torch.bfloat16: (2**-6, 1e-4), torch.float16: (2**-9, 1e-4)}
"""Stored in bf16/fp16: dtype -> (rtol, atol relative to the largest entry); see the module docstring."""


def read_terms(m: int, S: int, B: int, T: int, d: int) -> int:
    """Reduction chain of a multi-query read: key RMS and query·key over d, softmax (and lse) and
    weighted sum over m sources; backward the same, then d_queries' sum over the B·T tokens of
    every source and d_sources' sum over the S queries."""
    return 2 * (2 * d + 2 * m) + B * T * m + S


def merge_terms(B: int, T: int, d: int) -> int:
    """A merge: RMS and dot over d, a two-way softmax; backward the same, then d_query over B·T."""
    return 2 * (2 * d + 2) + B * T


def assert_close(got, want, msg="", terms: int = 0):
    """fp32: within fp32_sum_bound(terms) of the largest entry; bf16/fp16: TOL."""
    assert got.dtype == want.dtype, msg
    if want.dtype == torch.float32:
        check(scaled_err(got, want), fp32_sum_bound(terms), msg)
        return
    rtol, atol = TOL[want.dtype]
    atol *= max(want.abs().max().item(), 1.0)
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{msg}: {m}")


def leaf(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype).requires_grad_()


def grads_of(outputs, upstream, inputs):
    """Gradients of Σ upstream · outputs; an output with upstream None is left out of the loss."""
    loss = sum((o.float() * u).sum() for o, u in zip(outputs, upstream) if u is not None)
    return torch.autograd.grad(loss, inputs)


def pytorch(op, *args):
    """The PyTorch op, also where the dispatch would pick Triton (CUDA) or the CPU kernels."""
    with kernels.use_triton(False), kernels.use_cpu_kernels(False):
        return op(*args)


@needs_triton
@pytest.mark.parametrize(
    "dtype,m,S,B,T,d,use_lse",
    [
        (torch.float32, 4, 3, 2, 7, 24, True),  # several sources, S not a power of two, odd d
        (torch.float32, 1, 1, 1, 7, 40, True),  # one source, one query
        (torch.float32, 3, 5, 4, 16, 64, False),  # 64 tokens: several blocks; lse unused
        (torch.bfloat16, 4, 3, 2, 7, 40, True),
        (torch.bfloat16, 1, 1, 2, 7, 24, True),
        (torch.float16, 2, 2, 1, 7, 24, True),
    ],
)
def test_multi_query_read_matches_pytorch(dtype, m, S, B, T, d, use_lse):
    from depthscale.kernels.attnres_triton import triton_multi_query_read

    sources = [leaf(B, T, d, dtype=dtype, scale=1 + 0.5 * i) for i in range(m)]
    queries = leaf(S, d, scale=0.5)
    got = triton_multi_query_read(sources, queries, EPS)
    want = pytorch(multi_query_read, sources, queries, EPS)
    assert got[0].shape == (S, B, T, d) and got[1].shape == (S, B, T)
    terms = read_terms(m, S, B, T, d)
    for g, w, name in zip(got, want, ("out", "lse")):
        assert_close(g, w, name, terms)
    upstream = [torch.randn_like(want[0]), torch.randn_like(want[1]) if use_lse else None]
    inputs = [queries, *sources]
    names = ["d_queries", *(f"d_source{i}" for i in range(m))]
    for g, w, name in zip(grads_of(got, upstream, inputs), grads_of(want, upstream, inputs), names):
        assert_close(g, w, name, terms)


@needs_triton
def test_multi_query_read_unaligned_sources():
    """A contiguous view 4 bytes into its storage: the kernels must not assume 16-byte alignment."""
    from depthscale.kernels.attnres_triton import triton_multi_query_read

    flat = torch.randn(2 * 7 * 24 + 1, device=DEVICE)
    sources = [flat[1:].view(2, 7, 24).requires_grad_(), leaf(2, 7, 24)]
    assert sources[0].data_ptr() % 16
    queries = leaf(2, 24)
    got = triton_multi_query_read(sources, queries, EPS)
    want = pytorch(multi_query_read, sources, queries, EPS)
    upstream = [torch.randn_like(want[0]), torch.randn_like(want[1])]
    for g, w in zip([*got, *grads_of(got, upstream, [queries, *sources])],
                    [*want, *grads_of(want, upstream, [queries, *sources])]):  # fmt: skip
        assert_close(g, w, "unaligned", read_terms(2, 2, 2, 7, 24))


@needs_triton
@pytest.mark.parametrize(
    "dtype,B,T,d",
    [
        (torch.float32, 2, 7, 24),
        (torch.float32, 4, 16, 64),  # several blocks, strided backward loop
        (torch.bfloat16, 2, 7, 40),
        (torch.float16, 1, 7, 24),
    ],
)
def test_merge_partial_matches_pytorch(dtype, B, T, d):
    from depthscale.kernels.attnres_triton import triton_merge_partial

    inter_out, partial = leaf(B, T, d), leaf(B, T, d, dtype=dtype)
    inter_lse = leaf(B, T, scale=3.0)  # both sides of the gate win somewhere
    query = leaf(d, scale=0.5)
    inputs = [inter_out, inter_lse, partial, query]
    got, want = triton_merge_partial(*inputs, EPS), pytorch(merge_partial, *inputs, EPS)
    terms = merge_terms(B, T, d)
    assert_close(got, want, "h", terms)
    upstream = [torch.randn_like(want, dtype=torch.float32)]
    names = ["d_inter_out", "d_inter_lse", "d_partial", "d_query"]
    for g, w, name in zip(
        grads_of([got], upstream, inputs), grads_of([want], upstream, inputs), names
    ):
        assert_close(g, w, name, terms)


@needs_triton
def test_dispatch_follows_device_and_override():
    sources, queries = [leaf(1, 3, 8) for _ in range(2)], leaf(2, 8)
    partial, query = leaf(1, 3, 8), leaf(8)

    def paths():
        out, lse = multi_query_read(sources, queries, EPS)
        h = merge_partial(out[0], lse[0], partial, query, EPS)
        return ["Triton" in t.grad_fn.name() for t in (out, h)]

    assert paths() == [DEVICE == "cuda"] * 2
    with kernels.use_triton(True):
        assert paths() == [True, True]
        with kernels.use_triton(False):
            assert paths() == [False, False]
        double = [s.double() for s in sources]
        assert "Triton" not in multi_query_read(double, queries.double(), EPS)[0].grad_fn.name()
    assert kernels.triton_override() is None


def test_without_triton_the_pytorch_ops_run(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    monkeypatch.delitem(sys.modules, "depthscale.kernels.attnres_triton", raising=False)
    monkeypatch.delattr(kernels, "attnres_triton", raising=False)
    sources, queries = [torch.randn(1, 3, 8) for _ in range(2)], torch.randn(1, 8)
    assert kernels.load_attnres_triton() is None
    with kernels.use_triton(None):
        multi_query_read(sources, queries, EPS)
    with kernels.use_triton(True), pytest.raises(ImportError):
        multi_query_read(sources, queries, EPS)


@needs_triton
@pytest.mark.parametrize("read", ["two_phase", "efficient"])
def test_model_with_triton_matches_pytorch(read):
    torch.manual_seed(1)
    cfg = ModelConfig(vocab_size=61, dim=24, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16,
                      residual="block", attnres_block_size=2, attnres_read=read)  # fmt: skip
    model = Transformer(cfg).to(DEVICE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("pseudo_query"):
                p.normal_(0, 0.5)
    tokens = torch.randint(0, 61, (2, 7), device=DEVICE)

    def run(triton: bool):
        model.zero_grad()
        with kernels.use_triton(triton):
            logits = model(tokens)
            cross_entropy(logits, tokens).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return logits.detach(), grads

    (ref_logits, ref_grads), (logits, grads) = run(False), run(True)
    bound = fp32_model_bound(cfg, 7, 2)  # the reads add in another order (tests/tolerances.py)
    check(scaled_err(logits, ref_logits), bound, "logits")
    for name, g in ref_grads.items():
        check(scaled_err(grads[name], g), bound, name)


# ---- C++ CPU kernels (built on first use; the first test that needs them pays the compile once) ----

CPU_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def cpu_ops():
    """The CPU kernels. Skipped where no C++ toolchain exists (then the fallback tests below still
    run); where one exists, a failed build fails the tests instead of hiding behind the fallback."""
    from depthscale.kernels import attnres_cpu

    if shutil.which(os.environ.get("CXX", "c++")) is None or shutil.which("ninja") is None:
        pytest.skip("no C++ compiler or ninja here: the CPU kernels cannot build (fallback tested)")
    if not attnres_cpu.enabled_by_env():
        pytest.skip("DEPTHSCALE_CPU_KERNELS=0")
    ops = attnres_cpu.load()
    assert ops is not None, "a C++ toolchain is present but the AttnRes CPU kernels did not build"
    return ops


def on_cpu(fn, *args, kernels_on: bool):
    with kernels.use_triton(False), kernels.use_cpu_kernels(kernels_on):
        return fn(*args)


def cpu_leaf(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape) * scale).to(dtype).requires_grad_()


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize(
    "m,S,B,T,d",
    [
        (4, 3, 2, 7, 24),  # d < 32: partial 16-lane block and zero-padded tail
        (1, 1, 1, 7, 40),  # one source
        (3, 6, 2, 5, 17),  # S > 4: two query groups (4 + 2); d not a multiple of 16
        (5, 2, 1, 3, 48),  # d a multiple of 16, not of 32
        (18, 2, 1, 3, 24),  # m > 16: the softmax's exp runs on two 16-lane chunks
    ],
)
def test_cpu_read_matches_pytorch(cpu_ops, dtype, m, S, B, T, d):
    sources = [cpu_leaf(B, T, d, dtype=dtype, scale=1 + 0.5 * i) for i in range(m)]
    queries = cpu_leaf(S, d, scale=0.5)
    got = on_cpu(multi_query_read, sources, queries, EPS, kernels_on=True)
    want = on_cpu(multi_query_read, sources, queries, EPS, kernels_on=False)
    terms = read_terms(m, S, B, T, d)
    for g, w, name in zip(got, want, ("out", "lse")):
        assert_close(g, w, name, terms)
    upstream = [torch.randn_like(want[0]), torch.randn_like(want[1])]
    upstream[0][0] = 0  # one query's output unused: its upstream gradient is zero
    inputs = [queries, *sources]
    names = ["d_queries", *(f"d_source{i}" for i in range(m))]
    for g, w, name in zip(grads_of(got, upstream, inputs), grads_of(want, upstream, inputs), names):
        assert_close(g, w, name, terms)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("B,T,d", [(2, 7, 24), (1, 5, 33)])
def test_cpu_merge_matches_pytorch(cpu_ops, dtype, B, T, d):
    inter_out, partial = cpu_leaf(B, T, d), cpu_leaf(B, T, d, dtype=dtype)
    inter_lse = cpu_leaf(B, T, scale=3.0)  # both sides of the gate win somewhere
    query = cpu_leaf(d, scale=0.5)
    inputs = [inter_out, inter_lse, partial, query]
    got = on_cpu(merge_partial, *inputs, EPS, kernels_on=True)
    want = on_cpu(merge_partial, *inputs, EPS, kernels_on=False)
    terms = merge_terms(B, T, d)
    assert_close(got, want, "h", terms)
    upstream = [torch.randn_like(want, dtype=torch.float32)]
    names = ["d_inter_out", "d_inter_lse", "d_partial", "d_query"]
    for g, w, name in zip(
        grads_of([got], upstream, inputs), grads_of([want], upstream, inputs), names
    ):
        assert_close(g, w, name, terms)


def _read_then_merge(blocks, partial, queries):
    """A block's reads as the model chains them: phase 1 (passing the blocks on), a merge with the
    partial sum (passing it on), then the next block's phase 1 over the passed-on blocks + 1."""
    out, lse, blocks = inter_block_read_chained(blocks, queries[:2], EPS)
    h, partial = merge_partial_chained(out[1], lse[1], partial, queries[1], EPS)
    nxt, _, _ = inter_block_read_chained([*blocks, partial * 1.5], queries[2:], EPS)
    return [out[0], h, *nxt, partial]


@pytest.mark.parametrize("kernels_on", [True, False])
def test_chained_reads_sum_gradients_like_autograd_bitwise(request, kernels_on):
    """Chaining moves the summation of a source's gradients from autograd's buffers into the reads'
    backward, in the same order: gradients are bitwise those of unchained reads of the same tensors."""
    if kernels_on:
        request.getfixturevalue("cpu_ops")
    blocks = [cpu_leaf(2, 5, 24, scale=1 + 0.3 * i) for i in range(3)]
    partial, queries = cpu_leaf(2, 5, 24), cpu_leaf(4, 24, scale=0.5)
    inputs = [*blocks, partial, queries]

    def unchained():
        out, lse = inter_block_read(blocks, queries[:2], EPS)
        h = merge_partial(out[1], lse[1], partial, queries[1], EPS)
        nxt, _ = inter_block_read([*blocks, partial * 1.5], queries[2:], EPS)
        return [out[0], h, *nxt, partial]

    with kernels.use_cpu_kernels(kernels_on):
        outs_a = _read_then_merge(blocks, partial, queries)
        outs_b = unchained()
        upstream = [torch.randn_like(o) for o in outs_a]
        for a, b in zip(outs_a, outs_b):
            assert torch.equal(a, b)
        for a, b in zip(grads_of(outs_a, upstream, inputs), grads_of(outs_b, upstream, inputs)):
            assert torch.equal(a, b)


def test_cpu_kernels_are_deterministic_and_layout_independent(cpu_ops):
    """Bitwise: run to run, 1 vs 2 threads, and per token independent of the batch it came in
    (pipeline parity relies on it) and of the sources' alignment."""
    B, T, d = 3, 37, 40
    sources = [cpu_leaf(B, T, d, scale=1 + 0.5 * i) for i in range(3)]
    queries = cpu_leaf(2, d, scale=0.5)
    upstream = [torch.randn(2, B, T, d), torch.randn(2, B, T)]

    def run(srcs, q=queries, up=upstream):
        with kernels.use_cpu_kernels(True):
            out = multi_query_read(srcs, q, EPS)
            return [*out, *grads_of(out, up, [q, *srcs])]

    first = run(sources)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run(sources)
    finally:
        torch.set_num_threads(threads)
    for a, b, c in zip(first, run(sources), single):
        assert torch.equal(a, b) and torch.equal(a, c)
    # one batch row alone: outputs and source gradients per token are the same bits
    row = [s.detach()[1:2].clone().requires_grad_() for s in sources]
    alone = run(row, up=[u[:, 1:2] for u in upstream])
    assert torch.equal(alone[0], first[0][:, 1:2]) and torch.equal(alone[1], first[1][:, 1:2])
    for a, b in zip(alone[3:], first[3:]):
        assert torch.equal(a, b[1:2])
    # a source 4 bytes into its storage (not 16-byte aligned)
    flat = torch.empty(B * T * d + 1)
    shifted = flat[1:].view(B, T, d).copy_(sources[0].detach()).requires_grad_()
    assert shifted.data_ptr() % 16
    moved = run([shifted, *sources[1:]])
    for a, b in zip(moved, first):
        assert torch.equal(a, b)


def test_cpu_path_float64_runs_in_pytorch_and_passes_gradcheck(cpu_ops):
    """float64 (gradcheck) is outside the kernels: dispatch falls back; chained reads and merges
    still have exact gradients."""
    blocks = [torch.randn(1, 3, 6, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    partial = torch.randn(1, 3, 6, dtype=torch.float64, requires_grad=True)
    queries = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    with kernels.use_cpu_kernels(True):
        assert torch.autograd.gradcheck(
            lambda b0, b1, p, q: tuple(_read_then_merge([b0, b1], p, q)),
            (*blocks, partial, queries),
        )


def test_cpu_dispatch_and_env_switch(cpu_ops, monkeypatch):
    from depthscale.kernels import attnres_cpu

    calls = []

    class Spy:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(cpu_ops, name)

    monkeypatch.setattr(attnres_cpu, "_ops", Spy())
    sources, queries = [cpu_leaf(1, 3, 8) for _ in range(2)], cpu_leaf(2, 8)
    out, lse = multi_query_read(sources, queries, EPS)
    (out.sum() + lse.sum()).backward()
    assert calls == ["read_forward", "read_backward"]
    with torch.no_grad():
        multi_query_read(sources, queries, EPS)
        merge_partial(out[0].detach(), lse[0].detach(), sources[0], queries[0], EPS)
    assert calls[2:] == ["read_forward", "merge_forward"]
    calls.clear()
    with kernels.use_cpu_kernels(False):
        multi_query_read(sources, queries, EPS)
    multi_query_read([s.double() for s in sources], queries.double(), EPS)  # fp64: PyTorch
    with kernels.strict(False):  # a missed kernel: only outside strict mode
        multi_query_read([sources[0], sources[1].bfloat16()], queries, EPS)  # mixed: PyTorch

    class Sharded(torch.Tensor):  # stands in for a DTensor query (tp + dp): no sharding rules
        pass

    multi_query_read(sources, queries.detach().as_subclass(Sharded), EPS)  # subclass: PyTorch
    monkeypatch.setenv("DEPTHSCALE_CPU_KERNELS", "0")
    multi_query_read(sources, queries, EPS)
    assert calls == []
    with kernels.use_cpu_kernels(True), pytest.raises(RuntimeError, match="DEPTHSCALE_CPU_KERNELS"):
        multi_query_read(sources, queries, EPS)


def test_failed_build_falls_back_once_with_a_warning(monkeypatch, caplog):
    """No compiler / a compile error: one warning, the PyTorch ops run, the model trains; a forced
    `use_cpu_kernels(True)` raises instead of silently testing PyTorch against itself."""
    from depthscale.kernels import attnres_cpu

    attempts = []

    def broken(name, cflags, ldflags):
        attempts.append(name)
        raise RuntimeError("Error building extension\nc++: error: unrecognized option")

    monkeypatch.setattr(attnres_cpu, "_build", broken)
    monkeypatch.setattr(attnres_cpu, "_ops", None)
    monkeypatch.setattr(attnres_cpu, "_tried", False)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=61, dim=24, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16,
                      residual="block", attnres_block_size=2)  # fmt: skip
    model = Transformer(cfg)
    tokens = torch.randint(0, 61, (2, 7))
    with caplog.at_level("WARNING", logger=attnres_cpu.__name__), kernels.strict(False):
        for _ in range(2):
            cross_entropy(model(tokens), tokens).backward()
    assert attempts == [name for name, _, _ in attnres_cpu.VARIANTS]  # tried once per process
    with pytest.raises(KernelFallbackError, match="CPU kernels not built"):  # strict: refused
        cross_entropy(model(tokens), tokens)
    warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "unrecognized option" in warnings[0].getMessage()
    assert all(p.grad is not None for n, p in model.named_parameters() if "layers.1" in n)
    with kernels.use_cpu_kernels(True), pytest.raises(RuntimeError, match="did not build"):
        multi_query_read([torch.randn(1, 2, 8)] * 2, torch.randn(1, 8), EPS)


# ---- bf16: phase-1 outputs in the sources' dtype, against the fp32 reference ---------------------

U_BF16 = 2.0**-8
"""bf16 unit roundoff: an 8-bit significand rounded to nearest, |fl(x) − x| ≤ 2^-8·|x|."""
U_BF16_TRUNCATED = 2.0**-7
"""Triton's interpreter (numpy) converts fp32 to bf16 by truncation: |fl(x) − x| < 2^-7·|x|."""
PATHS = {"torch": (False, False), "cpu": (False, True), "triton": (True, False)}
"""path -> (use_triton, use_cpu_kernels)."""


def two_phase(path, blocks, partial, queries):
    """A block's reads as the model runs them: phase 1 for its S queries (chained), the first
    sublayer's output straight from it, then S − 1 merges with the partial sum (chained)."""
    use_triton, use_cpu = PATHS[path]
    with kernels.use_triton(use_triton), kernels.use_cpu_kernels(use_cpu):
        out, lse, _ = inter_block_read_chained(blocks, queries, EPS)
        outs, p = [out[0]], partial
        for s in range(1, len(out)):
            h, p = merge_partial_chained(out[s], lse[s], p, queries[s], EPS)
            outs.append(h)
    return out, lse, outs


def bf16_bounds(blocks, partial, queries, upstream, u=U_BF16):
    """The fp32 reference (`depth_read` on the same bf16 values, unrounded) of the two-phase read's
    outputs and of the gradients of Σ_s upstream_s · h_s w.r.t. blocks, partial and queries, with
    the largest difference bf16 storage allows, derived from its roundings (each ≤ u relative,
    u = 2^-8; first order):

    forward: the phase-1 output o_s is rounded once (≤ u|o_s|) before the merge uses it and h_s
      once more when stored (≤ u|h_s|); o_s, h_s and the reference are convex combinations of the
      sources, so |h_s − ref_s| ≤ 2u·M (M = max |source|), u·M for h_0 = o_0 (no merge).
    backward (upstream exactly representable in bf16, so dh is not rounded): the roundings along a
      gradient's path, each at most u of the magnitude A of what it sums — Σ over the outputs of
      |their contributions|, for the queries also Σ over tokens (a rounding of o_s moves dα =
      α(1−α) dh·(o_s − p) by at most u of the same size):
      blocks 3 (o_s through dα; d_o_s = α dh_s; the stored gradient),
      partial S (o_s through dα; each merge's gradient stored; S − 2 bf16 sums of S − 1 merges),
      queries 2 (fp32: o_s through dα; d_o_s).
    Plus the fp32 reduction error (`fp32_sum_bound`) of the whole chain on the same magnitudes."""
    B, T, d = partial.shape
    m, S = len(blocks), queries.shape[0]
    blocks32 = [b.detach().float().requires_grad_() for b in blocks]
    p32 = partial.detach().float().requires_grad_()
    q32 = queries.detach().float().requires_grad_()
    outs = [depth_read([*blocks32, p32][: m + (s > 0)], q32[s], None, EPS) for s in range(S)]
    inputs = [*blocks32, p32, q32]
    contribs = [
        torch.autograd.grad((o * up).sum(), inputs, retain_graph=True, allow_unused=True)
        for o, up in zip(outs, upstream)
    ]
    grads = [sum(c[k] for c in contribs if c[k] is not None) for k in range(m + 2)]
    magnitude = [sum(c[k].abs() for c in contribs if c[k] is not None).max().item()
                 for k in range(m + 1)]  # fmt: skip
    q_terms = torch.zeros_like(q32)  # Σ over tokens of |one token's contribution|
    for s, (o, up) in enumerate(zip(outs, upstream)):
        for b in range(B):
            for t in range(T):
                (g,) = torch.autograd.grad((o[b, t] * up[b, t]).sum(), q32, retain_graph=True)
                q_terms[s] += g[s].abs()
    magnitude.append(q_terms.max().item())
    fp32 = fp32_sum_bound(read_terms(m + 1, S, B, T, d) + merge_terms(B, T, d))
    M = max(t.detach().abs().max().item() for t in [*blocks, partial])
    out_bounds = [((1 if s == 0 else 2) * u + fp32) * M for s in range(S)]
    roundings = [3] * m + [S, 2]
    grad_bounds = [(k * u + fp32) * a for k, a in zip(roundings, magnitude)]
    return [o.detach() for o in outs], grads, out_bounds, grad_bounds


def bf16_case(device="cpu"):
    torch.manual_seed(3)
    m, S, B, T, d = 3, 4, 2, 5, 24
    blocks = [(torch.randn(B, T, d, device=device) * (1 + 0.3 * i)).bfloat16().requires_grad_()
              for i in range(m)]  # fmt: skip
    partial = (torch.randn(B, T, d, device=device) * 2).bfloat16().requires_grad_()
    queries = (torch.randn(S, d, device=device) * 0.5).requires_grad_()
    upstream = [torch.randn(B, T, d, device=device).bfloat16().float() for _ in range(S)]
    return blocks, partial, queries, upstream


@pytest.mark.parametrize("path", ["torch", "cpu", pytest.param("triton", marks=needs_triton)])
def test_two_phase_bf16_within_rounding_bound_of_fp32_reference(request, path):
    """bf16 sources, fp32 queries: phase-1 outputs come out (and are saved) in bf16, log-sum-exps
    in fp32, and outputs and gradients stay within `bf16_bounds` of the fp32 reference on every
    path; the fused paths take the bf16 phase-1 outputs (no fallback)."""
    if path == "cpu":
        request.getfixturevalue("cpu_ops")
    blocks, partial, queries, upstream = bf16_case(DEVICE if path == "triton" else "cpu")
    reset_kernel_paths()
    out, lse, outs = two_phase(path, blocks, partial, queries)
    assert kernel_paths() == {"phase1": path, "merge": path}
    assert {o.dtype for o in out} == {torch.bfloat16} and {x.dtype for x in lse} == {torch.float32}
    interpreted = path == "triton" and os.environ.get("TRITON_INTERPRET") == "1"
    u = U_BF16_TRUNCATED if interpreted else U_BF16
    ref_outs, ref_grads, out_bounds, grad_bounds = bf16_bounds(
        blocks, partial, queries, upstream, u
    )
    for s, (h, ref, bound) in enumerate(zip(outs, ref_outs, out_bounds)):
        assert h.dtype == torch.bfloat16
        check((h.float() - ref).abs().max().item(), bound, f"{path}: h{s}")
    inputs = [*blocks, partial, queries]
    names = [*(f"d_block{i}" for i in range(len(blocks))), "d_partial", "d_queries"]
    for g, ref, bound, name in zip(grads_of(outs, upstream, inputs), ref_grads, grad_bounds, names):
        check((g.float() - ref).abs().max().item(), bound, f"{path}: {name}")


def test_two_phase_bf16_cpu_kernels_match_pytorch(cpu_ops):
    """Both are within `bf16_bounds` of the same fp32 reference, so within twice it of each other."""
    blocks, partial, queries, upstream = bf16_case()
    _, out_bounds, grad_bounds = bf16_bounds(blocks, partial, queries, upstream)[1:]
    inputs = [*blocks, partial, queries]
    runs = {}
    for path in ("cpu", "torch"):
        outs = two_phase(path, blocks, partial, queries)[2]
        runs[path] = [*outs, *grads_of(outs, upstream, inputs)]
    for i, (a, b, bound) in enumerate(zip(*runs.values(), [*out_bounds, *grad_bounds])):
        assert a.dtype == b.dtype
        check((a.float() - b.float()).abs().max().item(), 2 * bound, f"cpu vs torch, result {i}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", ["cpu", pytest.param("triton", marks=needs_triton)])
def test_merge_takes_inter_out_in_the_partial_dtype(request, path, dtype):
    """A phase-1 output in the partial sum's dtype is read as such by the fused merges (no
    fallback), and its gradient comes back in that dtype; same results as the PyTorch op."""
    if path == "cpu":
        request.getfixturevalue("cpu_ops")
    device = DEVICE if path == "triton" else "cpu"
    B, T, d = 2, 7, 40
    inter_out = (torch.randn(B, T, d, device=device)).to(dtype).requires_grad_()
    partial = torch.randn(B, T, d, device=device).to(dtype).requires_grad_()
    inter_lse = (torch.randn(B, T, device=device) * 3).requires_grad_()
    query = (torch.randn(d, device=device) * 0.5).requires_grad_()
    inputs = [inter_out, inter_lse, partial, query]
    use_triton, use_cpu = PATHS[path]
    reset_kernel_paths()
    with kernels.use_triton(use_triton), kernels.use_cpu_kernels(use_cpu):
        got = merge_partial(*inputs, EPS)
    assert kernel_paths() == {"merge": path}
    want = pytorch(merge_partial, *inputs, EPS)
    terms = merge_terms(B, T, d)
    assert_close(got, want, "h", terms)
    upstream = [torch.randn_like(want, dtype=torch.float32)]
    got_grads, want_grads = grads_of([got], upstream, inputs), grads_of([want], upstream, inputs)
    assert got_grads[0].dtype == dtype
    for g, w, name in zip(got_grads, want_grads, ["d_inter_out", "d_lse", "d_partial", "d_query"]):
        assert_close(g, w, name, terms)


# ---- which kernel path ran (`kernel_paths`, logged once per path and reason) ----------------------


def test_kernel_paths_and_fallback_reasons_are_recorded_and_logged_once(cpu_ops, caplog):
    blocks, partial, queries, _ = bf16_case()
    mixed = [blocks[0].float(), *blocks[1:]]  # an fp32 embedding before bf16 blocks
    reset_kernel_paths()
    with caplog.at_level("INFO", logger="depthscale.kernels"), kernels.strict(False):
        for _ in range(2):
            two_phase("cpu", blocks, partial, queries)
        assert kernel_paths() == {"phase1": "cpu", "merge": "cpu"}
        for _ in range(2):
            out, lse, _ = two_phase("cpu", mixed, partial, queries)
    assert out[0].dtype == torch.float32  # mixed: sources[0]'s dtype; the merge takes fp32 too
    assert kernel_paths() == {"phase1": "cpu+torch", "merge": "cpu"}
    assert (
        kernel_paths(reasons=True)["phase1"] == "cpu+torch (mixed source dtypes float32/bfloat16)"
    )
    records = [
        (r.levelname, r.getMessage()) for r in caplog.records if r.name == "depthscale.kernels"
    ]
    assert records == [  # once each; the missed kernel as a warning
        ("INFO", "AttnRes phase1 path: cpu"),
        ("INFO", "AttnRes merge path: cpu"),
        ("WARNING", "AttnRes phase1 path: torch (mixed source dtypes float32/bfloat16)"),
    ]

    class Sharded(torch.Tensor):  # stands in for a DTensor query (tp + dp)
        pass

    reset_kernel_paths()
    multi_query_read(blocks, queries.detach().as_subclass(Sharded), EPS)
    multi_query_read([b.double() for b in blocks], queries.double(), EPS)
    with kernels.use_cpu_kernels(False):
        merge_partial(out[1].bfloat16(), lse[1], partial, queries[1], EPS)
    assert kernel_paths(reasons=True) == {  # fallbacks without a kernel: allowed in strict mode
        "read": "torch (Sharded query)+torch (float64 source)",
        "merge": "torch (use_cpu_kernels(False))",
    }


def test_strict_mode_refuses_a_missed_kernel(cpu_ops):
    """Strict (the suite's default): a read that could have run the CPU kernels but did not raises,
    naming the read, the reason and how to turn it off; the same read falls back outside strict."""
    blocks, partial, queries, _ = bf16_case()
    mixed = [blocks[0].float(), *blocks[1:]]
    with kernels.strict(True), pytest.raises(KernelFallbackError) as err:
        two_phase("cpu", mixed, partial, queries)
    message = str(err.value)
    assert "AttnRes phase1 read" in message and "mixed source dtypes float32/bfloat16" in message
    assert "DEPTHSCALE_STRICT_KERNELS=0" in message
    with kernels.strict(False):
        out, _, _ = two_phase("cpu", mixed, partial, queries)
    assert out[0].dtype == torch.float32
    with kernels.strict(True):  # float64 and explicit overrides are not misses
        multi_query_read([b.double() for b in blocks], queries.double(), EPS)
        with kernels.use_cpu_kernels(False):
            multi_query_read(blocks, queries, EPS)


def test_suite_runs_strict():
    assert kernels.strict_mode(), "tests/conftest.py sets DEPTHSCALE_STRICT_KERNELS=1"


def test_bf16_autocast_model_runs_the_fused_cpu_kernels(cpu_ops):
    """Under bf16 autocast the whole depth state is bf16 (the embedding included), so every
    two-phase read and merge of a Block AttnRes model runs the C++ kernels, forward and backward."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, max_seq_len=16,
                      residual="block", attnres_block_size=2)  # fmt: skip
    model = Transformer(cfg)
    tokens = torch.randint(0, 128, (2, 8))
    reset_kernel_paths()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = cross_entropy(model(tokens), tokens)
    loss.backward()
    assert kernel_paths() == {"phase1": "cpu", "merge": "cpu"}
    assert all(p.grad is not None for n, p in model.named_parameters() if "residual" in n)


def test_kernel_paths_under_torch_compile_cost_no_graph_break_or_recompile():
    """Recording runs once while dynamo traces (assume_constant_result): one graph, no recompile."""
    from torch._dynamo.testing import CompileCounter

    blocks, partial, queries, _ = bf16_case()
    counter = CompileCounter()

    def reads(blocks, partial, queries):
        out, lse, _ = inter_block_read_chained(blocks, queries, EPS)
        return merge_partial_chained(out[1], lse[1], partial, queries[1], EPS)[0]

    compiled = torch.compile(reads, backend=counter, fullgraph=True)
    reset_kernel_paths()
    for _ in range(2):
        compiled(blocks, partial, queries).float().sum().backward()
    assert counter.frame_count == 1
    assert kernel_paths(reasons=True) == {
        "phase1": "torch (torch.compile tracing)",
        "merge": "torch (torch.compile tracing)",
    }


def test_importing_the_model_imports_neither_dynamo_nor_triton():
    """Triton reads TRITON_INTERPRET when it is imported: the model must import it only when a
    Triton read runs (an import at collection time broke every later interpreted test)."""
    import subprocess

    code = (
        "import sys, depthscale.model.transformer, depthscale.model.attnres_ops;"
        "print(sorted(m for m in ('triton', 'torch._dynamo') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
