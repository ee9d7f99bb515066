"""The model against straightforward reference computations."""

import math

import pytest
import torch

from depthscale.config import ModelConfig
from depthscale.model.generate import generate
from depthscale.model.layers import apply_rope, attention_mask
from depthscale.model.transformer import Transformer
from tolerances import check_close, fp32_model_bound


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
    return ModelConfig(**(base | kw))


def reference_attention(attn, x, cos, sin, window):
    """Per-query loop: softmax over allowed keys, GQA by repeating K/V heads."""
    B, T, _ = x.shape
    hd = attn.head_dim
    q = attn.wq(x).view(B, T, -1, hd).transpose(1, 2)
    k = attn.wk(x).view(B, T, -1, hd).transpose(1, 2)
    v = attn.wv(x).view(B, T, -1, hd).transpose(1, 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = torch.zeros_like(q)
    for t in range(T):
        lo = 0 if window == 0 else max(0, t - window + 1)
        scores = q[:, :, t : t + 1] @ k[:, :, lo : t + 1].transpose(-1, -2) / math.sqrt(hd)
        out[:, :, t] = (scores.softmax(-1) @ v[:, :, lo : t + 1])[:, :, 0]
    return attn.wo(out.transpose(1, 2).reshape(B, T, -1))


def reference_forward(model, tokens, parallel):
    """Llama forward written out by hand: h += attn(norm(h)) (+ mlp(norm(h)) in parallel) ..."""
    h = model.tok_embeddings(tokens)
    T = tokens.shape[1]
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    for layer in model.layers.values():
        a = reference_attention(
            layer.attention, layer.attention_norm(h), cos, sin, model.cfg.sliding_window
        )
        if parallel:
            h = h + a + layer.feed_forward(layer.attention_norm(h))
        else:
            h = h + a
            h = h + layer.feed_forward(layer.ffn_norm(h))
    return model.output(model.norm(h))


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("window", [0, 5])
def test_forward_matches_reference(parallel, window):
    model = Transformer(tiny(parallel_block=parallel, sliding_window=window))
    tokens = torch.randint(0, 97, (2, 24))
    # SDPA vs the per-query loop: the same sums in other orders (tests/tolerances.py)
    bound = fp32_model_bound(model.cfg, 24, 2, backward=False)
    check_close(model(tokens), reference_forward(model, tokens, parallel), bound, "logits")


def test_sliding_window_limits_receptive_field():
    """With window w and n layers, logits at t depend only on tokens t-n(w-1)..t."""
    model = Transformer(tiny(sliding_window=3, n_layers=2))
    tokens = torch.randint(0, 97, (1, 20))
    changed = tokens.clone()
    changed[0, 5] = (changed[0, 5] + 1) % 97
    diff = (model(tokens) - model(changed)).abs().amax(-1)[0]
    assert diff[:5].max() == 0  # causal
    assert diff[5:10].min() > 0  # within reach 2·(3-1) = 4 positions
    assert diff[10:].max() == 0  # beyond the receptive field


def test_attention_mask():
    pos = torch.arange(5)
    m = attention_mask(pos, pos, 2)
    assert m.tolist()[3] == [False, False, True, True, False]
    assert attention_mask(pos, pos, 0).sum() == 15
    both = attention_mask(pos, pos, 2, causal=False)
    assert both.tolist()[3] == [False, False, True, True, True]
    assert attention_mask(pos, pos, 0, causal=False).all()


def test_parallel_block_has_one_norm_per_layer():
    model = Transformer(tiny(parallel_block=True))
    assert not hasattr(model.layers["0"], "ffn_norm")
    assert model.cfg.n_sublayers == 2


@pytest.mark.parametrize("residual", ["standard", "full", "block"])
@pytest.mark.parametrize("window", [0, 4])
def test_kv_cache_decoding_matches_full_forward(residual, window):
    model = Transformer(tiny(residual=residual, sliding_window=window, attnres_n_blocks=2)).eval()
    tokens = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        full = model(tokens)
        caches = model.make_caches(2, 12)
        parts = [model(tokens[:, :7], caches=caches, start=0)]
        parts += [model(tokens[:, t : t + 1], caches=caches, start=t) for t in range(7, 12)]
    # one token at a time against the cache: other GEMM shapes, so other summation orders
    check_close(torch.cat(parts, 1), full, fp32_model_bound(model.cfg, 12, 2, backward=False))


def test_greedy_generation_is_argmax_of_full_forward():
    model = Transformer(tiny(residual="block", attnres_n_blocks=2)).eval()
    prompt = torch.randint(0, 97, (1, 5))
    out = generate(model, prompt, max_new_tokens=6, temperature=0)
    with torch.no_grad():
        for t in range(5, 11):
            assert out[0, t] == model(out[:, :t])[0, -1].argmax()


def test_generation_rejects_too_long_request():
    model = Transformer(tiny()).eval()
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(model, torch.zeros(1, 60, dtype=torch.long), max_new_tokens=10)


def test_tied_embeddings_share_storage_and_untied_do_not():
    tied = Transformer(tiny(tie_embeddings=True))
    untied = Transformer(tiny(tie_embeddings=False))
    assert tied.output.weight is tied.tok_embeddings.weight
    assert untied.output.weight is not untied.tok_embeddings.weight


def test_initialisation_scales_output_projections():
    model = Transformer(tiny(n_layers=4, dim=64, init_std=0.02))
    wo = model.layers["0"].attention.wo.weight
    wq = model.layers["0"].attention.wq.weight
    assert wq.std().item() == pytest.approx(0.02, rel=0.1)
    assert wo.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.1)
