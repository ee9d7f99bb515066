"""Muon in one process: torch.optim.Muon's bits, which parameters it orthogonalises and how (Q, K,
V each alone; each expert of a stack alone), its AdamW groups, and the owner assignment."""

from pathlib import Path

import pytest
import torch

from depthscale.config import Config, OptimConfig, load_config
from depthscale.model.transformer import Transformer
from depthscale.plan.layout import Layout
from depthscale.plan.muon_states import muon_state_bytes, muon_step_work
from depthscale.shape import ModelShape
from depthscale.shape.muon import assign_owners, is_muon_matrix, ns_flops, update_scale
from depthscale.train.muon import Muon, newton_schulz
from depthscale.train.optim import build_optimizer
from depthscale.train.schedule import set_lr
from tolerances import U32

LR, WD, MU = 0.02, 0.1, 0.95


def test_update_equals_torch_muon_bitwise():
    """With bf16 Newton–Schulz (torch's dtype) and Moonlight's scale ("match_rms_adamw"), the same
    operations in the same order: the parameters agree bit for bit over three steps, wide and tall."""
    torch.manual_seed(0)
    ours = [torch.randn(8, 5), torch.randn(4, 12)]
    theirs = [w.clone() for w in ours]
    opt = Muon([{"params": ours, "muon": True}], lr=LR, weight_decay=WD, ns_dtype=torch.bfloat16)
    ref = torch.optim.Muon(theirs, lr=LR, weight_decay=WD, adjust_lr_fn="match_rms_adamw")
    for _ in range(3):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        opt.step()
        ref.step()
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)
    assert update_scale((8, 5)) == 0.2 * 8**0.5


def test_newton_schulz_fp32_is_near_orthogonal_and_batched_per_matrix():
    """The quintic leaves singular values in ≈[0.68, 1.13] (not exactly 1: its coefficients trade
    convergence for speed); a stack is a batch of separate matrices, not one long one."""
    torch.manual_seed(1)
    stack = torch.randn(3, 6, 10)
    out = newton_schulz(stack)
    s = torch.linalg.svdvals(out)
    assert s.min() > 0.6 and s.max() < 1.2, s
    for e in range(3):  # bmm vs mm kernels: a few ulps of values of size ≤ 1.2
        assert (out[e] - newton_schulz(stack[e])).abs().max() <= 64 * U32
    joined = newton_schulz(stack.reshape(18, 10)).reshape(3, 6, 10)
    assert (joined - out).abs().max() > 0.1
    tall = torch.randn(10, 6)
    assert torch.allclose(newton_schulz(tall), newton_schulz(tall.T).T, atol=64 * U32)


def _model(**model_kw) -> Transformer:
    cfg = Config()
    m = cfg.model
    m.vocab_size, m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.max_seq_len = 64, 32, 2, 4, 2, 16
    m.residual, m.attnres_n_blocks = "block", 2
    for k, v in model_kw.items():
        setattr(m, k, v)
    torch.manual_seed(0)
    return Transformer(m)


def _optim(**kw) -> OptimConfig:
    return OptimConfig(name="muon", lr=LR, weight_decay=WD, muon_momentum=MU, **kw)


def test_groups_matrices_to_muon_the_rest_to_adamw():
    model = _model(moe_experts=4, moe_top_k=2, moe_shared_experts=1, tie_embeddings=False)
    opt = build_optimizer(model, _optim(muon_adamw_lr=0.005))
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in opt.param_groups if g["muon"] for p in g["params"]}
    adamw = {names[id(p)] for g in opt.param_groups if not g["muon"] for p in g["params"]}
    assert muon.isdisjoint(adamw) and muon | adamw == set(names.values())
    assert "layers.0.attention.wq.weight" in muon and "layers.1.attention.wo.weight" in muon
    assert "layers.0.feed_forward.experts.w_gate" in muon  # [E, d, f]: a stack of matrices
    assert "layers.0.feed_forward.shared.w_down.weight" in muon
    for name in ("tok_embeddings.weight", "output.weight", "layers.0.feed_forward.router.weight"):
        assert name in adamw
    assert all(n in adamw for n in names.values() if "pseudo_query" in n or "norm" in n)
    assert all(is_muon_matrix(n, p.ndim) == (n in muon) for n, p in model.named_parameters())
    set_lr(opt, 0.5 * LR)  # the schedule keeps AdamW's lr at its ratio to optim.lr
    assert {g["lr"] for g in opt.param_groups} == {0.5 * LR, 0.5 * 0.005}


def _grads(model: Transformer) -> None:
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()


def test_q_k_v_and_each_expert_are_orthogonalised_alone():
    """One step, checked against the update written out for wq (its own matrix, not a block of a
    fused [q; k; v]) and for the expert stack (each expert alone)."""
    model = _model(moe_experts=4, moe_top_k=2, residual="standard")
    opt = build_optimizer(model, _optim())
    _grads(model)
    named = dict(model.named_parameters())
    before = {n: p.detach().clone() for n, p in named.items()}
    grads = {n: p.grad.clone() for n, p in named.items()}
    opt.step()

    def expected(name):
        g = grads[name]
        u = g.lerp((1 - MU) * g, MU)  # buffer (1-μ)·g after one step; Nesterov look-ahead
        return before[name] * (1 - LR * WD) - LR * update_scale(g.shape) * newton_schulz(u)

    att = "layers.0.attention."
    experts = "layers.0.feed_forward.experts.w_up"
    for name in (att + "wq.weight", att + "wk.weight", experts):
        step = (before[name] - expected(name)).abs().max()
        assert (named[name].detach() - expected(name)).abs().max() <= 8 * U32 + 1e-6 * step
    qkv = torch.cat([grads[att + w + ".weight"] for w in ("wq", "wk", "wv")])
    fused = newton_schulz(qkv.lerp((1 - MU) * qkv, MU))[: grads[att + "wq.weight"].shape[0]]
    q_alone = newton_schulz(grads[att + "wq.weight"].lerp((1 - MU) * grads[att + "wq.weight"], MU))
    assert (fused - q_alone).abs().max() > 0.05  # the choice is visible in the result
    stacked = grads[experts]
    one_matrix = newton_schulz(stacked.reshape(-1, stacked.shape[-1])).reshape(stacked.shape)
    assert (one_matrix - newton_schulz(stacked)).abs().max() > 0.05


def test_adamw_groups_are_torch_adamw():
    torch.manual_seed(2)
    vec = torch.randn(6)
    ref = vec.clone()
    opt = Muon([{"params": [vec], "muon": False}], lr=LR, weight_decay=WD, betas=(0.9, 0.95))
    torch_opt = torch.optim.AdamW([ref], lr=LR, weight_decay=WD, betas=(0.9, 0.95), eps=1e-8)
    for _ in range(3):
        vec.grad = torch.randn(6)
        ref.grad = vec.grad.clone()
        opt.step()
        torch_opt.step()
    # the same formula with the decay applied as lr·wd·p inside the update: a few roundings apart
    assert torch.allclose(vec, ref, rtol=0, atol=16 * U32 * ref.abs().max().item())


def test_bad_hyperparameters_fail_at_construction():
    for kw, match in (
        ({"momentum": 1.0}, "momentum=1.0"),
        ({"ns_steps": 0}, "ns_steps=0"),
        ({"lr": -1.0}, "lr=-1.0"),
    ):
        with pytest.raises(ValueError, match=match):
            Muon([{"params": [torch.zeros(2, 2)], "muon": True}], **kw)
    with pytest.raises(ValueError, match="1-D"):
        Muon([{"params": [torch.zeros(2)], "muon": True}])
    # a misspelt group option would silently take the default: refused, named
    with pytest.raises(ValueError, match="parameter group 0 has unknown key 'momentun'"):
        Muon([{"params": [torch.zeros(2, 2)], "muon": True, "momentun": 0.9}])


def test_owners_balance_llama_1b_over_8_ranks():
    """FLOP-balanced owners of llama-1b's Muon matrices (read from its config, built on the meta
    device): the busiest of 8 ranks does ≤ 1.1× the mean Newton–Schulz work."""
    cfg = load_config(Path(__file__).parents[2] / "configs" / "llama-1b.toml")
    cfg.resolve_vocab_size(32768)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    shapes = [tuple(p.shape) for n, p in model.named_parameters() if is_muon_matrix(n, p.ndim)]
    assert len(shapes) == 7 * cfg.model.n_layers
    costs = [ns_flops(s) for s in shapes]
    owners = assign_owners(costs, 8)
    loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(8)]
    assert max(loads) / (sum(loads) / 8) <= 1.1, loads
    assert assign_owners(costs, 8) == owners  # deterministic: every rank computes the same
    # LPT by hand: 5→r0, 4→r1, 3→r1 (4 < 5), 3→r0 (5 < 7), 3→r1 (7 < 8)
    assert assign_owners([5, 4, 3, 3, 3], 2) == [0, 1, 1, 0, 1]


def test_planned_states_equal_what_one_process_allocates():
    """`plan.muon_states`: one momentum buffer per matrix, two moments and a step for the rest —
    the bytes a step of the real optimizer allocates (MoE model: stacks, router, shared expert)."""
    model = _model(moe_experts=4, moe_top_k=2, moe_shared_experts=1, tie_embeddings=False)
    opt = build_optimizer(model, _optim())
    _grads(model)
    opt.step()
    allocated = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
    planned = muon_state_bytes(ModelShape.from_config(model.cfg), Layout(), 0, 0, 0)
    assert planned.optimizer == allocated
    work = muon_step_work(ModelShape.from_config(model.cfg), Layout(), 0, 0, 0)
    assert work["to_owners"] == work["from_owners"] == 0
    flops = sum(ns_flops(p.shape) for p in opt.muon_params)
    assert work["ns_flops"] == flops
