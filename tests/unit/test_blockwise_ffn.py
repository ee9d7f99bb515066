"""Blockwise FFN (`model.ffn_chunk_size`): exact, and keeps less activation memory for backward."""

import pytest
import torch

from depthscale.config import Config, ConfigError, ModelConfig
from depthscale.model.layers import SwiGLU
from depthscale.train.memory import saved_activation_bytes


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
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-6)
    for o in outs:
        o.backward(dy)
    torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=0, atol=1e-6)
    for (name, p), q in zip(plain.named_parameters(), blockwise.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-5, msg=name)


def test_blockwise_ffn_saves_less_for_backward():
    plain, blockwise = _pair(8)
    x = torch.randn(1, 64, 32, requires_grad=True)
    full = saved_activation_bytes(lambda: plain(x), list(plain.parameters()))
    chunked = saved_activation_bytes(lambda: blockwise(x), list(blockwise.parameters()))
    # plain keeps ~4 [64, 96] intermediates; blockwise keeps only the input x [64, 32]
    assert chunked <= x.numel() * 4
    assert full >= 4 * 64 * 96 * 4
    with torch.no_grad():  # inference: no checkpointing, still chunked and exact
        torch.testing.assert_close(blockwise(x), plain(x), rtol=0, atol=1e-6)


def test_ffn_chunk_size_must_be_non_negative():
    cfg = Config()
    cfg.model.ffn_chunk_size = -1
    with pytest.raises(ConfigError, match="ffn_chunk_size"):
        cfg.validate()
