"""Document masking (`data.document_mask`): a packed row computes what its documents compute
alone — logits, loss and gradients — on every attention path, with sliding windows and every
residual kind. Distributed layouts: tests/dist/test_document_mask_layouts.py."""

import pytest
import torch
import torch.nn.functional as F

from depthscale.config import ModelConfig
from depthscale.model import attention_dispatch as dispatch
from depthscale.model import document_attention as da
from depthscale.model.documents import DocumentPacking, Documents
from depthscale.model.transformer import Transformer
from tolerances import check, fp32_model_bound, fp32_sum_bound, scaled_err

EOS = 1
ROWS = torch.tensor(
    [
        [5, 6, 7, 1, 8, 9, 4, 3, 1, 2, 5, 1, 6, 7, 8, 9, 2, 3, 4, 5, 6, 7, 1, 3],
        [1, 4, 4, 5, 6, 7, 8, 9, 2, 3, 4, 5, 1, 1, 6, 7, 8, 2, 3, 5, 6, 1, 9, 9],
    ]
)
"""Two packed rows of 24 tokens: documents of 3, 5, 3, 11 and 2 tokens, and of 12, 1, 8 and 3 (a
document starts at each EOS, and at position 0)."""


def test_a_document_starts_at_each_eos():
    docs = Documents.of(ROWS, EOS)
    assert docs.lengths() == [3, 5, 3, 11, 2, 12, 1, 8, 3]
    assert docs.ids[0, :4].tolist() == [0, 0, 0, 1]
    assert docs.rope_positions(None, 24)[0, :9].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0]
    pos = torch.tensor([0, 12, 13, 23])
    assert docs.rope_positions(pos, 24).tolist() == [[0, 1, 2, 1], [0, 0, 0, 2]]


def test_rows_without_a_boundary_need_no_documents():
    """A row inside one document computes as an unmasked row: the packing says so (None), and
    the unmasked kernels run."""
    assert DocumentPacking(EOS).documents(ROWS) is not None
    one_each = torch.tensor([[1, 4, 5, 6], [7, 8, 9, 2]])  # a document's start; a middle
    assert DocumentPacking(EOS).documents(one_each) is None


def test_the_eos_target_mask_is_optional():
    labels = ROWS[:, 1:]
    assert torch.equal(DocumentPacking(EOS).labels(labels), labels)
    masked = DocumentPacking(EOS, mask_eos_target=True).labels(labels)
    assert torch.equal(masked == -100, labels == EOS)


def _qkv(T=24, H=4, Hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, h, T, d, generator=g) for h in (H, Hkv, Hkv, H)]


def _grads(fn, q, k, v, do):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    out.backward(do)
    return out, q.grad, k.grad, v.grad


def _per_document(q, k, v, window):
    """Each document of each row through SDPA alone (causal, windowed by a dense band)."""
    docs = Documents.of(ROWS, EOS)
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        for doc in docs.host_ids[b].unique():
            at = (docs.host_ids[b] == doc).nonzero().flatten()
            t = at.numel()
            pos = torch.arange(t)
            mask = pos[:, None] >= pos[None, :]
            if window:
                mask &= pos[:, None] - pos[None, :] < window
            out[b, :, at] = F.scaled_dot_product_attention(
                q[b : b + 1, :, at], k[b : b + 1, :, at], v[b : b + 1, :, at],
                attn_mask=mask, enable_gqa=True,
            )[0]  # fmt: skip
    return out


def _fake_varlen(q, k, v, cum_q, cum_k, max_q, max_k, dropout, causal, debug, **kw):
    """What FlashAttention-2's varlen op computes, from its packed arguments alone."""
    assert torch.equal(cum_q, cum_k) and cum_q.dtype == torch.int32 and causal
    assert max_q == max_k == int((cum_q[1:] - cum_q[:-1]).max())
    left = kw["window_size_left"]
    out = torch.empty_like(q)
    for a, b in zip(cum_q[:-1].tolist(), cum_q[1:].tolist()):
        pos = torch.arange(b - a)
        mask = pos[:, None] >= pos[None, :]
        if left is not None:
            mask &= pos[:, None] - pos[None, :] <= left
        out[a:b] = F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1),
            attn_mask=mask, enable_gqa=True,
        ).transpose(0, 1)  # fmt: skip
    return (out,)


PATHS = {
    "cpu_tiles": lambda q, k, v, w, d: da.document_attention(q, k, v, w, d, block=5),
    "dense": da.dense,
    "varlen": lambda q, k, v, w, d: da.varlen(q, k, v, w, d, op=_fake_varlen),
    "flex": lambda q, k, v, w, d: da.flex(q, k, v, w, d, compiled=False),
}


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [0, 4])
@pytest.mark.parametrize("path", list(PATHS))
def test_every_path_attends_within_documents(path, window):
    q, k, v, do = _qkv()
    docs = Documents.of(ROWS, EOS)
    want = _per_document(q.double(), k.double(), v.double(), window)
    fn = PATHS[path]
    if path == "flex":  # uncompiled flex runs on CPU forward only
        got = [fn(q, k, v, window, docs)]
        pytest.importorskip("torch.nn.attention.flex_attention")
    else:
        got = _grads(lambda *t: fn(*t, window, docs), q, k, v, do)
        ref = _grads(lambda *t: _per_document(*t, window), q, k, v, do)
        for name, a, b in zip(("dq", "dk", "dv"), got[1:], ref[1:]):
            check(scaled_err(a, b), fp32_sum_bound(2 * (16 + 24) + 24), name)
    check(scaled_err(got[0], want), fp32_sum_bound(16 + 2 * 24), "out")


def test_the_cpu_path_skips_keys_before_the_blocks_documents():
    q, *_ = _qkv()
    docs = Documents.of(ROWS, EOS)
    blocks = da.blocks(docs, 0, 6, q)
    # rows 12..17: row 0's document starts at 11, row 1's at 12 or 13 → keys from 11
    assert [(b.i0, b.k0) for b in blocks] == [(0, 0), (6, 0), (12, 11), (18, 11)]
    assert da.blocks(docs, 0, 6, q) is blocks  # planned once per batch, shared by every layer
    assert [b.k0 for b in da.blocks(docs, 3, 6, q)] == [0, 4, 11, 16]


def test_dispatch_on_cuda_prefers_varlen_then_flex():
    caps = dispatch.Capabilities(flash=True, efficient=True, flash_window=True, flex=True)
    no_flash = dispatch.Capabilities(efficient=True, flex=True)
    bf16 = torch.bfloat16
    assert dispatch.document_path("cuda", bf16, 128, caps) == "cuda_varlen"
    assert dispatch.document_path("cuda", torch.float32, 128, caps) == "flex"
    assert dispatch.document_path("cuda", bf16, 128, no_flash) == "flex"
    assert dispatch.document_path("cuda", bf16, 8, dispatch.Capabilities()) == "sdpa_dense"
    assert dispatch.document_path("cpu", torch.float32, 64, caps) == "cpu_tiles"
    assert dispatch.document_path("cpu", torch.float16, 64, caps) == "sdpa_dense"


def _model(**kw) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=16, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, **kw
    )
    return Transformer(cfg).double().float()


def _loss_sum(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


MODELS = {
    "attnres": dict(residual="full"),
    "block_attnres_window": dict(residual="block", attnres_block_size=2, sliding_window=4),
    "standard_parallel": dict(residual="standard", parallel_block=True),
}


@pytest.mark.parametrize("kind", list(MODELS))
def test_a_packed_row_equals_its_documents_alone(kind):
    """Logits, summed loss and every gradient of the packed rows equal running each document as
    its own sequence (positions from 0) — AttnRes's depth reads are per token, so they need no
    mask, and this holds with them as with a standard residual."""
    tokens, labels = ROWS, torch.roll(ROWS, -1, 1)
    packed, alone = _model(**MODELS[kind]), _model(**MODELS[kind])
    docs = Documents.of(tokens, EOS)
    logits = packed(tokens, documents=docs)
    _loss_sum(logits, labels).backward()
    parts = torch.zeros_like(logits)
    total = 0.0
    for b in range(tokens.shape[0]):
        for doc in docs.host_ids[b].unique():
            at = (docs.host_ids[b] == doc).nonzero().flatten()
            out = alone(tokens[b : b + 1, at])
            total = total + _loss_sum(out, labels[b : b + 1, at])
            parts[b, at] = out[0].detach()
    total.backward()
    cfg = packed.cfg
    check(scaled_err(logits, parts), fp32_model_bound(cfg, 24, 2, backward=False), "logits")
    bound = fp32_model_bound(cfg, 24, 2)
    for (name, p), q in zip(packed.named_parameters(), alone.parameters()):
        check(scaled_err(p.grad, q.grad), bound, name)
    # and the mask matters: without it the packed rows see across documents
    with torch.no_grad():
        leaky = packed(tokens)
    assert scaled_err(leaky, parts) > 100 * fp32_model_bound(cfg, 24, 2, backward=False)


def test_rope_positions_restart_in_every_document():
    """RoPE is relative, so within a masked document a shifted start changes scores by rounding
    only (the parity above cannot see it): the tables themselves are checked here."""
    model = _model()
    docs = Documents.of(ROWS, EOS)
    cos, sin = model.rope(None, 24, docs)
    assert cos.shape == (2, 1, 24, model.cfg.head_dim)
    want = docs.rope_positions(None, 24)
    assert torch.equal(cos[:, 0], model.rope_cos[want]) and torch.equal(
        sin[:, 0], model.rope_sin[want]
    )
    shard = torch.tensor([3, 4, 20, 21])  # a context-parallel rank's tokens, by row position
    cos, _ = model.rope(shard, 24, docs)
    assert torch.equal(cos[:, 0], model.rope_cos[docs.rope_positions(shard, 24)])
    assert docs.rope_positions(shard, 24)[0].tolist() == [0, 1, 9, 10]
