"""Mixture-of-Experts FFN (`model/moe.py`) against the math written out per token, per expert:
outputs, auxiliary losses and gradients; dropless routing; the aux-loss-free bias update; the
grouped GEMM's call on the real op (meta device); an MoE model end to end; bad settings."""

import math

import pytest
import torch
import torch.nn.functional as F

from depthscale.config import Config, ConfigError, ModelConfig
from depthscale.model import moe
from depthscale.model.transformer import Transformer
from tolerances import check, fp32_model_bound, fp32_sum_bound, scaled_err

D, HIDDEN, E = 16, 24, 6


def _cfg(**kw) -> ModelConfig:
    base = dict(
        vocab_size=32, dim=D, n_layers=2, n_heads=2, max_seq_len=16, moe_experts=E, moe_top_k=2,
        moe_ffn_dim=HIDDEN, moe_z_loss=1e-3,
    )  # fmt: skip
    return ModelConfig(**(base | kw))


def _layer(**kw) -> moe.MoE:
    torch.manual_seed(0)
    layer = moe.MoE(_cfg(**kw))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return layer


def _by_hand(layer: moe.MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, auxiliary loss) token by token: its scores, its top-k, each chosen expert's
    SwiGLU, the shared experts; the Switch loss and z-loss from their definitions."""
    r, ex = layer.router, layer.experts
    tokens = x.reshape(-1, x.shape[-1])
    outs, probs, counts, lse = [], [], torch.zeros(E), []
    for t in tokens:
        logits = r.weight @ t
        scores = logits.softmax(-1) if r.gate == "softmax" else logits.sigmoid()
        pick = scores + r.expert_bias if r.balance == "bias" else scores
        chosen = pick.topk(r.top_k).indices
        w = scores[chosen]
        if r.normalize:
            w = w / w.sum()
        y = sum(
            w[j] * (F.silu(t @ ex.w_gate[e]) * (t @ ex.w_up[e])) @ ex.w_down[e]
            for j, e in enumerate(chosen.tolist())
        )
        if layer.shared is not None:
            y = y + layer.shared(t)
        outs.append(y)
        probs.append(scores / scores.sum())
        counts[chosen] += 1
        lse.append(logits.logsumexp(-1))
    aux = torch.zeros(())
    if r.balance == "aux_loss":
        share = counts / (len(tokens) * r.top_k)
        aux = aux + r.aux_coef * E * (share * torch.stack(probs).mean(0)).sum()
    aux = aux + r.z_coef * torch.stack(lse).square().mean()
    return torch.stack(outs).view(x.shape), aux


CASES = {
    "softmax_aux": dict(),
    "sigmoid_bias_shared": dict(moe_gate="sigmoid", moe_balance="bias", moe_shared_experts=1),
    "softmax_top1_unnormalised": dict(moe_top_k=1, moe_normalize_top_k=False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_layer_is_its_math_with_gradients(case):
    layer = _layer(**CASES[case])
    if layer.router.balance == "bias":
        layer.router.expert_bias.copy_(torch.linspace(-0.2, 0.3, E))
    x = torch.randn(2, 7, D, generator=torch.Generator().manual_seed(1))
    dy = torch.randn(2, 7, D, generator=torch.Generator().manual_seed(2))
    twin = _layer(**CASES[case])
    twin.load_state_dict(layer.state_dict())
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    layer.aux_scale = 0.5
    y = layer(x1)
    (y * dy).sum().backward()  # the layer's aux loss joins through its output, scaled by 0.5
    want, aux = _by_hand(twin, x2)
    ((want * dy).sum() + 0.5 * aux).backward()
    bound = fp32_sum_bound(2 * (D + HIDDEN) + 2 * 14 + E)
    check(scaled_err(y, want), bound, "out")
    check(scaled_err(x1.grad, x2.grad), bound, "dx")
    for (name, p), q in zip(layer.named_parameters(), twin.parameters(), strict=True):
        check(scaled_err(p.grad, q.grad), bound, name)


def test_shares_with_summed_counts_are_the_whole_batchs_loss_and_gradient():
    """Global-batch balance (`moe_balance_scope = "global_batch"`): ranks holding parts of a
    batch sum their per-expert slot counts and token counts (`totals`, detached), and each takes
    its own tokens' share of the loss with the sums. The shares add up to one process's loss of
    the whole batch, and their gradients to its gradient (the loss is linear in each token's
    scores once the counts are fixed) — unequal parts included. Each part's own loss, averaged
    (micro-batch balance), is another number: what the layouts disagreed on."""
    router = _layer().router
    x = torch.randn(12, D, generator=torch.Generator().manual_seed(5))
    whole_x = x.clone().requires_grad_()
    whole = router(whole_x).aux
    whole.backward()
    whole_dw, router.weight.grad = router.weight.grad, None
    parts = [p.clone().requires_grad_() for p in x.split([5, 7])]
    with torch.no_grad():  # what `totals` all-reduces: each part's slots per expert, its tokens
        counted = [torch.cat([router(p).load, torch.tensor([float(len(p))])]) for p in parts]
    totals = torch.stack(counted).sum(0)
    shares = [router(p, lambda c: totals).aux for p in parts]
    sum(shares).backward()
    bound = fp32_sum_bound(E + 12)
    loss = sum(shares).item()
    check(abs(loss - whole.item()) / whole.item(), bound, "loss")
    check(scaled_err(torch.cat([p.grad for p in parts]), whole_x.grad), bound, "dx")
    check(scaled_err(router.weight.grad, whole_dw), bound, "d router")
    own = sum(router(p.detach()).aux.detach() for p in parts) / len(parts)
    assert abs(own.item() - whole.item()) > 100 * bound * whole.item()


@pytest.mark.parametrize("path", ["grouped", "loop"])
def test_both_gemm_paths_are_the_math(path):
    """The grouped GEMM and the per-expert loop each give every group's rows times its weights,
    forward and backward — with an empty group and an expanded upstream gradient (a sum's)."""
    if path == "grouped" and not moe.grouped_mm_works(torch.device("cpu"), torch.float32):
        # a build without it on CPU (torch 2.11 here may lack it): the loop must be chosen
        assert moe.grouped_mm_path("cpu", torch.float32, (D, HIDDEN), False) == "loop"
        return
    g = torch.Generator().manual_seed(5)
    x = torch.randn(9, D, generator=g, requires_grad=True)
    w = torch.randn(3, D, HIDDEN, generator=g, requires_grad=True)
    counts = torch.tensor([4, 0, 5])
    moe.grouped_mm(x, w, counts, path).sum().backward()
    want = torch.cat([x[:4] @ w[0], x[4:] @ w[2]])
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    torch.cat([x2[:4] @ w2[0], x2[4:] @ w2[2]]).sum().backward()
    bound = fp32_sum_bound(D + 9)
    check(scaled_err(moe.grouped_mm(x, w, counts, path), want), bound, "out")
    check(scaled_err(x.grad, x2.grad), bound, "dx")
    check(scaled_err(w.grad, w2.grad), bound, "dw")


def test_routing_is_dropless_however_unbalanced():
    """Every token reaches all k of its experts even when all choose the same two (no capacity):
    the output is the math's, and the load counts every slot."""
    layer = _layer()
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[[1, 4], 0] = 5.0  # experts 1 and 4 win for every token with x_0 > 0
    x = torch.randn(1, 9, D, generator=torch.Generator().manual_seed(3)).abs()
    layer.train()
    y = layer(x)
    load = layer.take_load()
    assert torch.equal(load[:E], torch.tensor([0, 9, 0, 0, 9, 0.0])) and load[E] > 0  # aux last
    check(scaled_err(y, _by_hand(layer, x)[0]), fp32_sum_bound(2 * (D + HIDDEN)), "out")


def test_aux_loss_free_bias_moves_towards_the_mean_load():
    router = _layer(moe_balance="bias").router
    router.expert_bias.copy_(torch.tensor([0.1, 0.0, -0.1, 0.0, 0.2, 0.0]))
    load = torch.tensor([3.0, 1.0, 0.0, 4.0, 2.0, 2.0])  # mean 2
    moe.update_bias(router, load, 0.01)
    want = torch.tensor([0.09, 0.01, -0.09, -0.01, 0.2, 0.0])
    assert torch.allclose(router.expert_bias, want, atol=1e-7, rtol=0)


def test_load_is_counted_once_under_recompute_and_never_in_evaluation():
    torch.manual_seed(0)
    model = Transformer(_cfg(n_layers=2))
    model.set_recompute("full")
    tokens = torch.randint(0, 32, (2, 8))
    model.train()
    model(tokens).sum().backward()  # backward recomputes every layer's forward
    loads = [layer.feed_forward.take_load() for layer in model.layers.values()]
    assert all(int(load[:E].sum()) == 2 * 8 * 2 for load in loads)
    with torch.no_grad():
        model(tokens)
    model.eval()
    model(tokens)
    assert all(not layer.feed_forward.take_load().any() for layer in model.layers.values())


def test_grouped_mm_path_and_its_call_on_the_real_op():
    bf16, fp32 = torch.bfloat16, torch.float32
    assert moe.grouped_mm_path("cuda", bf16, (64, 128), True) == "grouped"
    assert moe.grouped_mm_path("cuda", fp32, (64, 128), True) == "loop"
    assert moe.grouped_mm_path("cuda", bf16, (64, 128), False) == "loop"
    assert moe.grouped_mm_path("cuda", bf16, (64, 36), True) == "loop"  # 72-byte rows: unaligned
    assert moe.grouped_mm_path("cpu", fp32, (16, 24), True) == "grouped"
    assert moe.grouped_mm_path("cpu", torch.float16, (16, 24), True) == "loop"
    x = torch.empty(10, 16, dtype=torch.bfloat16, device="meta", requires_grad=True)
    w = torch.empty(3, 16, 8, dtype=torch.bfloat16, device="meta", requires_grad=True)
    counts = torch.empty(3, dtype=torch.int64, device="meta")
    y = moe.grouped_mm(x, w, counts, path="grouped")
    assert y.shape == (10, 8) and y.dtype == torch.bfloat16
    y.backward(torch.empty_like(y))
    assert x.grad.shape == x.shape and w.grad.shape == w.shape


def test_an_moe_model_trains_through_its_experts_with_block_attnres():
    """Only layers from moe_first_dense on, every moe_every-th, are MoE; the model's loss and
    gradients are those of the same model with each MoE FFN computed by hand."""
    cfg = _cfg(n_layers=4, moe_first_dense=1, moe_every=2, residual="block", attnres_n_blocks=2)
    torch.manual_seed(0)
    model = Transformer(cfg)
    torch.manual_seed(0)
    twin = Transformer(cfg)
    kinds = [type(layer.feed_forward).__name__ for layer in model.layers.values()]
    assert kinds == ["SwiGLU", "MoE", "SwiGLU", "MoE"]
    for layer in twin.layers.values():
        if isinstance(layer.feed_forward, moe.MoE):
            f = layer.feed_forward
            f.forward = lambda x, proj=None, f=f: _attach(*_by_hand(f, x))
    tokens, labels = torch.randint(0, 32, (2, 2, 12)).unbind(0)
    for m in (model, twin):
        F.cross_entropy(m(tokens).flatten(0, 1), labels.flatten()).backward()
    bound = fp32_model_bound(cfg, 12, 2)
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        check(scaled_err(p.grad, q.grad), bound, name)
    assert model.layers["1"].feed_forward.router.weight.grad.abs().sum() > 0


def _attach(y, aux):
    return moe.AuxLoss.apply(y, aux, 1.0)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"moe_experts": 4, "moe_top_k": 5}, "moe_top_k=5 must be in 1..4"),
        ({"moe_experts": 4, "moe_first_dense": 4}, "leaves no MoE layer"),
        ({"moe_experts": 4, "moe_aux_loss": math.inf}, "moe_aux_loss=inf"),
        ({"moe_experts": 4, "parallel_block": True}, "parallel_block with model.moe_experts"),
        ({"moe_experts": -1}, "moe_experts=-1"),
        (
            {"moe_experts": 4, "moe_balance": "bias", "moe_balance_scope": "global_batch"},
            "model.moe_balance_scope='global_batch' needs model.moe_balance='aux_loss'",
        ),
    ],
)
def test_bad_moe_settings_are_one_line_errors(settings, message):
    cfg = Config()
    for key, value in settings.items():
        setattr(cfg.model, key, value)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        cfg.validate()


def test_an_unknown_balance_scope_is_a_one_line_error_naming_the_allowed():
    from depthscale.config.loading import set_value

    with pytest.raises(ConfigError, match="allowed: 'micro_batch', 'global_batch'$"):
        set_value(Config(), "model.moe_balance_scope", "global", from_string=True)


def test_the_planner_counts_moe_parameters():
    """The planner's model of an MoE model: every parameter (router, all experts, shared) and the
    active ones (what MFU counts), exactly (its layouts: tests/unit/test_plan_moe.py)."""
    from depthscale.shape import ModelShape

    cfg = _cfg(n_layers=3, moe_first_dense=1, moe_shared_experts=1)
    spec = ModelShape.from_config(cfg)
    model = Transformer(cfg)
    assert spec.params() == sum(p.numel() for p in model.parameters())
    # a token skips E - k of each MoE layer's routed experts: their share of the experts' weights
    routed = [m.experts for m in model.modules() if isinstance(m, moe.MoE)]
    idle = sum(
        sum(p.numel() for p in e.parameters())
        * (cfg.moe_experts - cfg.moe_top_k)
        // cfg.moe_experts
        for e in routed
    )
    assert len(routed) == 2 and spec.idle_params() == idle
    assert spec.active_params() == spec.params() - idle


def test_the_planners_moe_flops_are_what_the_model_computes(monkeypatch):
    """FLOPs of an MoE model's training step (`FlopCounterMode`; the per-expert loop, whose
    matmuls it counts, and attention through the math backend) equal the planner's: dropless
    routing sends exactly N·k rows through the routed experts whatever the routing."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from depthscale.shape import ModelShape

    monkeypatch.setattr(moe, "grouped_mm_works", lambda device, dtype: False)
    cfg = _cfg(n_layers=2, moe_first_dense=1, moe_shared_experts=1, max_seq_len=16)
    torch.manual_seed(0)
    model = Transformer(cfg)
    tokens = torch.randint(0, 32, (2, 16))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    assert counter.get_total_flops() == 2 * ModelShape.from_config(cfg).model_flops(16)


def test_a_compiled_model_runs_its_moe_eagerly_and_compiles_once():
    """Under torch.compile the MoE layer is left out of the graph (its routing is data-dependent):
    the compiled model gives the eager logits, and another batch — other routing, other group
    sizes — compiles nothing new."""
    from torch._dynamo.testing import CompileCounter

    torch.manual_seed(0)
    model = Transformer(_cfg(n_layers=2))
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)
    g = torch.Generator().manual_seed(9)
    first, second = torch.randint(0, 32, (2, 2, 12), generator=g).unbind(0)
    with torch.no_grad():
        check(scaled_err(compiled(first), model(first)), fp32_sum_bound(2 * (D + HIDDEN)), "logits")
        frames = counter.frame_count
        compiled(second)
    assert counter.frame_count == frames


@pytest.mark.parametrize("mode", ["selective", "sublayer", "full"])
def test_every_recompute_mode_gives_the_gradients_of_none(mode):
    """With the grouped-GEMM probe first run from inside a recomputed layer (it once ran under the
    layer's selective checkpoint, which then refused the backward): each mode's gradients are the
    plain run's."""
    moe.grouped_mm_works.cache_clear()
    grads = {}
    for m in ("none", mode):
        torch.manual_seed(0)
        model = Transformer(_cfg(n_layers=2, moe_balance="bias", moe_z_loss=0.0))
        model.set_recompute(m)
        tokens = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(4))
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
        grads[m] = {n: p.grad for n, p in model.named_parameters()}
        moe.grouped_mm_works.cache_clear()
    bound = fp32_model_bound(_cfg(n_layers=2), 12, 2)
    for name, g in grads["none"].items():
        check(scaled_err(grads[mode][name], g), bound, name)
