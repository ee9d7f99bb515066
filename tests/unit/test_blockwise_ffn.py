"""Blockwise FFN (`model.ffn_chunk_size`): exact, and keeps less activation memory for backward."""

import pytest
import torch

from depthscale.config import Config, ConfigError, ModelConfig
from depthscale.model.layers import SwiGLU
from depthscale.train.offload import saved_activation_bytes
from tolerances import check_close, fp32_sum_bound

# Chunks of tokens run through the same GEMMs in other shapes, so other summation orders
# (tests/tolerances.py): the output and input gradient reduce over dim and hidden (32 + 96, forward
# and back), the weight gradients also over the 2·23 tokens.
OUT_BOUND = fp32_sum_bound(32 + 96)
GRAD_BOUND = fp32_sum_bound(2 * (32 + 96) + 2 * 23)


def _pair(chunk: int) -> tuple[SwiGLU, SwiGLU]:
    torch.manual_seed(0)
    plain = SwiGLU(ModelConfig(dim=32, ffn_dim=96))
    blockwise = SwiGLU(ModelConfig(dim=32, ffn_dim=96, ffn_chunk_size=chunk))
    blockwise.load_state_dict(plain.state_dict())
    return plain, blockwise


@pytest.mark.parametrize("chunk", [4, 5, 64])
def test_blockwise_ffn_matches_plain_forward_and_backward(chunk):
    plain, blockwise = _pair(chunk)
    x = torch.randn(2, 23, 32)
    dy = torch.randn(2, 23, 32)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    outs = [m(xi) for m, xi in zip((plain, blockwise), xs)]
    check_close(outs[1], outs[0], OUT_BOUND, "out")
    for o in outs:
        o.backward(dy)
    check_close(xs[1].grad, xs[0].grad, GRAD_BOUND, "x.grad")
    for (name, p), q in zip(plain.named_parameters(), blockwise.parameters()):
        check_close(q.grad, p.grad, GRAD_BOUND, name)


def test_blockwise_ffn_saves_less_for_backward():
    plain, blockwise = _pair(8)
    x = torch.randn(1, 64, 32, requires_grad=True)
    full = saved_activation_bytes(lambda: plain(x), list(plain.parameters()))
    chunked = saved_activation_bytes(lambda: blockwise(x), list(blockwise.parameters()))
    # plain keeps ~4 [64, 96] intermediates; blockwise keeps only the input x [64, 32]
    assert chunked <= x.numel() * 4
    assert full >= 4 * 64 * 96 * 4
    with torch.no_grad():  # inference: no checkpointing, still chunked and exact up to rounding
        check_close(blockwise(x), plain(x), OUT_BOUND, "out")


def test_ffn_chunk_size_must_be_non_negative():
    cfg = Config()
    cfg.model.ffn_chunk_size = -1
    with pytest.raises(ConfigError, match="ffn_chunk_size"):
        cfg.validate()
