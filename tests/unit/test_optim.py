"""LAMB and AdamW against updates computed by hand, the decay/no-decay split, state round trips."""

import copy
import math

import pytest
import torch
from torch import nn

from depthscale.config import OptimConfig
from depthscale.train.optim import LAMB, build_optimizer, param_groups
from tolerances import U32, fp32_sum_bound, gamma

LR, B1, B2, EPS, WD = 0.1, 0.9, 0.99, 1e-6, 0.01


def norm(xs):
    return math.sqrt(sum(x * x for x in xs))


def lamb_step_by_hand(p, m, v, g, t):
    """One LAMB step on Python lists, written out: returns (p, m, v) after step number t."""
    m = [B1 * mi + (1 - B1) * gi for mi, gi in zip(m, g)]
    v = [B2 * vi + (1 - B2) * gi * gi for vi, gi in zip(v, g)]
    m_hat = [mi / (1 - B1**t) for mi in m]
    v_hat = [vi / (1 - B2**t) for vi in v]
    u = [mh / (math.sqrt(vh) + EPS) + WD * pi for mh, vh, pi in zip(m_hat, v_hat, p)]
    trust = norm(p) / norm(u) if norm(p) > 0 and norm(u) > 0 else 1.0
    trust = min(trust, 10.0)
    return [pi - LR * trust * ui for pi, ui in zip(p, u)], m, v


def test_lamb_two_steps_match_hand_computation():
    p0, g1, g2 = [3.0, 4.0, -1.0], [0.1, -0.2, 0.05], [0.3, 0.1, -0.4]
    # Step 1 by hand: m = 0.1·g1, v = 0.01·g1², m̂ = g1, v̂ = g1², so m̂/sqrt(v̂) = sign(g1) ≈ [1,-1,1];
    # u = [1.03, -0.96, 0.99], ‖p‖ = sqrt(26) = 5.099, ‖u‖ = 1.7214, trust = 2.962.
    p1, m1, v1 = lamb_step_by_hand(p0, [0.0] * 3, [0.0] * 3, g1, t=1)
    u1 = [1 + WD * 3.0, -1 + WD * 4.0, 1 + WD * -1.0]
    trust1 = norm(p0) / norm(u1)
    assert trust1 == pytest.approx(2.962, abs=1e-3)
    assert p1 == pytest.approx([pi - LR * trust1 * ui for pi, ui in zip(p0, u1)], abs=1e-5)
    # Step 2 exercises bias correction with 1-β1² = 0.19 and 1-β2² = 0.0199.
    p2, _, _ = lamb_step_by_hand(p1, m1, v1, g2, t=2)

    param = torch.tensor(p0, requires_grad=True)
    opt = LAMB([param], lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)
    param.grad = torch.tensor(g1)
    opt.step()
    # fp32 against Python floats: ~25 chained roundings on the step lr·trust·u (~0.3) and one on p
    # bound the error by u·(|p| + 25·0.3) ≈ 10u of |p1| ≥ 1.29; rel=1e-6 is 17u (seen ≤ 1.2u)
    assert param.tolist() == pytest.approx(p1, rel=1e-6)
    param.grad = torch.tensor(g2)
    opt.step()
    assert param.tolist() == pytest.approx(p2, rel=1e-6)
    state = opt.state[param]
    assert float(state["step"]) == 2.0
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32


def test_lamb_trust_ratio_is_one_for_zero_norms_and_clamped_above():
    # ‖p‖ = 0 (a zero-initialised vector): trust 1, so the step is lr·u with u = m̂/(sqrt(v̂)+eps).
    zero = torch.zeros(3, requires_grad=True)
    # ‖u‖ = 0 (no gradient, no decay): trust 1 and nothing moves, no NaN.
    still = torch.tensor([1.0, 2.0], requires_grad=True)
    opt = LAMB(
        [{"params": [zero], "weight_decay": WD}, {"params": [still], "weight_decay": 0.0}],
        lr=LR,
        betas=(B1, B2),
        eps=EPS,
    )
    zero.grad = torch.tensor([0.5, -0.25, 0.0])
    still.grad = torch.zeros(2)
    opt.step()
    expected = [-LR * g / (abs(g) + EPS) for g in (0.5, -0.25, 0.0)]
    assert zero.tolist() == pytest.approx(expected, rel=1e-6)
    assert still.tolist() == [1.0, 2.0]

    big = torch.tensor([300.0, 400.0], requires_grad=True)  # ‖p‖/‖u‖ ≈ 500/1.41 ≫ 10
    opt = LAMB([big], lr=LR, betas=(B1, B2), eps=EPS, max_trust_ratio=10.0)
    big.grad = torch.tensor([1.0, -1.0])
    opt.step()
    assert big.tolist() == pytest.approx([300.0 - LR * 10.0, 400.0 + LR * 10.0], rel=1e-6)


def test_lamb_non_adaptive_group_is_a_plain_adam_step():
    p = torch.tensor([1e-4, -1e-4], requires_grad=True)  # tiny ‖p‖ would make trust ≈ 1e-4
    opt = LAMB([p], lr=LR, betas=(B1, B2), eps=EPS, adaptive=False)
    p.grad = torch.tensor([2.0, -3.0])
    opt.step()
    assert p.tolist() == pytest.approx([1e-4 - LR, -1e-4 + LR], rel=1e-5)


def test_lamb_norm_fn_is_pluggable():
    calls = []

    def norm_fn(t):
        calls.append(t.shape)
        return torch.linalg.vector_norm(t)

    p = torch.tensor([1.0, 2.0], requires_grad=True)
    opt = LAMB([p], lr=LR, norm_fn=norm_fn)
    p.grad = torch.ones(2)
    opt.step()
    assert calls == [torch.Size([2]), torch.Size([2])]  # ‖p‖ and ‖u‖


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lamb_state_dict_round_trip_gives_identical_next_step(dtype):
    torch.manual_seed(0)
    a = [
        torch.randn(4, 3, dtype=dtype, requires_grad=True),
        torch.randn(3, dtype=dtype, requires_grad=True),
    ]
    opt_a = LAMB(
        [{"params": [a[0]], "weight_decay": WD}, {"params": [a[1]], "adaptive": False}],
        lr=LR,
        betas=(B1, B2),
        eps=EPS,
    )
    for _ in range(2):
        for p in a:
            p.grad = torch.randn_like(p)
        opt_a.step()
    saved = copy.deepcopy(opt_a.state_dict())

    b = [p.detach().clone().requires_grad_(True) for p in a]
    opt_b = LAMB([{"params": [b[0]], "weight_decay": 0.5}, {"params": [b[1]]}], lr=1.0)
    opt_b.load_state_dict(saved)
    for p in b:
        assert opt_b.state[p]["exp_avg"].dtype == torch.float32  # not cast to the param dtype
    assert (
        opt_b.param_groups[0]["weight_decay"] == WD and opt_b.param_groups[1]["adaptive"] is False
    )
    for pa, pb in zip(a, b):
        pa.grad = torch.randn_like(pa)
        pb.grad = pa.grad.clone()
    opt_a.step()
    opt_b.step()
    for pa, pb in zip(a, b):
        assert torch.equal(pa, pb)
        assert torch.equal(opt_a.state[pa]["exp_avg_sq"], opt_b.state[pb]["exp_avg_sq"])


class PerTensorLAMB(LAMB):
    """The per-parameter loop LAMB.step used to be: the reference for the multi-tensor step. Also
    records the largest step |lr·r·u| taken and whether the clamp bit."""

    largest_step = 0.0
    clamped = False

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            max_trust, adaptive = group["max_trust_ratio"], group["adaptive"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                step = float(state["step"])
                grad = p.grad.float()
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.lerp_(grad, 1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                m_hat = exp_avg / (1.0 - beta1**step)
                v_hat = exp_avg_sq / (1.0 - beta2**step)
                p32 = p.float()
                update = m_hat / (v_hat.sqrt() + eps)
                if wd != 0.0:
                    update.add_(p32, alpha=wd)
                trust = torch.ones(())
                if adaptive:
                    w_norm, u_norm = torch.linalg.vector_norm(p32), torch.linalg.vector_norm(update)
                    ok = (w_norm > 0) & (u_norm > 0)
                    trust = torch.where(ok, w_norm / torch.where(ok, u_norm, 1.0), 1.0)
                    if max_trust is not None:
                        self.clamped |= bool(trust > max_trust)
                        trust = trust.clamp(max=max_trust)
                delta = (lr * trust) * update if adaptive else lr * update
                self.largest_step = max(self.largest_step, delta.abs().max().item())
                p.copy_(p32 - delta)


def _lamb_case(opt_cls, dtype, device, max_trust, **kw):
    """Parameters that exercise every branch: decay; ‖p‖ = 0 (zero init); ‖u‖ = 0 (zero gradient,
    no decay); r far above the clamp (large weights, no decay); a first gradient only at step 2
    (its own bias correction); a non-adaptive vector; a parameter that never gets a gradient."""
    g = torch.Generator().manual_seed(0)

    def new(*shape, scale=1.0):
        t = scale * torch.randn(*shape, generator=g)
        return t.to(device=device, dtype=dtype).requires_grad_(True)

    params = {
        "w": new(6, 8),
        "zero": new(5, scale=0.0),
        "late": new(7, 3),
        "still": new(3),
        "big": new(4, 4, scale=100.0),
        "vec": new(8),
        "unused": new(2, 2),
    }
    groups = [
        {"params": [params[k] for k in ("w", "zero", "late")], "weight_decay": 0.1},
        {"params": [params[k] for k in ("still", "big", "unused")], "weight_decay": 0.0},
        {"params": [params["vec"]], "adaptive": False},
    ]
    opt = opt_cls(groups, lr=0.05, betas=(B1, B2), eps=EPS, max_trust_ratio=max_trust, **kw)
    return params, opt


def _lamb_grads(params: dict, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for name, p in params.items():
        if name == "unused" or (name == "late" and step == 0):
            p.grad = None
        elif name == "still":
            p.grad = torch.zeros_like(p)
        else:
            p.grad = torch.randn(p.shape, generator=g).to(p)


# the device the suite runs on: CUDA's foreach kernels where there is a GPU, else the CPU (no
# skipped variants: CI counts a skip as a missing test)
DEVICES = ["cuda" if torch.cuda.is_available() else "cpu"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm_fn", [None, torch.linalg.vector_norm], ids=["multi", "norm_fn"])
@pytest.mark.parametrize("max_trust", [10.0, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lamb_multi_tensor_step_matches_per_tensor_loop(dtype, max_trust, norm_fn, device):
    steps = 4
    params, opt = _lamb_case(LAMB, dtype, device, max_trust, norm_fn=norm_fn)
    ref_params, ref = _lamb_case(PerTensorLAMB, dtype, device, max_trust)
    for t in range(steps):
        _lamb_grads(params, t)
        _lamb_grads(ref_params, t)
        opt.step()
        ref.step()
    assert ref.clamped == (max_trust is not None)  # the clamp bit (r ≈ 100 on "big")
    assert params["unused"].grad is None and not opt.state[params["unused"]]
    # Same fp32 operations in the same order on the same tensors. On CPU the foreach ops run the
    # per-tensor kernels, so the results are bitwise equal (seen). On CUDA the foreach kernels may
    # round differently: a scalar division as a product with the reciprocal, and _foreach_norm
    # sums in another order. Per step that moves u by a few roundings of its ~10 elementwise
    # operations (≤ 20u relative, both sides), each norm by ≤ γ_n (n ≤ 48 elements) and the ratio
    # r by ≤ 4γ_n + 2u, so the step lr·r·u by ≤ (4γ_n + 22u) of its size, and p by one more
    # rounding u·|p|; over `steps` steps (the feedback through wd·p and ‖p‖ is ≤ lr·r·wd ≈ 0.05
    # per step, covered by the factor 2). bf16 parameters: an fp32 difference that straddles a bf16
    # rounding boundary flips the result by one bf16 ulp, ≤ 2^-7·|p| per step.
    rel_step = 4 * gamma(48) + 22 * U32
    atol = 2 * steps * rel_step * ref.largest_step
    rtol = 2 * steps * (U32 if dtype == torch.float32 else 2.0**-7)
    for name, p in params.items():
        q = ref_params[name]
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=name)
        for key in ("exp_avg", "exp_avg_sq"):
            if opt.state[p]:  # moments: elementwise only, a few roundings per step
                torch.testing.assert_close(
                    opt.state[p][key], ref.state[q][key], rtol=2 * steps * 20 * U32, atol=0.0
                )
        assert bool(opt.state[p].get("step", 0) == ref.state[q].get("step", 0))


def test_lamb_loads_a_state_dict_saved_by_the_per_tensor_step():
    """The state-dict format is unchanged: a checkpoint of the old loop resumes bit-identically."""
    params, old = _lamb_case(PerTensorLAMB, torch.float32, "cpu", 10.0)
    for t in range(2):
        _lamb_grads(params, t)
        old.step()
    saved = copy.deepcopy(old.state_dict())
    resumed_params, new = _lamb_case(LAMB, torch.float32, "cpu", 10.0)
    with torch.no_grad():
        for name, p in resumed_params.items():
            p.copy_(params[name])
    new.load_state_dict(saved)
    _lamb_grads(params, 2)
    _lamb_grads(resumed_params, 2)
    old.step()
    new.step()
    for name, p in resumed_params.items():
        assert torch.equal(p, params[name]), name


class Tiny(nn.Module):
    """One of each kind of parameter the decay split must classify."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 2)  # decay
        self.proj = nn.Linear(2, 2, bias=True)  # weight: decay; bias: no decay
        self.norm_gain = nn.Parameter(torch.ones(2))  # no decay
        self.pseudo_query = nn.Parameter(torch.zeros(2))  # no decay
        self.attnres_mix = nn.Parameter(torch.ones(2, 2))  # a matrix, but AttnRes: no decay
        self.block_pseudo_query = nn.Parameter(torch.ones(2, 2))  # a matrix, but a query: no decay
        self.frozen = nn.Parameter(torch.ones(2, 2), requires_grad=False)  # not optimized


def test_param_group_split():
    model = Tiny()
    names = {id(p): n for n, p in model.named_parameters()}
    for name in ("adamw", "lamb"):
        opt = build_optimizer(model, OptimConfig(name=name, weight_decay=WD))
        decay, no_decay = opt.param_groups
        assert sorted(names[id(p)] for p in decay["params"]) == ["emb.weight", "proj.weight"]
        assert sorted(names[id(p)] for p in no_decay["params"]) == [
            "attnres_mix",
            "block_pseudo_query",
            "norm_gain",
            "proj.bias",
            "pseudo_query",
        ]
        assert decay["weight_decay"] == WD and no_decay["weight_decay"] == 0.0
    assert isinstance(opt, LAMB) and no_decay["adaptive"] is False and decay["adaptive"] is True


def test_adamw_one_step_matches_hand_computation():
    cfg = OptimConfig(name="adamw", lr=LR, beta1=B1, beta2=B2, eps=EPS, weight_decay=WD)
    model = Tiny()
    with torch.no_grad():
        model.proj.weight.copy_(torch.tensor([[1.0, -2.0], [0.5, 4.0]]))
        model.norm_gain.copy_(torch.tensor([1.0, 3.0]))
    opt = build_optimizer(model, cfg)
    assert isinstance(opt, torch.optim.AdamW)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    grad_w = [[0.2, -0.1], [0.0, 0.4]]
    model.proj.weight.grad = torch.tensor(grad_w)
    model.norm_gain.grad = torch.tensor([-0.3, 0.6])
    opt.step()
    # Step 1: m̂ = g and v̂ = g² after bias correction, so the Adam direction is g/(|g|+eps);
    # decoupled decay first shrinks a decayed weight by (1 - lr·wd).
    w0 = [[1.0, -2.0], [0.5, 4.0]]
    expected_w = [
        [w * (1 - LR * WD) - LR * g / (abs(g) + EPS) for w, g in zip(wr, gr)]
        for wr, gr in zip(w0, grad_w)
    ]
    assert model.proj.weight.tolist()[0] == pytest.approx(expected_w[0], rel=1e-6)
    assert model.proj.weight.tolist()[1] == pytest.approx(expected_w[1], rel=1e-6)
    assert model.proj.weight.tolist()[1][0] == pytest.approx(
        0.5 * (1 - LR * WD)
    )  # zero grad: decay only
    expected_gain = [1.0 - LR * -0.3 / (0.3 + EPS), 3.0 - LR * 0.6 / (0.6 + EPS)]  # no decay
    assert model.norm_gain.tolist() == pytest.approx(expected_gain, rel=1e-6)


def test_build_optimizer_rejects_a_model_without_trainable_parameters():
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer(nn.Identity(), OptimConfig())


def test_adamw_is_fused_for_plain_parameters_and_matches_the_loop():
    """build_optimizer takes torch's fused AdamW for plain CPU/CUDA parameters (one kernel for all
    tensors); over a few steps it matches torch's per-tensor loop to rounding."""
    cfg = OptimConfig(name="adamw", lr=1e-2, weight_decay=0.1)
    torch.manual_seed(0)
    fused_model, loop_model = Tiny(), Tiny()
    loop_model.load_state_dict(fused_model.state_dict())
    fused = build_optimizer(fused_model, cfg)
    assert fused.defaults["fused"] is True
    groups = [
        {k: v for k, v in g.items() if k != "adaptive"} for g in param_groups(loop_model, 0.1)
    ]
    loop = torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False
    )
    for step in range(3):
        for model, opt in ((fused_model, fused), (loop_model, loop)):
            torch.manual_seed(step)
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            opt.step()
    # Same gradients; the fused kernel and the loop evaluate Adam's ~10 elementwise operations per
    # step in their own order (tests/tolerances.py): per step c·10·u of |p| and of the step
    # lr·|m̂/(√v̂+ε)|, over 3 steps. Seen: bit-identical.
    per_step = fp32_sum_bound(10)
    for a, b in zip(fused_model.parameters(), loop_model.parameters()):
        state = loop.state.get(b)
        if not state:  # frozen: never stepped
            assert torch.equal(a, b)
            continue
        m_hat = state["exp_avg"] / (1 - cfg.beta1**3)
        v_hat = state["exp_avg_sq"] / (1 - cfg.beta2**3)
        step = cfg.lr * (m_hat / (v_hat.sqrt() + cfg.eps)).abs().max().item()
        torch.testing.assert_close(a, b, rtol=3 * per_step, atol=3 * per_step * step)


@pytest.mark.parametrize("tied", [True, False])
def test_decay_embeddings_option_groups_the_embedding(tied):
    """optim.decay_embeddings: by default the embedding decays with the matrices; false gives it a
    group of its own without decay (LAMB's trust ratio kept). A tied head is the embedding; an
    untied head is a matrix like any other; norms and AttnRes queries never decay."""
    from depthscale.config import ModelConfig
    from depthscale.model.transformer import Transformer

    model = Transformer(ModelConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4,
                                    residual="block", attnres_n_blocks=2, tie_embeddings=tied))  # fmt: skip
    names = {id(p): n for n, p in model.named_parameters()}

    def groups(decay_embeddings):
        return [
            ({names[id(p)] for p in g["params"]}, g["weight_decay"], g.get("adaptive", True))
            for g in param_groups(model, 0.1, decay_embeddings)
        ]

    default = groups(True)
    assert len(default) == 2 and "tok_embeddings.weight" in default[0][0]
    assert default[0][1] == 0.1 and default[1][1] == 0.0
    off = groups(False)
    assert len(off) == 3
    decay, embeddings, vectors = off
    assert embeddings == ({"tok_embeddings.weight"}, 0.0, True)
    assert ("output.weight" in decay[0]) is not tied
    assert all(".pseudo_query" in n or "norm" in n or "key_norm" in n for n in vectors[0])
    assert vectors[1:] == (0.0, False)
    assert decay[0] | embeddings[0] | vectors[0] == set(names.values())
    cfg = OptimConfig(name="lamb", decay_embeddings=False)
    assert len(build_optimizer(model, cfg).param_groups) == 3


def test_decay_embeddings_in_a_pipeline_last_stage():
    """A pipeline's last stage holds the tied embedding as `output.weight`: it is the embedding."""
    from depthscale.config import ModelConfig
    from depthscale.model.transformer import Transformer

    model = Transformer(ModelConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4))
    model.tok_embeddings = None  # what build_stages leaves on the last stage's rank
    groups = param_groups(model, 0.1, decay_embeddings=False)
    assert [p is model.output.weight for p in groups[1]["params"]] == [True]
