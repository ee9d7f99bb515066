"""The planner's charge for attention scores kept in memory (`plan/kernels.py`) against the bytes
the kernels of that computation move: every aten op of Megatron's unfused `CoreAttention`
(QKᵀ, the fused scale-mask-softmax — its causal mask made inside the kernel, so softmax alone
here —, dropout as the fused `native_dropout` kernel CUDA runs, PV) forward and backward, its
score-shaped inputs and outputs counted at torch's dispatcher (views move nothing)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from depthscale.plan.kernels import UnfusedAttention

BH, S, D = 6, 40, 16  # batch × heads, sequence (scores S × S), head dim (≠ S)


class _ScoreTraffic(TorchDispatchMode):
    """Bytes of [.., S, S] tensors each op reads or writes; an op whose output aliases an input
    (a view, a transpose) moves nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        inputs = {t.untyped_storage().data_ptr() for t in ins}
        if not any(o.untyped_storage().data_ptr() in inputs for o in outs):
            scores = [t for t in ins + outs if t.dim() >= 2 and t.shape[-2:] == (S, S)]
            self.bytes += sum(t.numel() * t.element_size() for t in scores)
        return out


def _core_attention(q, k, v, dropout: float):
    probs = torch.softmax(torch.bmm(q, k.transpose(1, 2)), dim=-1)
    if dropout:
        probs = torch.native_dropout(probs, dropout, True)[0]
    return torch.bmm(probs, v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_unfused_attention_traffic_is_what_its_kernels_move(dtype, dropout):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(BH, S, D, generator=g).to(dtype).requires_grad_() for _ in range(3))
    forward, backward = _ScoreTraffic(), _ScoreTraffic()
    with forward:
        out = _core_attention(q, k, v, dropout)
    grad = torch.randn_like(out)
    with backward:
        out.backward(grad)
    charge = UnfusedAttention(torch.finfo(dtype).bits // 8, dropout > 0)
    elements = BH * S * S
    assert forward.bytes == charge.forward_bytes * elements
    assert backward.bytes == charge.backward_bytes * elements


def test_bf16_with_dropout_is_13_and_19_bytes_per_score():
    """The numbers the published GPT runs are charged (the estimate had 12 and 24, extrapolated
    from one measured layer)."""
    assert (UnfusedAttention(2, True).forward_bytes, UnfusedAttention(2, True).backward_bytes) == (
        13,
        19,
    )
