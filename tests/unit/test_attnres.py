"""Attention Residuals: equivalences from the paper's math, and every read path against the reference."""

import pytest
import torch

from depthscale import kernels
from depthscale.config import ModelConfig
from depthscale.model.attnres_ops import (
    depth_read,
    depth_read_efficient,
    inter_block_read,
    merge_partial,
    multi_query_read,
)
from depthscale.model.residual import DepthState, block_assignment
from depthscale.model.transformer import Transformer, cross_entropy
from tolerances import check_close, fp32_model_bound, fp32_sum_bound


def cfg(**kw) -> ModelConfig:
    base = dict(
        vocab_size=61, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=32, norm_eps=1e-12
    )
    return ModelConfig(**(base | kw))


def logits_and_grads(model, tokens):
    model.zero_grad()
    logits = model(tokens)
    cross_entropy(logits, tokens).backward()
    return logits.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


@pytest.mark.parametrize(
    "residual,extra",
    [
        ("full", {}),
        ("block", {"attnres_n_blocks": 2}),
        ("block", {"attnres_block_size": 4}),
        ("block", {"attnres_n_blocks": 1}),
    ],
)
@pytest.mark.parametrize("read", ["two_phase", "efficient", "reference"])
@pytest.mark.parametrize("parallel", [False, True])
def test_zero_init_attnres_equals_prenorm_at_step_0(residual, extra, read, parallel):
    """With w = 0 a read is the mean of its sources; PreNorm(mean) == PreNorm(sum) up to eps (1e-12
    here: negligible). Counting the embedding twice, or dropping the PreNorm, breaks this. The two
    models compute it in other orders: within the model's fp32 bound (tests/tolerances.py)."""
    torch.manual_seed(0)
    standard = Transformer(cfg(parallel_block=parallel))
    attnres = Transformer(
        cfg(residual=residual, attnres_read=read, parallel_block=parallel, **extra)
    )
    missing, unexpected = attnres.load_state_dict(standard.state_dict(), strict=False)
    assert not unexpected and all("residual" in k for k in missing)
    tokens = torch.randint(0, 61, (2, 16))
    ref_logits, ref_grads = logits_and_grads(standard, tokens)
    logits, grads = logits_and_grads(attnres, tokens)
    bound = fp32_model_bound(attnres.cfg, 16, 2)
    check_close(logits, ref_logits, bound, "logits")
    for name, g in ref_grads.items():
        check_close(grads[name], g, bound, name)
    assert any(grads[n].abs().sum() > 0 for n in grads if n.endswith("pseudo_query"))


def randomize_queries(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("pseudo_query"):
                p.normal_(0, 0.5)
            elif name.endswith("residual.key_norm") or "residual.key_norm" in name:
                p.uniform_(0.5, 1.5)


def test_block_size_one_equals_full():
    torch.manual_seed(1)
    full = Transformer(cfg(residual="full"))
    randomize_queries(full)
    block = Transformer(cfg(residual="block", attnres_block_size=1))
    block.load_state_dict(full.state_dict())
    tokens = torch.randint(0, 61, (2, 10))
    torch.testing.assert_close(block(tokens), full(tokens), atol=0, rtol=0)


def test_one_block_is_a_two_source_read():
    """N = 1: every sublayer after the first reads exactly [b_0, running sum]."""
    model = Transformer(cfg(residual="block", attnres_n_blocks=1))
    seen = []
    for layer in model.layers.values():
        for res in layer.residuals():
            original = res.read
            res.read = lambda state, original=original: (
                seen.append(len(state.sources())),
                original(state),
            )[1]
    model(torch.randint(0, 61, (1, 8)))
    assert seen == [1] + [2] * (model.cfg.n_sublayers - 1)


@pytest.mark.parametrize(
    "kw,expected",
    [
        ({"residual": "block", "attnres_block_size": 4}, [0, 0, 0, 0, 1, 1]),
        ({"residual": "block", "attnres_block_size": 5}, [0, 0, 0, 0, 0, 1]),  # remainder block
        (
            {"residual": "block", "attnres_n_blocks": 4},
            [0, 1, 2, 3, 3, 3],
        ),  # leftover joins the last
        ({"residual": "full"}, [0, 1, 2, 3, 4, 5]),
    ],
)
def test_block_assignment(kw, expected):
    assert block_assignment(cfg(**kw)) == expected


def test_embedding_is_one_source_and_blocks_exclude_it():
    """After each block the state holds b_0 = embedding once, then block sums that do not contain it."""
    model = Transformer(cfg(residual="block", attnres_block_size=2))
    tokens = torch.randint(0, 61, (1, 6))
    state = model.embed(tokens)
    emb = state.blocks[0]
    cos, sin = model.rope(None, 6)
    outputs = []
    for layer in model.layers.values():
        before = len(state.blocks)
        state = layer(state, cos, sin)
        assert len(state.blocks) == before + 1 and state.partial is None
        outputs.append(state.blocks[-1])
    assert len(state.blocks) == 1 + model.cfg.n_layers
    # b_0 is still the embedding: the same storage (reads pass blocks on as aliases), unchanged
    assert state.blocks[0].data_ptr() == emb.data_ptr() and torch.equal(state.blocks[0], emb)
    # standard residual stream = embedding + all block sums: the embedding is in exactly one source
    standard = Transformer(cfg())
    standard.load_state_dict(model.state_dict(), strict=False)
    s = standard.embed(tokens)
    s = standard.run_layers(s)
    bound = fp32_model_bound(model.cfg, 6, 1, backward=False)  # two forwards, other sum orders
    check_close(s.partial, emb + sum(outputs), bound, "residual stream")


def rand_sources(m, dtype=torch.float32, shape=(2, 5, 16)):
    return [(torch.randn(*shape, dtype=dtype) * (1 + 0.25 * i)).requires_grad_() for i in range(m)]


def read_terms(m: int, d: int, tokens: int, backward: bool = True) -> int:
    """Reduction chain of a depth read over m sources of width d: key RMS and query·key over d,
    softmax and weighted sum over m; backward the same again, then the query / gain gradients' sum
    over every token and source."""
    forward = 2 * d + 2 * m
    return 2 * forward + tokens * m if backward else forward


def assert_grads_close(got, want, dtype, bound):
    """fp64: exact up to rounding. fp32: both paths add in other orders, so within `bound` (from
    read_terms) of the largest gradient entry."""
    for i, (a, b) in enumerate(zip(got, want)):
        if b is None:
            assert a is None or a.abs().max() == 0
            continue
        if dtype == torch.float64:
            torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
        else:
            check_close(a, b, bound, f"gradient {i}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("m", [1, 2, 5])
def test_efficient_read_matches_reference(m, dtype):
    src = rand_sources(m, dtype)
    q = torch.randn(16, dtype=dtype, requires_grad=True)
    g = torch.rand(16, dtype=dtype).add(0.5).requires_grad_()
    up = torch.randn(2, 5, 16, dtype=dtype)
    ref = depth_read(src, q, g, 1e-6)
    out = depth_read_efficient(src, q, g, 1e-6)
    if dtype == torch.float32:
        check_close(out, ref, fp32_sum_bound(read_terms(m, 16, 10, backward=False)), "out")
    else:
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    ins = [*src, q, g]
    assert_grads_close(
        torch.autograd.grad((out * up).sum(), ins, allow_unused=True),
        torch.autograd.grad((ref * up).sum(), ins, allow_unused=True),
        dtype,
        fp32_sum_bound(read_terms(m, 16, 10)),  # (2, 5, 16) sources: 10 tokens of width 16
    )


def test_multi_query_read_gradcheck_float64():
    src = rand_sources(3, torch.float64, (2, 3, 6))
    q = torch.randn(2, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, *s: multi_query_read(list(s), q, 1e-6), (q, *src))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n_blocks", [1, 3])
@pytest.mark.parametrize("cpu_kernels", [None, False])  # fp32: the C++ kernels (if built) / PyTorch
def test_two_phase_equals_reference_fwd_bwd(n_blocks, dtype, cpu_kernels):
    blocks, partial = rand_sources(n_blocks, dtype), rand_sources(1, dtype)[0]
    queries = torch.randn(4, 16, dtype=dtype, requires_grad=True)
    up = [torch.randn(2, 5, 16, dtype=dtype) for _ in range(4)]
    with kernels.use_cpu_kernels(cpu_kernels):
        out, lse = inter_block_read(blocks, queries, 1e-6)
        two_phase = [out[0]] + [
            merge_partial(out[s], lse[s], partial, queries[s], 1e-6) for s in range(1, 4)
        ]
    reference = [depth_read(blocks, queries[0], None, 1e-6)] + [
        depth_read([*blocks, partial], queries[s], None, 1e-6) for s in range(1, 4)
    ]
    m = n_blocks + 1  # sources of the widest read; the merge adds one more 2-way softmax
    for a, b in zip(two_phase, reference):
        if dtype == torch.float32:
            check_close(a, b, fp32_sum_bound(read_terms(m, 16, 10, backward=False) + 2), "out")
        else:
            torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    ins = [*blocks, partial, queries]
    with kernels.use_cpu_kernels(cpu_kernels):
        ga = torch.autograd.grad(sum((a * u).sum() for a, u in zip(two_phase, up)), ins)
    gb = torch.autograd.grad(sum((b * u).sum() for b, u in zip(reference, up)), ins)
    # + the 4 queries' contributions to each source gradient
    assert_grads_close(ga, gb, dtype, fp32_sum_bound(read_terms(m, 16, 10) + 4 + 4))


@pytest.mark.parametrize(
    "residual,extra",
    [
        ("full", {}),
        ("block", {"attnres_block_size": 4}),
        ("block", {"attnres_n_blocks": 2, "parallel_block": True}),
    ],
)
@pytest.mark.parametrize("cpu_kernels", [None, False])  # the C++ kernels (if built) / PyTorch
def test_read_impls_agree_in_the_model(residual, extra, cpu_kernels):
    torch.manual_seed(2)
    models = {
        r: Transformer(cfg(residual=residual, attnres_read=r, **extra))
        for r in ("reference", "efficient", "two_phase")
    }
    randomize_queries(models["reference"])
    for m in models.values():
        m.load_state_dict(models["reference"].state_dict())
    tokens = torch.randint(0, 61, (2, 12))
    ref_logits, ref_grads = logits_and_grads(models["reference"], tokens)
    bound = fp32_model_bound(models["reference"].cfg, 12, 2)  # the reads add in other orders
    for name in ("efficient", "two_phase"):
        with kernels.use_cpu_kernels(cpu_kernels):
            logits, grads = logits_and_grads(models[name], tokens)
        check_close(logits, ref_logits, bound, f"{name}: logits")
        for k, g in ref_grads.items():
            check_close(grads[k], g, bound, f"{name}: {k}")


def test_depth_state_sources():
    a, b = torch.zeros(1), torch.ones(1)
    assert DepthState([a], None).sources() == [a]
    assert DepthState([a], b).sources() == [a, b]


def test_too_many_blocks_is_a_clear_error_without_config_validation():
    from depthscale.errors import ConfigError

    with pytest.raises(ConfigError, match=r"model.attnres_n_blocks=8 must be in 1..4"):
        Transformer(cfg(residual="block", n_layers=2, attnres_n_blocks=8))


@pytest.mark.parametrize("residual", ["block", "full"])
@pytest.mark.parametrize("cpu_kernels", [None, False])  # the C++ kernels (if built) / PyTorch
def test_bf16_two_phase_reads_save_no_fp32_activations(residual, cpu_kernels):
    """Under bf16 autocast, phase-1 outputs are bf16 (log-sum-exps fp32): the two-phase reads keep
    no fp32 [B, T, d] tensor for backward, so AttnRes saves exactly the fp32 [B, T, d] tensors
    the standard residual's model saves (its norms'), and nothing else in fp32 of that shape."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 61, (2, 8))

    def saved_fp32_activations(model) -> int:
        seen: dict[int, tuple] = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = (tuple(t.shape), t.dtype)
            return t

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        with kernels.use_cpu_kernels(cpu_kernels), torch.autocast("cpu", torch.bfloat16), hooks:
            cross_entropy(model(tokens), tokens)
        return sum(v == ((2, 8, 32), torch.float32) for v in seen.values())

    attnres = Transformer(cfg(residual=residual, attnres_block_size=2))
    assert saved_fp32_activations(attnres) == saved_fp32_activations(Transformer(cfg()))


@pytest.mark.parametrize("read", ["reference", "efficient", "two_phase"])
def test_depth_reads_leave_their_argument_unchanged(read):
    """`h, state = res.read(state)`: a read hands its memo and aliases on in the state it returns;
    the state it was given keeps its blocks, partial sum and memo, so reading it again (recompute,
    a pipeline cache, a second consumer) gives the same input."""
    model = Transformer(cfg(residual="block", attnres_block_size=3, attnres_read=read))
    with torch.no_grad():
        for layer in model.layers.values():
            for res in layer.residuals():
                res.pseudo_query.normal_()
    g = torch.Generator().manual_seed(0)
    blocks = [torch.randn(2, 5, 32, generator=g) for _ in range(2)]
    state = DepthState(list(blocks), torch.randn(2, 5, 32, generator=g))
    before = (list(state.blocks), state.partial, state.inter)
    res = model.layers["1"].residuals()[0]  # a sublayer inside a block, with a partial sum
    h1, new = res.read(state)
    assert (list(state.blocks), state.partial, state.inter) == before
    assert all(a is b for a, b in zip(state.blocks, before[0], strict=True))
    h2, _ = res.read(state)
    torch.testing.assert_close(h1, h2, atol=0, rtol=0)
    assert isinstance(new, DepthState)
    if read == "two_phase":
        assert new.inter is not None and state.inter is None
