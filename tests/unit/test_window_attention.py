"""Blockwise sliding-window attention against SDPA with the dense window mask: same outputs and
gradients (fp32 bound of the softmax chain, tests/tolerances.py), for windows shorter and longer
than a block, of two keys, sequences that do not divide into blocks (a tail), several body blocks
whose key runs overlap, GQA, inputs laid out as the model makes them ([B, T, H, d] transposed),
and each CPU path: the project's banded CPU kernel (fp32), torch's fused flash kernel per tile
(bf16, or where the kernel does not build) and the SDPA blocks other devices take. The CUDA paths:
tests/unit/test_attention_dispatch.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from depthscale import kernels
from depthscale.model import window_attention as wa
from depthscale.model.layers import attention_mask, sdpa_attention
from tolerances import check, fp32_sum_bound, scaled_err


def _dense(q, k, v, window):
    T = q.shape[2]
    mask = attention_mask(torch.arange(T), torch.arange(T), window)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1]
    )


def _grads(fn, q, k, v, do):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(do)
    return [out.detach(), *(t.grad for t in leaves)]


@pytest.mark.parametrize("path", ["band", "tiles", "sdpa"])
@pytest.mark.parametrize(
    "T, window, block, heads",
    [
        (64, 8, 16, (4, 4)),
        (70, 24, 16, (6, 2)),
        (50, 40, 8, (4, 1)),
        (33, 5, 128, (2, 2)),
        (61, 2, 8, (2, 1)),
        (96, 20, 4, (4, 2)),
    ],
)
def test_window_attention_matches_the_dense_mask(
    request, monkeypatch, path, T, window, block, heads
):
    if path == "band":  # built (or skipped where no C++ toolchain exists, as the depth reads)
        request.getfixturevalue("cpu_ops")
    if path == "sdpa":  # the path of devices without a fused window kernel
        monkeypatch.setattr(wa, "path", lambda q: "sdpa_blocks")
    taken = []
    for name in ("_Band", "Tiles"):
        fn = getattr(wa, name).apply
        monkeypatch.setattr(
            getattr(wa, name), "apply", lambda *a, f=fn, n=name: taken.append(n) or f(*a)
        )
    g = torch.Generator().manual_seed(T + window)
    H, Hkv = heads

    def model_layout(h):  # [B, T, h, d] viewed as [B, h, T, d], as `Attention` passes them
        return torch.randn(2, T, h, 16, generator=g).transpose(1, 2)

    q, k, v, do = model_layout(H), model_layout(Hkv), model_layout(Hkv), model_layout(H)
    want = _grads(lambda *t: _dense(*t, window), q.double(), k.double(), v.double(), do.double())
    with kernels.use_cpu_kernels({"band": True, "tiles": False, "sdpa": None}[path]):
        got = _grads(lambda *t: wa.window_attention(*t, window, block), q, k, v, do)
    assert taken == {"band": ["_Band"], "tiles": ["Tiles"], "sdpa": []}[path]
    chain = 2 * (window + 16) + T * H // Hkv  # scores, softmax·V, back; dK/dV over the rows
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert a.shape == b.shape and a.dtype == torch.float32, name
        check(scaled_err(a, b), fp32_sum_bound(chain), name)


def test_the_model_takes_the_blockwise_path_for_a_window(monkeypatch):
    """`sdpa_attention` without positions and with a window shorter than the sequence runs the
    blockwise path; no window, or a window covering the sequence, keeps plain causal SDPA."""
    calls = []
    monkeypatch.setattr(
        "depthscale.model.layers.window_attention", lambda *a: calls.append(a[3]) or a[0]
    )
    q = torch.randn(1, 2, 32, 8)
    sdpa_attention(q, q, q, None, None, 8)
    sdpa_attention(q, q, q, None, None, 0)
    sdpa_attention(q, q, q, None, None, 32)
    assert calls == [8]


def test_bf16_window_is_as_close_to_fp64_as_the_dense_mask_in_bf16():
    """In bf16 the blockwise path (bias in bf16, fp32 LSE and dK/dV sums) rounds no worse than
    SDPA with the dense mask in bf16: each within twice the other's error from fp64, plus one
    bf16 ulp (2^-8) of the values' magnitude."""
    g = torch.Generator().manual_seed(3)
    T, window = 70, 24
    q = torch.randn(1, 4, T, 16, generator=g)
    k, v = (torch.randn(1, 2, T, 16, generator=g) for _ in range(2))
    do = torch.randn(1, 4, T, 16, generator=g)
    exact = _grads(lambda *t: _dense(*t, window), q.double(), k.double(), v.double(), do.double())
    bf = [t.bfloat16() for t in (q, k, v, do)]
    dense = _grads(lambda *t: _dense(*t, window), *bf)
    blockwise = _grads(lambda *t: wa.window_attention(*t, window, 16), *bf)
    for name, a, d, e in zip(("out", "dq", "dk", "dv"), blockwise, dense, exact, strict=True):
        assert a.dtype == torch.bfloat16, name
        check(scaled_err(a, e), 2 * scaled_err(d, e) + 2.0**-8, f"bf16 {name}")


def test_band_kernel_results_do_not_depend_on_the_thread_count(cpu_ops):
    """Tiles and backward runs are fixed by the shape, partials added in run order: one thread and
    two give the same bits (batch 2 × 2 KV heads, 12 blocks in 6 runs per head)."""
    g = torch.Generator().manual_seed(5)
    q, do = (torch.randn(2, 4, 96, 16, generator=g) for _ in range(2))
    k, v = (torch.randn(2, 2, 96, 16, generator=g) for _ in range(2))
    previous = torch.get_num_threads()
    runs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            with kernels.use_cpu_kernels(True):
                runs.append(_grads(lambda *t: wa.window_attention(*t, 20, 8), q, k, v, do))
    finally:
        torch.set_num_threads(previous)
    for name, a, b in zip(("out", "dq", "dk", "dv"), *runs, strict=True):
        assert torch.equal(a, b), name
