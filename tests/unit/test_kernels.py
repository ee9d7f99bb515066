"""Triton AttnRes kernels against the PyTorch ops, forward and every gradient.

Without a GPU the kernels run under TRITON_INTERPRET=1, which must be set before the kernels are
defined (at import of `depthscale.kernels.attnres_triton`, which only these tests trigger).

Tolerances: kernels and reference do the same fp32 arithmetic on the same inputs in a different
order, so fp32 results — also for bf16/fp16 inputs: out, lse, d_queries, d_inter_out, d_lse — agree
to ~1e-6 of the tensor's scale. They are compared at rtol 1e-5 plus atol 1e-5 × the largest entry
(d_queries sums over tokens and sources: its rounding error scales with the terms, not the entry).
Results stored in bf16 (fp16) — d_sources, h, d_partial — can round to a neighbouring value: one
ulp, at most 2^-7 (2^-10) relative, so they are compared at two ulps, rtol 2^-6 (2^-9), with atol
1e-4 × the largest entry for entries that cancel to near zero.
"""

import importlib.util
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from depthscale import kernels  # noqa: E402
from depthscale.config import ModelConfig  # noqa: E402
from depthscale.model.attnres_ops import merge_partial, multi_query_read  # noqa: E402
from depthscale.model.transformer import Transformer, cross_entropy  # noqa: E402

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton not installed"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2**-6, 1e-4), torch.float16: (2**-9, 1e-4)}
"""dtype -> (rtol, atol relative to the largest entry); see the module docstring."""


def assert_close(got, want, msg=""):
    rtol, atol = TOL[want.dtype]
    atol *= max(want.abs().max().item(), 1.0)
    assert got.dtype == want.dtype, msg
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{msg}: {m}")


def leaf(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype).requires_grad_()


def grads_of(outputs, upstream, inputs):
    """Gradients of Σ upstream · outputs; an output with upstream None is left out of the loss."""
    loss = sum((o.float() * u).sum() for o, u in zip(outputs, upstream) if u is not None)
    return torch.autograd.grad(loss, inputs)


def pytorch(op, *args):
    """The PyTorch op, also where the dispatch would pick Triton (CUDA)."""
    with kernels.use_triton(False):
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
    for g, w, name in zip(got, want, ("out", "lse")):
        assert_close(g, w, name)
    upstream = [torch.randn_like(want[0]), torch.randn_like(want[1]) if use_lse else None]
    inputs = [queries, *sources]
    names = ["d_queries", *(f"d_source{i}" for i in range(m))]
    for g, w, name in zip(grads_of(got, upstream, inputs), grads_of(want, upstream, inputs), names):
        assert_close(g, w, name)


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
        assert_close(g, w)


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
    assert_close(got, want, "h")
    upstream = [torch.randn_like(want, dtype=torch.float32)]
    names = ["d_inter_out", "d_inter_lse", "d_partial", "d_query"]
    for g, w, name in zip(
        grads_of([got], upstream, inputs), grads_of([want], upstream, inputs), names
    ):
        assert_close(g, w, name)


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
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-5, msg=name)
