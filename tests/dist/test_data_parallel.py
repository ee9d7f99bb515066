"""Data parallelism against the single-process model: FSDP2 (ZeRO-3), DDP (replicate) and HSDP.

Parity protocol ("start parity runs from one seed checkpoint"): every rank builds the single-process
model from one seed (bit-identical init), deep-copies it and parallelizes the copy. Both train on one
fixed global batch of 4 sequences; dp rank r of k takes rows [r·4/k, (r+1)·4/k), the reference takes
all 4. Compared every step: the global loss (mean over dp ranks), full gradients, the clipped global
gradient norm and, after the optimizer step, the parameters.

Tolerances (fp32, tests/tolerances.py): only reduction orders differ (per-slice means averaged by a
collective vs one mean over the batch, gradient reduce-scatters / all-reduces, the sharded norm), so
every step — each restarts from the reference's parameters, `copy_params_` — is bounded by the
model's `fp32_model_bound` on the global batch: the loss relative to the loss, gradients and SGD
parameters per tensor relative to the tensor's largest entry, the clipped global norm relative to the
norm (plus its own cascade sum). AdamW parameters: `AdamWBound`, elementwise — Adam divides by
sqrt(v), so on a gradient that is itself below its rounding noise a full lr-sized step can flip; the
interval bound allows exactly that and stays tight on every other entry. Seen: loss 1e-7, gradients
and SGD parameters ≤ 1e-6 of their largest entry, bound ~3e-4; AdamW ≤ 1e-2 of its elementwise bound.
- bf16 MixedPrecisionPolicy vs fp32: loss within 1e-2 (seen 2e-4 over 3 steps): bf16 rounds the
  compute inputs to 2^-9 relative; not an fp32 tolerance.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from harness import cached_mesh
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from depthscale.config import ModelConfig
from depthscale.model.transformer import Transformer, cross_entropy
from depthscale.parallel.data_parallel import (
    apply_ddp,
    apply_fsdp,
    average_replicated_grads,
    clip_grad_norm_,
    depth_query_params,
    dp_loss_average,
)
from depthscale.parallel.mesh import ParallelDims
from tolerances import (
    AdamWBound,
    check,
    copy_params_,
    fp32_model_bound,
    fp32_sum_bound,
    rel_norm_err,
    scaled_err,
)

VOCAB, SEQ, BATCH, STEPS = 64, 16, 4, 3
MAX_NORM = 0.5  # below the initial gradient norm (0.8-2.5), so clipping is active in parity runs
N_PARAMS = 10**5  # more entries than any test model has: the norm's own sum

LAYOUTS = {
    "fsdp": ParallelDims(dp_shard=2),
    "ddp": ParallelDims(dp_replicate=2),
    "hsdp": ParallelDims(dp_replicate=2, dp_shard=2),
    "tp+ddp": ParallelDims(dp_replicate=2, tp=2),  # a stand-in TP plan (_toy_tensor_parallel)
    "fsdp_keep": ParallelDims(dp_shard=2),  # reshard_after_forward=False
}

PLACEMENTS = {  # what the parameters look like after parallelizing
    "fsdp": {"(Shard(dim=0),)"},
    "ddp": {"plain"},  # DDP's reducer: plain tensors, names unchanged
    "hsdp": {"(Replicate(), Shard(dim=0))"},
}

# ---------------------------------------------------------------------------------------------
# Helpers (run on every rank)


def _mesh(dims: ParallelDims):
    return cached_mesh(dims)


def _cfg(residual: str = "block", n_layers: int = 2, n_blocks: int = 2, **kw) -> ModelConfig:
    return ModelConfig(
        vocab_size=VOCAB,
        dim=32,
        n_layers=n_layers,
        n_heads=4,
        max_seq_len=32,
        residual=residual,
        attnres_n_blocks=n_blocks,
        **kw,
    )


def _model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(cfg)


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _dp_slice(mesh, dims: ParallelDims) -> slice:
    r = mesh.get_local_rank("dp_replicate") * dims.dp_shard + mesh.get_local_rank("dp_shard")
    return slice(r * BATCH // dims.dp, (r + 1) * BATCH // dims.dp)


def _toy_tensor_parallel(model: Transformer, tp_mesh) -> None:
    """Megatron-style TP of attention and MLP only (embedding, norms and AttnRes stay plain), so
    DTensor and plain parameters sit side by side. Not the project's TP plan: only its shape."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {f"attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")}
    plan |= {f"feed_forward.{w}": ColwiseParallel() for w in ("w_gate", "w_up")}
    plan |= {"attention.wo": RowwiseParallel(), "feed_forward.w_down": RowwiseParallel()}
    for layer in model.layers.values():
        parallelize_module(layer, tp_mesh, plan)


def _parallelize(
    model, dims: ParallelDims, mesh, param_dtype=torch.float32, reshard: bool = True
) -> None:
    if dims.tp > 1:
        _toy_tensor_parallel(model, mesh["tp"])
    if dims.dp_shard > 1 or dims.tp > 1:  # as `parallelize`: DTensor replicas take FSDP2
        dp_mesh = mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]
        model._whole = apply_fsdp(
            model,
            dp_mesh,
            param_dtype=param_dtype,
            reshard_after_forward=reshard and dims.dp_shard > 1,
        )
    else:
        model._whole = apply_ddp(model, mesh["dp_replicate"])


def _average_whole(model) -> None:
    """The AttnRes queries FSDP / replicate left whole: averaged over the data-parallel ranks (here
    every rank: tp copies of them are identical), as `ParallelPlan.reduce_gradients` does."""
    whole = getattr(model, "_whole", None)
    if whole:
        average_replicated_grads(whole, dist.group.WORLD)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


ADAMW = dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8)


def _optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.AdamW(params, **ADAMW)


def _bound(cfg: ModelConfig) -> float:
    """One step of the model on the global batch in two summation orders (tests/tolerances.py)."""
    return fp32_model_bound(cfg, SEQ, BATCH)


def _norm_bound(cfg: ModelConfig) -> float:
    """The norm inherits the gradients' relative error, plus its own cascade sum of squares."""
    return _bound(cfg) + fp32_sum_bound(N_PARAMS, pairwise=True, block=16)


def _train_step(model, opt, tokens, labels, clip: float | None = None):
    loss = cross_entropy(model(tokens), labels)
    loss.backward()
    _average_whole(model)
    norm = None
    if clip is not None:
        norm = clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad()
    return loss, norm


# ---------------------------------------------------------------------------------------------
# Rank functions


def _parity(layout: str, cfg: ModelConfig, optimizers: tuple[str, ...]) -> dict:
    """Per optimizer, the worst error over the steps: loss, gradients, norm (relative, see the
    module docstring), SGD parameters (relative) and AdamW parameters (as a fraction of their
    elementwise bound, so 1.0 is the limit)."""
    dims = LAYOUTS[layout]
    mesh = _mesh(dims)
    rows = _dp_slice(mesh, dims)
    tokens, labels = _batch()
    bound = _bound(cfg)
    out: dict = {}
    for opt_name in optimizers:
        ref = _model(cfg)
        par = copy.deepcopy(ref)
        _parallelize(par, dims, mesh, reshard=layout != "fsdp_keep")
        names = [n for n, _ in par.named_parameters()]
        assert names == [n for n, _ in ref.named_parameters()], "parameter names changed"
        assert list(par.state_dict()) == list(ref.state_dict()), "state-dict keys changed"
        opt_ref = _optimizer(opt_name, ref.parameters())
        opt_par = _optimizer(opt_name, par.parameters())
        adam = AdamWBound(ADAMW["lr"], ADAMW["betas"], ADAMW["eps"])
        diffs = {"loss": 0.0, "grad": 0.0, "norm": 0.0, "param": 0.0}
        norms = []
        for _ in range(STEPS):
            copy_params_(par, ref)  # every step from the same point (tests/tolerances.py)
            ref_loss = cross_entropy(ref(tokens), labels)
            ref_loss.backward()
            loss = cross_entropy(par(tokens[rows]), labels[rows])
            loss.backward()
            _average_whole(par)
            global_loss = dp_loss_average(loss, dist.group.WORLD)
            diffs["loss"] = max(diffs["loss"], abs(global_loss - ref_loss.item()) / ref_loss.item())
            for p, q in zip(par.parameters(), ref.parameters()):
                diffs["grad"] = max(diffs["grad"], scaled_err(_full(p.grad), q.grad))
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
            norm = clip_grad_norm_(par.parameters(), MAX_NORM)
            assert not isinstance(norm, DTensor) and norm.ndim == 0
            diffs["norm"] = max(diffs["norm"], rel_norm_err(norm, ref_norm))
            norms.append(norm.item())
            # the clipped gradients, as the step sees them
            grads = [None if q.grad is None else q.grad.clone() for q in ref.parameters()]
            for o in (opt_ref, opt_par):
                o.step()
                o.zero_grad()
            for (name, p), q, g in zip(par.named_parameters(), ref.parameters(), grads):
                if opt_name == "sgd" or g is None:
                    err = scaled_err(_full(p.detach()), q)
                else:  # gradient error bound: the gradients' and the clipping factor's
                    delta = (bound + _norm_bound(cfg)) * g.abs().max().item()
                    limit = adam.after_step(name, g, delta, opt_ref.state[q], q)
                    err = ((_full(p.detach()).double() - q.double()).abs() / limit).max().item()
                diffs["param"] = max(diffs["param"], err)
        out[opt_name] = diffs
        out[opt_name + "_norms"] = norms
        out["placements"] = {
            str(p.placements) if isinstance(p, DTensor) else "plain" for p in par.parameters()
        }
    return out


def _check(r: dict, cfg: ModelConfig, optimizers: tuple[str, ...] = ("sgd", "adamw")) -> None:
    bound, norm_bound = _bound(cfg), _norm_bound(cfg)
    for name in optimizers:
        d = r[name]
        check(d["loss"], bound, f"{name} loss")
        check(d["grad"], bound, f"{name} grad")
        check(d["norm"], norm_bound, f"{name} clipped norm")
        if name == "sgd":
            check(d["param"], bound, "sgd param")
        else:
            check(d["param"], 1.0, "adamw param / its elementwise bound")


def _bf16_vs_fp32() -> list[tuple[float, float]]:
    dims = LAYOUTS["fsdp"]
    mesh = _mesh(dims)
    rows = _dp_slice(mesh, dims)
    tokens, labels = _batch()
    losses = []
    for dtype in (torch.float32, torch.bfloat16):
        model = _model(_cfg("block"))
        _parallelize(model, dims, mesh, param_dtype=dtype)
        seen: list[torch.dtype] = []
        wq = model.layers["0"].attention.wq
        wq.register_forward_pre_hook(
            lambda m, args, seen=seen: seen.extend([m.weight.dtype, args[0].dtype])
        )
        opt = _optimizer("adamw", model.parameters())
        steps = []
        for _ in range(STEPS):
            loss, _ = _train_step(model, opt, tokens[rows], labels[rows], clip=MAX_NORM)
            steps.append(dp_loss_average(loss, dist.group.WORLD))
        losses.append(steps)
        assert set(seen) == {dtype}, f"compute ran in {set(seen)}, expected {dtype}"
        assert all(p.dtype == torch.float32 for p in model.parameters()), "master weights not fp32"
    return list(zip(*losses))


def _clip_mixed_meshes() -> tuple[float, float, float, float]:
    """2-D (dp × tp) FSDP+TP weights next to 1-D FSDP weights and a plain tensor, vs one process."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    dims = ParallelDims(dp_shard=2, tp=2)
    mesh = _mesh(dims)
    torch.manual_seed(0)
    ref = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8), torch.nn.Linear(8, 4)
    )
    extra = torch.nn.Parameter(torch.randn(5))  # plain replicated tensor, not sharded anywhere
    par = copy.deepcopy(ref)
    parallelize_module(par, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(par[3], mesh=mesh["dp_shard"])  # a 1-D FSDP unit next to the 2-D TP+FSDP root
    fully_shard(par, mesh=mesh["dp_shard"])
    assert {p.device_mesh.ndim for p in par.parameters()} == {1, 2}

    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(3))
    par_extra = torch.nn.Parameter(extra.detach().clone())
    for model, e in ((ref, extra), (par, par_extra)):
        (model(x).pow(2).sum() + e.pow(2).sum()).backward()
    ref_params = [*ref.parameters(), extra]
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, 0.1)
    norm = clip_grad_norm_([*par.parameters(), par_extra], 0.1)
    grad_diff = max(
        scaled_err(_full(p.grad), q.grad)
        for p, q in zip([*par.parameters(), par_extra], ref_params, strict=True)
    )
    measured = clip_grad_norm_([*par.parameters(), par_extra], 0.0)  # after clipping; measure only
    return norm.item(), ref_norm.item(), grad_diff, measured.item()


def _step_and_eval(model, opt, rows: slice, group) -> tuple[float, float]:
    """One AdamW step, then the loss after it (which depends on the optimizer state, too)."""
    tokens, labels = _batch()
    loss, _ = _train_step(model, opt, tokens[rows], labels[rows])
    with torch.no_grad():
        after = cross_entropy(model(tokens[rows]), labels[rows])
    return dp_loss_average(loss, group), dp_loss_average(after, group)


def _train_and_save(path: str) -> tuple[dict[str, torch.Tensor], float, float]:
    """Train 2 steps with dp_shard=2, save model+optimizer, then continue for the reference."""
    dims = ParallelDims(dp_shard=2)
    mesh = _mesh(dims)
    rows = _dp_slice(mesh, dims)
    model = _model(_cfg("block"))
    model._whole = apply_fsdp(model, mesh["dp_shard"])
    opt = _optimizer("adamw", model.parameters())
    tokens, labels = _batch()
    for _ in range(2):
        _train_step(model, opt, tokens[rows], labels[rows])
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    params = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
    return params, *_step_and_eval(model, opt, rows, dist.group.WORLD)


def _load(model, opt, path: str) -> None:
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _load_and_step(path: str, world: int = 1) -> tuple[dict[str, torch.Tensor], float, float]:
    """Load into a model built from another seed (dp_shard=world, or one process with no process
    group), then continue one step: the loaded full parameters, the step's loss, the loss after."""
    model = _model(_cfg("block"), seed=123)
    rows, group = slice(0, BATCH), None
    if world > 1:
        dims = ParallelDims(dp_shard=world)
        mesh = _mesh(dims)
        model._whole = apply_fsdp(model, mesh["dp_shard"])
        rows, group = _dp_slice(mesh, dims), dist.group.WORLD
    opt = _optimizer("adamw", model.parameters())
    _load(model, opt, path)
    params = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
    return params, *_step_and_eval(model, opt, rows, group)


# ---------------------------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("residual", ["standard", "full", "block"])
@pytest.mark.parametrize("layout", ["fsdp", "ddp", "hsdp"])
def test_parity_with_single_process(dist_pool, layout, residual):
    world = LAYOUTS[layout].world_size
    results = dist_pool(world).run(_parity, layout, _cfg(residual), ("sgd", "adamw"))
    for r in results:
        _check(r, _cfg(residual))
        assert r["sgd_norms"][0] > MAX_NORM  # clipping was active
    whole = {"plain"} if residual != "standard" else set()  # the AttnRes queries stay whole
    assert results[0]["placements"] == PLACEMENTS[layout] | whole
    # the norm is identical on all ranks, bit for bit
    assert all(r["sgd_norms"] == results[0]["sgd_norms"] for r in results)


def test_ddp_after_tensor_parallel(dist_pool):
    """TP weights are DTensors: replicas of them are FSDP2 on the (dp_replicate, dp_shard) mesh
    with a shard group of one, which keeps them DTensors (Replicate on dp_replicate, a shard of the
    whole tensor on the size-1 dp_shard, the TP placement on tp), so clipping and checkpoints see
    the real shards; the result equals one process."""
    for r in dist_pool(4).run(_parity, "tp+ddp", _cfg("block"), ("sgd",)):
        assert r["placements"] == {
            "(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))",  # column-parallel weights
            "(Replicate(), Shard(dim=0), Shard(dim=1))",  # row-parallel weights
            "(Replicate(), Shard(dim=0))",  # embedding, norms: on dp_replicate × dp_shard only
            "plain",  # the layers' AttnRes queries, whole on every rank
        }
        _check(r, _cfg("block"), ("sgd",))


@pytest.mark.parametrize("n_layers", [16, 32, 80])
def test_fsdp_unit_is_one_layer_for_block_attnres(dist_pool, n_layers):
    """Two-phase reads stack the queries of a whole depth block (8 blocks here: 2, 4 and 10 layers
    each). The queries stay whole on every rank, so every FSDP unit is exactly one layer, whatever
    the block size (built on the meta device: no memory, only the wrapping)."""
    for units in dist_pool(2).run(_fsdp_units_of, n_layers):
        assert units == [[f"layers.{i}"] for i in range(n_layers)] + [["<root>"]]


def _fsdp_units_of(n_layers: int) -> list[list[str]]:
    """The modules owning each FSDP parameter group, and a check that the AttnRes queries are
    plain (whole) and every other parameter sharded."""
    from torch.distributed.fsdp import FSDPModule

    cfg = _cfg("block", n_layers=n_layers, n_blocks=8)
    with torch.device("meta"):
        model = Transformer(cfg)
    whole = apply_fsdp(model, _mesh(ParallelDims(dp_shard=2))["dp_shard"])
    assert {id(p) for p in whole} == {id(p) for p in depth_query_params(model)}
    assert len(whole) == 2 * 2 * n_layers  # pseudo-query and key-norm gain per sublayer
    for p in model.parameters():
        assert isinstance(p, DTensor) != any(p is q for q in whole)
    names = {id(m): n or "<root>" for n, m in model.named_modules()}
    return [[names[id(m)]] for m in model.modules() if isinstance(m, FSDPModule)][1:] + [["<root>"]]


def test_fsdp_parity_with_depth_block_spanning_layers(dist_pool):
    results = dist_pool(2).run(_parity, "fsdp", _cfg("block", n_blocks=1), ("sgd",))
    for r in results:
        _check(r, _cfg("block", n_blocks=1), ("sgd",))


def test_fsdp_parity_without_reshard_after_forward(dist_pool):
    for r in dist_pool(2).run(_parity, "fsdp_keep", _cfg("block"), ("sgd",)):
        _check(r, _cfg("block"), ("sgd",))


@pytest.mark.parametrize("layout", ["fsdp", "ddp"])
def test_parity_with_unused_parameters(dist_pool, layout):
    """Efficient reads: the first sublayer reads the embedding alone, its query gets no gradient."""
    cfg = _cfg("block", attnres_read="efficient")
    for r in dist_pool(2).run(_parity, layout, cfg, ("sgd",)):
        _check(r, cfg, ("sgd",))


def test_bf16_mixed_precision_close_to_fp32(dist_pool):
    for fp32, bf16 in dist_pool(2).run(_bf16_vs_fp32)[0]:
        assert abs(fp32 - bf16) < 1e-2, (fp32, bf16)


def test_clip_grad_norm_across_meshes(dist_pool):
    results = dist_pool(4).run(_clip_mixed_meshes)
    norm, ref_norm, grad_diff, clipped = results[0]
    # the MLP's longest reduction chain: 8 + 16 + 8 in, the loss's 6·4 squares, the same back and
    # the weight gradients' sum over 6 rows; TP/FSDP reorder those sums (tests/tolerances.py)
    bound = fp32_sum_bound(2 * (8 + 16 + 8 + 6 * 4) + 6)
    norm_bound = bound + fp32_sum_bound(N_PARAMS, pairwise=True, block=16)
    check(grad_diff, bound, "worst gradient")
    check(abs(norm - ref_norm) / ref_norm, norm_bound, "norm")
    assert norm > 0.1
    # max_norm=0 only measures: after clipping by 0.1 / (norm + 1e-6) the norm is 0.1 up to that
    # 1e-6 and the two norms' rounding
    check(abs(clipped - 0.1) / 0.1, 1e-6 / norm + 2 * norm_bound, "clipped norm")
    assert all(r == results[0] for r in results)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the no-process-group load
def test_checkpoint_reshards_across_world_sizes(dist_pool, tmp_path):
    path = str(tmp_path / "ckpt")  # one directory all ranks see
    saved, loss2, after2 = dist_pool(2).run(_train_and_save, path)[0]
    params4, loss4, after4 = dist_pool(4).run(_load_and_step, path, 4)[0]
    params1, loss1, after1 = _load_and_step(path)  # this process: no process group at all
    assert not dist.is_initialized()
    assert saved.keys() == params4.keys() == params1.keys()
    for n in saved:
        assert torch.equal(saved[n], params4[n]), n
        assert torch.equal(saved[n], params1[n]), n
    # the continued step matches the uninterrupted 2-rank run: optimizer state was restored too.
    # Other world sizes reorder the loss's and gradients' sums: one step's bound for the loss, two
    # chained (the AdamW step from those gradients, then the next forward) for the loss after it.
    bound = _bound(_cfg("block"))
    for loss, after in ((loss4, after4), (loss1, after1)):
        check(abs(loss - loss2) / loss2, bound, "loss")
        check(abs(after - after2) / after2, 2 * bound, "loss after the step")
