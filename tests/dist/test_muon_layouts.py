"""Distributed Muon (`train/muon.py`) through the real `parallelize()`: every layout's parameters after
three steps equal one process's Muon; each matrix is orthogonalised by exactly one rank of its shard
group; the optimizer state checkpointed at one layout resumes at another.

The gradients are the same random tensors on both sides (laid out as each parameter, no forward),
so the comparison isolates the optimizer: the forward and backward of every layout already match
one process (test_composed.py, test_expert_parallel.py, test_data_parallel.py).

fp32 bound: the owner assembles exactly the elements one process holds, and every operation on them
is elementwise or a GEMM of the same shapes; the elementwise kernels (lerp, mul, add) may round an
element differently (1 ulp) where a shard moves it between a vector body and a scalar tail. A
perturbation δ of the Newton–Schulz input moves its output by about δ (the iteration maps
singular values in [0, 1] onto ≈ 1 with bounded slope around the matrix's spectrum); so per step a
parameter moves by at most lr·scale·(a few ulps of O, |O| ≤ 1.2) plus its own rounding, and the
bound is 64·u·(lr·scale + |p|) per step, summed over the steps.

bf16 (the trainer's mixed precision, as on CPU: autocast, FSDP's bf16 compute parameters, fp32
master weights, momentum and Newton–Schulz): free-running loss curves against one process's, with
`test_bf16_layouts`' derived bound — the one-process bf16 curve's distance from its fp32 twin
measures what bf16 rounding does to this Muon curve, and a layout is another draw of the same
roundings.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from harness import cached_mesh, small_config
from test_bf16_layouts import _config as bf16_config
from test_bf16_layouts import _curve, tolerance
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from depthscale.model.transformer import Transformer
from depthscale.parallel.mesh import ParallelDims
from depthscale.parallel.parallelize import dp_rank_and_size, parallelize
from depthscale.plan.layout import Layout
from depthscale.plan.muon_states import muon_state_bytes, muon_step_work
from depthscale.shape import ModelShape
from depthscale.shape.muon import update_scale
from depthscale.train.muon import _shard_key
from depthscale.train.optim import build_optimizer
from tolerances import U32, check, fp32_model_bound

STEPS, LR, WD = 3, 0.02, 0.1
MOE = {"moe_experts": 4, "moe_top_k": 2, "moe_ffn_dim": 24, "moe_first_dense": 1}
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)  # as train/checkpoint.py saves


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _build(dims_kw: dict, model_kw: dict, seed: int = 0):
    """The parallel model and its Muon, and (same seed) one process's."""
    dims = ParallelDims(**{k: v for k, v in dims_kw.items() if k != "ep"})
    dims = dims.validate(dist.get_world_size())
    cfg = small_config("block", dims_kw)
    for k, v in model_kw.items():
        setattr(cfg.model, k, v)
    cfg.optim.name, cfg.optim.lr, cfg.optim.weight_decay = "muon", LR, WD
    torch.manual_seed(seed)
    model = Transformer(cfg.model)
    parallelize(model, cached_mesh(dims), dims, cfg)
    torch.manual_seed(0)
    ref = Transformer(cfg.model)
    return model, build_optimizer(model, cfg.optim), ref, build_optimizer(ref, cfg.optim)


def _grads(model, ref, step: int) -> None:
    """The same random gradient on both sides, each laid out as its parameter."""
    g = torch.Generator().manual_seed(100 + step)
    for q in ref.parameters():
        q.grad = torch.randn(q.shape, generator=g)
    grads = {n: q.grad for n, q in ref.named_parameters(remove_duplicate=False)}
    for name, p in model.named_parameters():
        full = grads[name]
        p.grad = (
            distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
            if isinstance(p, DTensor)
            else full.clone()
        )


def _compare(model, ref, out: dict) -> None:
    refs = dict(ref.named_parameters(remove_duplicate=False))
    for name, p in model.named_parameters():
        q = refs[name].detach()
        err = (_full(p.detach()) - q).abs().max().item()
        step = LR * (update_scale(q.shape) if q.ndim >= 2 else 1.0)
        out["bound"][name] = out["bound"].get(name, 0.0) + 64 * U32 * (step + q.abs().max().item())
        out["err"][name] = err


def _layout(dims_kw: dict, model_kw: dict) -> dict:
    model, opt, ref, ref_opt = _build(dims_kw, model_kw)
    out: dict = {"err": {}, "bound": {}, "once": True, "split": 0}
    for step in range(STEPS):
        _grads(model, ref, step)
        opt.step()
        ref_opt.step()
        _compare(model, ref, out)
        # each matrix orthogonalised by exactly one rank of the ranks it is split over
        done = set(opt.orthogonalised)
        for i, p in enumerate(opt.muon_params):
            key = _shard_key(p)
            count = torch.tensor([float(i in done)])
            if key is not None:
                mesh, dims = key
                for d in dims:
                    dist.all_reduce(count, group=mesh.get_group(d))
                out["split"] += 1
            out["once"] &= count.item() == 1.0
    out["moved"] = dict(opt.moved)
    dims = ParallelDims(**{k: v for k, v in dims_kw.items() if k != "ep"})
    mesh = cached_mesh(dims)
    out["coords"] = (
        mesh.get_local_rank("pp"),
        mesh.get_local_rank("tp"),
        mesh.get_local_rank("dp_shard") * dims.cp + mesh.get_local_rank("cp"),
    )
    state = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
    out["state_bytes"] = sum(_local(t).numel() * _local(t).element_size() for t in state)
    return out


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


LAYOUTS_2 = [
    ({"dp_shard": 2}, {}),
    ({"tp": 2}, {}),
    ({"pp": 2}, {"n_layers": 4}),
    ({"cp": 2}, {}),
    ({"dp_shard": 2, "ep": 2}, MOE),
]
LAYOUTS_4 = [
    ({"dp_shard": 4}, {}),
    ({"dp_replicate": 2, "dp_shard": 2}, {}),
    ({"dp_shard": 2, "tp": 2}, {}),
    ({"dp_shard": 4, "ep": 2}, MOE),
]


def _planned(dims_kw: dict, model_kw: dict, coords: tuple[int, int, int]) -> tuple[dict, int]:
    """The planner's redistribution bytes over the test's steps and Muon's state bytes."""
    cfg = small_config("block", dims_kw)
    for k, v in model_kw.items():
        setattr(cfg.model, k, v)
    p = cfg.parallel
    lay = Layout(tp=p.tp, pp=p.pp, cp=p.cp, dp_shard=p.dp_shard, dp_replicate=p.dp_replicate,
                 ep=p.ep)  # fmt: skip
    spec = ModelShape.from_config(cfg.model)
    work = muon_step_work(spec, lay, *coords)
    moved = {k: STEPS * work[k] for k in ("to_owners", "from_owners") if work[k]}
    return moved, muon_state_bytes(spec, lay, *coords).optimizer


def _check(results: list[dict], split: bool, dims_kw: dict, model_kw: dict) -> None:
    planned = dims_kw.get("ep", 1) == 1 or dims_kw["ep"] == dims_kw.get("dp_shard", 1)
    for r in results:
        if planned:  # the planner does not place owners of expert-sharded stacks yet
            moved, state_bytes = _planned(dims_kw, model_kw, r["coords"])
            assert r["moved"] == moved, (r["coords"], r["moved"], moved)
            assert r["state_bytes"] == state_bytes, r["coords"]
        assert r["once"], "a matrix orthogonalised by no rank or by two"
        for name, err in r["err"].items():
            check(err, r["bound"][name], name)
        if split:
            assert r["split"] > 0 and r["moved"]["to_owners"] > 0


@pytest.mark.parametrize("dims_kw,model_kw", LAYOUTS_2, ids=[str(d) for d, _ in LAYOUTS_2])
def test_muon_layouts_of_two_match_one_process(dist_pool, dims_kw, model_kw):
    split = "pp" not in dims_kw
    _check(dist_pool(2).run(_layout, dims_kw, model_kw), split, dims_kw, model_kw)


@pytest.mark.parametrize("dims_kw,model_kw", LAYOUTS_4, ids=[str(d) for d, _ in LAYOUTS_4])
def test_muon_layouts_of_four_match_one_process(dist_pool, dims_kw, model_kw):
    _check(dist_pool(4).run(_layout, dims_kw, model_kw), True, dims_kw, model_kw)


def _save_then_resume(path: str) -> dict:
    """Two steps at dp_shard = 4, saved; a model of another seed at dp_shard = 2 × tp = 2 loads it
    and takes the third step: equal to one process's three."""
    model, opt, ref, ref_opt = _build({"dp_shard": 4}, {})
    for step in range(2):
        _grads(model, ref, step)
        opt.step()
        ref_opt.step()
    model_sd, optim_sd = get_state_dict(model, opt, options=FLAT)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    model, opt, _, _ = _build({"dp_shard": 2, "tp": 2}, {}, seed=123)
    model_sd, optim_sd = get_state_dict(model, opt, options=FLAT)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=FLAT
    )
    out: dict = {"err": {}, "bound": {}}
    for _ in range(2):  # the bound of the two steps before the save
        _compare(model, ref, out)
    _grads(model, ref, 2)
    opt.step()
    ref_opt.step()
    _compare(model, ref, out)
    buffers = [s["momentum_buffer"] for s in opt.state.values() if "momentum_buffer" in s]
    out["buffers"] = len(buffers), all(b.dtype == torch.float32 for b in buffers)
    return out


def test_muon_state_resumes_at_another_layout(dist_pool, tmp_path):
    for r in dist_pool(4).run(_save_then_resume, str(tmp_path / "ckpt")):
        n, fp32 = r["buffers"]
        assert n > 0 and fp32
        for name, err in r["err"].items():
            check(err, r["bound"][name], name)


def _bf16_curves(dims_kw: dict) -> dict:
    """On every rank: Muon's bf16 loss curve at the layout (the trainer's path: meta model,
    `parallelize`, autocast), and one process's bf16 and fp32 curves."""

    def config(kw: dict):
        cfg = bf16_config("block", kw)
        cfg.optim.name = "muon"
        return cfg

    dims = ParallelDims(**dims_kw)
    one = ParallelDims()
    return {
        "layout": _curve(config(dims_kw), cached_mesh(dims), dims),
        "bf16": _curve(config({}), None, one),
        "fp32": _curve(config({}), None, one, dtype="float32"),
    }


def test_muon_bf16_loss_curve_matches_one_process(dist_pool):
    """dp_shard = 2 in bf16: Muon's redistribution under FSDP's mixed precision follows one
    process's bf16 curve within the derived bound, and the run learns (so the bound is tight)."""
    results = dist_pool(2).run(_bf16_curves, {"dp_shard": 2})
    r = results[0]
    assert all(x == r for x in results), "ranks disagree on the global loss"
    bounds = tolerance(r["bf16"], r["fp32"])
    for k, (a, b, bound) in enumerate(zip(r["layout"], r["bf16"], bounds)):
        assert abs(a - b) <= bound, f"step {k + 1}: |layout − one process| = {abs(a - b):.3g}"
    learned = r["bf16"][0] - r["bf16"][-1]
    assert learned > 1.0, f"the one-process Muon run learned only {learned:.3g}"
    assert max(bounds) < 0.1 * learned, "the bound would hide a run that trains differently"


def _qk_clip(dims_kw: dict) -> dict:
    """QK-clip at the layout against one process: both forward the same batch (each data-parallel
    rank its rows), then each clips (no optimizer update, so only the clip moves weights). τ sits
    halfway between the middle two of one process's max logits: half the heads are clipped.

    Bound: the recorded maxima differ from one process's by the forward's reduction order, a
    relative `fp32_model_bound(backward=False)`; each scale γ = τ/S inherits it, and a clipped
    weight w·γ moves by |w|·γ·that (plus a few roundings of the scales)."""
    dims = ParallelDims(**dims_kw).validate(dist.get_world_size())

    def build(mesh, d, kw):
        cfg = small_config("block", kw)
        cfg.optim.name, cfg.optim.qk_clip_tau = "muon", 1.0
        torch.manual_seed(0)
        with torch.device("meta"):
            model = Transformer(cfg.model)
        plan = parallelize(model, mesh, d, cfg, device=torch.device("cpu"))
        return cfg, model, plan, build_optimizer(model, cfg.optim)

    cfg, ref, ref_plan, ref_opt = build(None, ParallelDims(), {})
    mesh = cached_mesh(dims)
    _, model, plan, opt = build(mesh, dims, dims_kw)
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    ref_plan.forward_backward(ref, x, y)
    maxima = torch.cat([layer.attention.logit_max for layer in ref.layers.values()]).sort().values
    tau = float(maxima[len(maxima) // 2 - 1] + maxima[len(maxima) // 2]) / 2
    rank, size = dp_rank_and_size(mesh, dims)
    rows = slice(rank * 4 // size, (rank + 1) * 4 // size)
    plan.forward_backward(model, x[rows], y[rows])
    before = {n: q.detach().clone() for n, q in ref.named_parameters()}
    for o in (opt, ref_opt):
        o.qk_clip.tau = tau
        o.qk_clip.apply()
    refs = dict(ref.named_parameters())
    bound = fp32_model_bound(cfg.model, 16, 4, backward=False) + 8 * U32
    out: dict = {"err": {}, "bound": {}, "moved": {}}
    for name, p in model.named_parameters():
        if ".wq." in name or ".wk." in name:
            q = refs[name].detach()
            out["err"][name] = (_full(p.detach()) - q).abs().max().item()
            out["bound"][name] = bound * q.abs().max().item()
            out["moved"][name] = (q - before[name]).abs().max().item()
    out["clipped"] = (opt.qk_clip.clipped.tolist(), ref_opt.qk_clip.clipped.tolist())
    return out


QK_CLIP_LAYOUTS = [({"pp": 2}, 2), ({"dp_shard": 2, "tp": 2}, 4)]


@pytest.mark.parametrize("dims_kw,ranks", QK_CLIP_LAYOUTS, ids=[str(d) for d, _ in QK_CLIP_LAYOUTS])
def test_qk_clip_layouts_match_one_process(dist_pool, dims_kw, ranks):
    """Every rank clips from the same maxima (MAX over the data-parallel ranks' rows, tp ranks'
    heads, pipeline stages' layers) and scales the rows it holds (its FSDP shard, its tp heads):
    the weights equal one process's clipped ones, and the clip moved them far beyond the bound."""
    for r in dist_pool(ranks).run(_qk_clip, dims_kw):
        layout, one = r["clipped"]
        assert layout == one and 0 < sum(map(sum, one)) < sum(map(len, one))
        assert r["err"], "no attention weight on this rank"
        for name, err in r["err"].items():
            check(err, r["bound"][name], name)
        assert max(r["moved"].values()) > 100 * max(r["bound"].values())
