"""Recompute and offload change memory, never results."""

import pytest
import torch

from depthscale.config import ModelConfig
from depthscale.model.transformer import Transformer, cross_entropy
from depthscale.train.memory import (
    OffloadStats,
    apply_recompute,
    offload_activations,
    saved_activation_bytes,
)


def _model(residual, recompute):
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=61,
        dim=32,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=32,
        residual=residual,
        attnres_block_size=3,
    )
    model = Transformer(cfg)
    apply_recompute(model, recompute)
    return model


def _saved_bytes(model, tokens):
    losses = []
    saved = saved_activation_bytes(
        lambda: losses.append(cross_entropy(model(tokens), tokens)), list(model.parameters())
    )
    return losses[0], saved


@pytest.mark.parametrize("residual", ["standard", "full", "block"])
def test_recompute_is_exact_and_saves_memory(residual):
    tokens = torch.randint(0, 61, (2, 32), generator=torch.Generator().manual_seed(3))
    results = {}
    for mode in ("none", "selective", "full"):
        model = _model(residual, mode)
        loss, saved = _saved_bytes(model, tokens)
        loss.backward()
        results[mode] = (
            loss.item(),
            {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
            saved,
        )
    base_loss, base_grads, base_saved = results["none"]
    for mode in ("selective", "full"):
        loss, grads, _ = results[mode]
        assert loss == base_loss
        assert grads.keys() == base_grads.keys()
        for name, g in base_grads.items():
            torch.testing.assert_close(grads[name], g, atol=0, rtol=0, msg=f"{mode}: {name}")
    assert results["full"][2] < results["selective"][2] < base_saved


def test_offload_moves_every_saved_tensor_and_keeps_results():
    tokens = torch.randint(0, 61, (2, 16))
    model = _model("block", "none")
    ref_loss = cross_entropy(model(tokens), tokens)
    ref_loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    with offload_activations() as stats:
        loss = cross_entropy(model(tokens), tokens)
    loss.backward()
    assert isinstance(stats, OffloadStats) and stats.tensors > 0 and stats.bytes > 0
    for n, g in ref.items():
        torch.testing.assert_close(model.get_parameter(n).grad, g, atol=0, rtol=0)


def test_bad_mode():
    with pytest.raises(ValueError, match="allowed: 'none', 'selective', 'full'"):
        apply_recompute(_model("standard", "none"), "everything")
