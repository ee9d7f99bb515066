"""Shared cases, tolerances and helpers of the AttnRes kernel tests (test_kernels.py,
test_kernel_dispatch.py); the tolerances are derived in test_kernels.py's docstring."""

import importlib.util
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from depthscale import kernels  # noqa: E402
from depthscale.model.attnres_ops import (  # noqa: E402
    depth_read,
    inter_block_read_chained,
    merge_partial_chained,
)
from tolerances import check, fp32_sum_bound, scaled_err  # noqa: E402

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None and not sys.platform.startswith("linux"),
    reason="no Triton wheel for this platform",
)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


EPS = 1e-6


TOL = {torch.bfloat16: (2**-6, 1e-4), torch.float16: (2**-9, 1e-4)}
"""Stored in bf16/fp16: dtype -> (rtol, atol relative to the largest entry); see test_kernels.py's docstring."""


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


CPU_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def on_cpu(fn, *args, kernels_on: bool):
    with kernels.use_triton(False), kernels.use_cpu_kernels(kernels_on):
        return fn(*args)


def cpu_leaf(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape) * scale).to(dtype).requires_grad_()


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
