"""QK-clip (`train/qk_clip.py`) in one process: the recorded max logits are the masked logits' maxima
(causal, window, documents; GQA), and after a Muon step a head past τ has its max logit at τ while
the other heads keep theirs (their groups' weights untouched bit for bit)."""

from __future__ import annotations

import pytest
import torch

from depthscale.config import Config
from depthscale.model.attention_logits import max_logits
from depthscale.model.documents import Documents
from depthscale.model.layers import Attention, attention_mask
from depthscale.model.transformer import Transformer
from depthscale.train.muon import Muon
from depthscale.train.optim import muon_groups, param_groups
from depthscale.train.qk_clip import QKClip
from tolerances import U32


@pytest.mark.parametrize("window", [0, 3])
def test_max_logits_are_the_masked_maxima(window):
    torch.manual_seed(0)
    B, H, KV, T, hd = 2, 4, 2, 9, 8
    q, k = torch.randn(B, H, T, hd), torch.randn(B, KV, T, hd)
    tokens = torch.randint(0, 5, (B, T))
    docs = Documents.of(tokens, eos_id=0)
    # blocks of 2 query rows (tiny block_bytes) against the whole [T, T] reference
    got = max_logits(q, k, window, docs, block_bytes=4 * B * H * T * 2)
    scores = q @ k.repeat_interleave(H // KV, dim=1).mT / hd**0.5  # [B, H, T, T]
    pos = torch.arange(T)
    allowed = attention_mask(pos, pos, window)[None, None] & docs.same_document(pos, pos)
    want = scores.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3))
    assert (got - want).abs().max() <= 16 * U32 * scores.abs().max()


def _model(kv_heads: int) -> Transformer:
    m = Config().model
    m.vocab_size, m.dim, m.n_layers, m.max_seq_len = 64, 32, 2, 16
    m.n_heads, m.n_kv_heads = 4, kv_heads
    m.residual, m.attnres_n_blocks = "block", 2
    torch.manual_seed(0)
    return Transformer(m)


def _forward(model: Transformer, tokens: torch.Tensor) -> list[torch.Tensor]:
    """One training forward (grad enabled; no backward: the step then moves nothing but what
    the clip rescales); each layer's recorded per-head max logit."""
    model(tokens)
    return [layer.attention.logit_max.clone() for layer in model.layers.values()]


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
def test_a_head_past_tau_is_clipped_to_tau_and_the_others_keep_their_logits(kv_heads):
    model = _model(kv_heads)
    attn = model.layers["0"].attention
    hd = attn.head_dim
    with torch.no_grad():  # head 1 of layer 0 made much sharper than any other head
        attn.wq.weight[hd : 2 * hd] *= 8.0
    clip = QKClip(model, 1.0, 2, 4, kv_heads)  # tau set below, from the logits
    opt = Muon(muon_groups(model, param_groups(model, 0.1), Config().optim), qk_clip=clip)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    before = _forward(model, tokens)
    others = torch.cat([before[0][[0, 2, 3]], before[1]])
    assert before[0][1] > 2 * others.max()
    clip.tau = float(before[0][1] + others.max()) / 2  # only head 1 of layer 0 passes it
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    opt.zero_grad()
    assert clip.clipped.nonzero().tolist() == [[0, 1]]
    after = _forward(model, tokens)
    # the logits are bilinear in the rows scaled: exactly gamma_h, up to a few roundings
    tol = 64 * U32
    assert after[0][1] <= clip.tau * (1 + tol)
    assert after[0][1] >= clip.tau * (1 - tol)
    for h in (0, 2, 3):  # (layer 1's input changed with head 1's attention: not compared)
        assert abs(after[0][h] - before[0][h]) <= tol * abs(before[0][h])
    # untouched: every weight outside layer 0's q rows and its first kv head (group of head 1)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, weights[n])}
    assert changed == {"layers.0.attention.wq.weight", "layers.0.attention.wk.weight"}
    group = 4 // kv_heads
    kv = 1 // group
    wk, wk0 = attn.wk.weight, weights["layers.0.attention.wk.weight"]
    rows = torch.arange(wk.shape[0]) // hd != kv
    assert torch.equal(wk[rows], wk0[rows])
    if kv_heads == 4:  # one head per group: Kimi K2's sqrt(gamma) on both q and k
        wq, wq0 = attn.wq.weight, weights["layers.0.attention.wq.weight"]
        ratio_q = (wq[hd : 2 * hd] / wq0[hd : 2 * hd]).mean()
        ratio_k = (wk[hd : 2 * hd] / wk0[hd : 2 * hd]).mean()
        assert torch.allclose(ratio_q, ratio_k, rtol=tol)


def test_nothing_is_recorded_outside_training_forwards():
    """Evaluation (no grad, eval mode) and KV-cache decoding leave the recorded maxima alone."""
    model = _model(2)
    QKClip(model, 1.0, 2, 4, 2)
    tokens = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        model(tokens)
    model.eval()
    model(tokens).sum().backward()
    assert all(isinstance(m, Attention) is False or m.logit_max is None for m in model.modules())
