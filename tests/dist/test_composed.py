"""Composed layouts through the real `parallelize()`: tp × dp_shard (and tp × dp_replicate), cp × dp
and cp × tp, and pipeline stages with dp_shard, HSDP, dp_replicate, tp and cp, match one process on loss
and gradients over several optimizer steps.

fp32 tolerances (tests/tolerances.py): the layouts reorder sums (row-parallel GEMMs, reduce-scatters,
ring-attention merges, micro-batch accumulation), so every step is bounded by `fp32_model_bound` of
the model on the global batch: losses relative to the loss, gradients and updated parameters per
tensor relative to the tensor's largest entry. Each step starts from the reference's parameters
(`copy_params_`): the optimizer step itself is checked right after it, and free-running fp32
trajectories drift apart by more than any fixed bound (training amplifies rounding step by step).
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
from harness import cached_mesh
from torch.distributed.tensor import DTensor

from depthscale.config import Config
from depthscale.model.transformer import Transformer, cross_entropy
from depthscale.parallel.mesh import ParallelDims
from depthscale.parallel.parallelize import dp_rank_and_size, parallelize
from tolerances import check, copy_params_, fp32_model_bound, fp32_sum_bound, scaled_err

BATCH, SEQ = 4, 16


def _config(residual: str, chunks: int, n_layers: int = 2) -> Config:
    cfg = Config()
    m = cfg.model
    m.vocab_size, m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.max_seq_len = 64, 32, 2, 4, 2, SEQ
    m.n_layers = n_layers
    m.residual, m.attnres_n_blocks = residual, 2
    cfg.parallel.tp_overlap_chunks = chunks
    cfg.train.batch_size, cfg.train.micro_batch_size = BATCH, 1
    return cfg


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _setup(residual: str, dims_kw: dict, chunks: int, offload: bool = False, **model_kw):
    """Mesh, the single-process reference and the parallelized copy (same seed), their optimizers,
    this rank's rows of the batch and the parallel plan."""
    dims_kw = dict(dims_kw)
    virtual = dims_kw.pop("pp_virtual", 1)
    ulysses = dims_kw.pop("cp_ulysses", 1)
    dims = ParallelDims(**dims_kw).validate(dist.get_world_size())
    cfg = _config(residual, chunks, model_kw.pop("n_layers", 2))
    for name, value in model_kw.items():
        setattr(cfg.model, name, value)
    for name, value in dims_kw.items():
        setattr(cfg.parallel, name, value)
    cfg.parallel.pp_virtual, cfg.parallel.cp_ulysses = virtual, ulysses
    cfg.train.offload_params = offload
    mesh = cached_mesh(dims)
    torch.manual_seed(0)
    ref = Transformer(cfg.model)
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    plan = parallelize(model, mesh, dims, cfg)
    rank, size = dp_rank_and_size(mesh, dims)
    rows = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
    opts = torch.optim.SGD(ref.parameters(), lr=0.5), torch.optim.SGD(model.parameters(), lr=0.5)
    return dims, mesh, ref, model, opts, rows, plan


def _finish_step(ref, model, opts, worst):
    """Worst gradient and (after the SGD step) parameter error of any tensor, relative to its largest
    entry; then the next step restarts from the reference's parameters."""
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    for name, p in model.named_parameters():
        worst["grad"] = max(worst["grad"], scaled_err(_full(p.grad), ref_params[name].grad))
    for opt in opts:
        opt.step()
        opt.zero_grad()
    for name, p in model.named_parameters():
        worst["param"] = max(worst["param"], scaled_err(_full(p.detach()), ref_params[name]))
    copy_params_(model, ref)
    return worst


def _bound(residual: str, n_layers: int = 2) -> float:
    """fp32 bound of one step of the model on the global batch (BATCH rows)."""
    return fp32_model_bound(_config(residual, 1, n_layers).model, SEQ, BATCH)


def _check(losses, ref_losses, worst, bound) -> None:
    for step, (loss, ref_loss) in enumerate(zip(losses, ref_losses)):
        check(abs(loss - ref_loss) / abs(ref_loss), bound, f"step {step} loss")
    for key, value in worst.items():
        check(value, bound, f"worst {key}")


def _composed(residual: str, dims_kw: dict, chunks: int, steps: int = 3):
    dims, _, ref, model, opts, rows, plan = _setup(residual, dims_kw, chunks)
    g = torch.Generator().manual_seed(1)
    losses, ref_losses, worst = [], [], {"grad": 0.0, "param": 0.0}
    for _ in range(steps):
        tokens = torch.randint(0, 64, (BATCH, SEQ), generator=g)
        labels = torch.randint(0, 64, (BATCH, SEQ), generator=g)
        ref_loss = cross_entropy(ref(tokens), labels)
        ref_loss.backward()
        loss, _ = plan.loss(model(tokens[rows]), labels[rows])  # vocabulary-parallel under tp
        loss.backward()
        plan.reduce_gradients()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
        ref_losses.append(ref_loss.item())
        worst = _finish_step(ref, model, opts, worst)
    return losses, ref_losses, worst


@pytest.mark.parametrize("residual", ["standard", "full", "block"])
@pytest.mark.parametrize(
    "dims_kw,chunks",
    [
        ({"tp": 2, "dp_shard": 2}, 1),
        ({"tp": 2, "dp_shard": 2}, 2),
        ({"tp": 2, "dp_replicate": 2}, 1),
    ],
)
def test_tp_with_data_parallel_matches_single_process(dist_pool, residual, dims_kw, chunks):
    """fp32, 3 SGD steps: losses, gradients and updated parameters within the model's fp32 bound (TP
    reorders the sums in the row-parallel GEMMs and reduce-scatters; the gap is rounding)."""
    for losses, ref_losses, worst in dist_pool(4).run(_composed, residual, dims_kw, chunks):
        _check(losses, ref_losses, worst, _bound(residual))


def _composed_cp(residual: str, dims_kw: dict, steps: int = 3):
    from depthscale.parallel import context_parallel as cpar

    dims, mesh, ref, model, opts, rows, plan = _setup(residual, dims_kw, 1)
    cp, cp_rank = dims.cp, mesh.get_local_rank("cp")
    g = torch.Generator().manual_seed(1)
    losses, ref_losses, worst = [], [], {"grad": 0.0, "param": 0.0}
    for _ in range(steps):
        tokens = torch.randint(0, 64, (BATCH, SEQ), generator=g)
        labels = torch.randint(0, 64, (BATCH, SEQ), generator=g)
        ref_loss = cross_entropy(ref(tokens), labels)
        ref_loss.backward()
        positions = cpar.positions_for(SEQ, cp_rank, cp, "zigzag")
        x = cpar.shard_sequence(tokens[rows], cp_rank, cp, 1, "zigzag")
        y = cpar.shard_sequence(labels[rows], cp_rank, cp, 1, "zigzag")
        loss, report = plan.loss(model(x, positions=positions), y)  # cp_loss, vocab-parallel
        loss.backward()
        plan.reduce_gradients()
        total = report.clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
        ref_losses.append(ref_loss.item())
        worst = _finish_step(ref, model, opts, worst)
    return losses, ref_losses, worst


@pytest.mark.parametrize("dims_kw", [{"cp": 2, "dp_shard": 2}, {"cp": 2, "tp": 2}])
def test_context_parallel_composes_with_dp_and_tp(dist_pool, dims_kw):
    """Block AttnRes with ring attention (zigzag) on cp=2 × dp_shard=2 and cp=2 × tp=2: losses,
    gradients and updated parameters within the model's fp32 bound over 3 SGD steps."""
    for losses, ref_losses, worst in dist_pool(4).run(_composed_cp, "block", dims_kw):
        _check(losses, ref_losses, worst, _bound("block"))


def _composed_pp(residual: str, dims_kw: dict, tie: bool, steps: int = 3):
    """Pipeline stages (interleaved 1F1B, depth cache on) composed with dp / tp through the real
    `parallelize()`, one-row micro-batches; the gradient norm goes through the trainer's clipping."""
    from depthscale.parallel.data_parallel import clip_grad_norm_
    from depthscale.parallel.pipeline.depth_cache import DepthCache
    from depthscale.parallel.pipeline.runtime import PipelineRuntime
    from depthscale.parallel.pipeline.schedules import interleaved_1f1b
    from depthscale.parallel.pipeline.stage import (
        counted_elsewhere,
        split_layers,
        tied_embedding_group,
    )

    dims, mesh, ref, model, opts, rows, plan = _setup(
        residual, dims_kw, 1, n_layers=4, tie_embeddings=tie
    )
    stages, cfg = plan.stages, model.cfg
    owned = {id(p) for stage in stages for p in stage.parameters()}
    assert all(id(p) in owned for p in model.parameters()), "a parameter outside every stage"
    pp, virtual = dims.pp, len(stages)
    pp_group = mesh["pp"].get_group()
    micro = rows.stop - rows.start
    cache = DepthCache(cfg, split_layers(cfg.n_layers, pp * virtual), pp, enabled=True)
    runtime = PipelineRuntime(stages, interleaved_1f1b(pp, virtual, micro), pp_group, cache)
    tied_group = tied_embedding_group(cfg, mesh)
    g = torch.Generator().manual_seed(1)
    losses, ref_losses, norms, ref_norms = [], [], [], []
    worst = {"grad": 0.0, "param": 0.0}
    reductions = []  # FSDP gradient reduce-scatters / all-reduces issued inside each step
    for step in range(steps):
        tokens = torch.randint(0, 64, (BATCH, SEQ), generator=g)
        labels = torch.randint(0, 64, (BATCH, SEQ), generator=g)
        ref_loss = cross_entropy(ref(tokens), labels)
        ref_loss.backward()
        with _counting_reductions() as count, _deferral(enabled=step < steps - 1):
            loss, _ = runtime.step(
                list(tokens[rows].chunk(micro)),
                list(labels[rows].chunk(micro)),
                (1, SEQ // dims.tp, cfg.dim),
                torch.float32,
                torch.device("cpu"),
            )
        reductions.append(count[0])
        plan.reduce_gradients()  # tied copies, tp-replicated sums, FSDP-replicated queries
        total = loss.detach().clone() if loss is not None else torch.zeros(())
        dist.all_reduce(total, group=pp_group)
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
        ref_losses.append(ref_loss.item())
        excludes = counted_elsewhere(model, tied_group)
        params = [p for p in model.parameters() if p.grad is not None]
        norms.append(clip_grad_norm_(params, 0.0, across=pp_group, norm_excludes=excludes).item())
        ref_norms.append(clip_grad_norm_(list(ref.parameters()), 0.0).item())
        worst = _finish_step(ref, model, opts, worst)
    return losses, ref_losses, norms, ref_norms, worst, reductions, micro


@contextlib.contextmanager
def _counting_reductions():
    from depthscale.parallel.tp_comm import REDUCE_SCATTER  # this torch's name for it

    count = [0]
    names = (REDUCE_SCATTER, "all_reduce")
    originals = [getattr(dist, name) for name in names]

    def counted(fn):
        def run(*args, **kwargs):
            count[0] += 1
            return fn(*args, **kwargs)

        return run

    for name, fn in zip(names, originals):
        setattr(dist, name, counted(fn))
    try:
        yield count
    finally:
        for name, fn in zip(names, originals):
            setattr(dist, name, fn)


@contextlib.contextmanager
def _deferral(enabled: bool):
    """Turn off the runtime's deferred gradient sync (FSDP reduces after every micro-batch)."""
    from depthscale.parallel.pipeline import runtime

    original = runtime._defer_gradient_sync
    if not enabled:
        runtime._defer_gradient_sync = lambda stage, until_last: None
    try:
        yield
    finally:
        runtime._defer_gradient_sync = original


_N_PARAMS = 10**5  # more than the 4-layer test model has entries

PP_LAYOUTS = [
    ("block", {"pp": 2, "dp_shard": 2}, False),
    ("block", {"pp": 2, "dp_shard": 2, "pp_virtual": 2}, True),
    ("standard", {"pp": 2, "dp_shard": 2}, True),
    ("full", {"pp": 2, "dp_shard": 2, "pp_virtual": 2}, False),
    ("full", {"pp": 2, "dp_replicate": 2}, False),
    ("block", {"pp": 2, "tp": 2}, False),
    ("block", {"pp": 2, "tp": 2, "pp_virtual": 2}, True),
    ("full", {"pp": 2, "tp": 2}, False),
    ("standard", {"pp": 2, "tp": 2}, False),
]


@pytest.mark.parametrize("residual,dims_kw,tie", PP_LAYOUTS)
def test_pipeline_composes_with_dp_and_tp(dist_pool, residual, dims_kw, tie):
    """pp=2 × dp_shard=2 (FSDP2, each stage its root), × dp_replicate=2 and × tp=2, 1F1B and
    interleaved (V=2), tied and untied embeddings: losses, gradients, updated parameters and
    gradient norms within the model's fp32 bound of one process over 3 SGD steps. With data
    parallelism, gradients are reduced once per step, not once per micro-batch (the last step
    turns the deferral off to compare)."""
    bound = _bound(residual, n_layers=4)
    for losses, ref_losses, norms, ref_norms, worst, reductions, micro in dist_pool(4).run(
        _composed_pp, residual, dims_kw, tie
    ):
        _check(losses, ref_losses, worst, bound)
        # the norm's own sum of squares (a cascade sum over all entries) adds its rounding
        norm_bound = bound + fp32_sum_bound(_N_PARAMS, pairwise=True, block=16)
        for step, (norm, ref_norm) in enumerate(zip(norms, ref_norms)):
            check(abs(norm - ref_norm) / ref_norm, norm_bound, f"step {step} gradient norm")
        if "tp" not in dims_kw:  # data parallel: one gradient reduction per unit and step
            deferred, every_micro = reductions[0], reductions[-1]
            assert deferred > 0 and every_micro == micro * deferred, reductions


def _through_plan(residual: str, dims_kw: dict, tie: bool, steps: int = 3, offload: bool = False):
    """A step exactly as the trainer runs it: `ParallelPlan.forward_backward` over one-row
    micro-batches, `reduce_gradients`, `clip_gradients` (measuring only), the loss share averaged
    over all ranks."""
    dims, mesh, ref, model, opts, rows, plan = _setup(
        residual, dims_kw, 1, offload, n_layers=4, tie_embeddings=tie
    )
    if offload:  # FSDP2 keeps every sharded parameter with its CPU offload policy
        from torch.distributed.fsdp import FSDPModule

        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        offloaded = [
            p.offload_to_cpu
            for u in units
            for p in u._get_fsdp_state()._fsdp_param_group.fsdp_params
        ]
        assert units and all(offloaded), offloaded
    g = torch.Generator().manual_seed(1)
    losses, ref_losses, norms, ref_norms = [], [], [], []
    worst = {"grad": 0.0, "param": 0.0}
    for _ in range(steps):
        tokens = torch.randint(0, 64, (BATCH, SEQ), generator=g)
        labels = torch.randint(0, 64, (BATCH, SEQ), generator=g)
        ref_loss = cross_entropy(ref(tokens), labels)
        ref_loss.backward()
        share = plan.forward_backward(model, tokens[rows], labels[rows])  # one-row micro-batches
        plan.reduce_gradients()
        norms.append(plan.clip_gradients(0.0).item())
        dist.all_reduce(share)
        losses.append(share.item() / dist.get_world_size())
        ref_losses.append(ref_loss.item())
        ref_norms.append(torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 1e9).item())
        worst = _finish_step(ref, model, opts, worst)
    return losses, ref_losses, norms, ref_norms, worst


def _check_plan_run(results, residual: str) -> None:
    bound = _bound(residual, n_layers=4)
    norm_bound = bound + fp32_sum_bound(_N_PARAMS, pairwise=True, block=16)
    for losses, ref_losses, norms, ref_norms, worst in results:
        _check(losses, ref_losses, worst, bound)
        for step, (norm, ref_norm) in enumerate(zip(norms, ref_norms)):
            check(abs(norm - ref_norm) / ref_norm, norm_bound, f"step {step} gradient norm")


@pytest.mark.parametrize(
    "residual,dims_kw,tie",
    [
        ("block", {"pp": 2, "tp": 2}, True),
        ("block", {"cp": 2, "dp_shard": 2}, False),
        ("full", {"tp": 2, "dp_replicate": 2}, True),
    ],
)
def test_the_trainers_plan_matches_single_process(dist_pool, residual, dims_kw, tie):
    """The `ParallelPlan` the trainer steps through, on one layout of each kind (pipeline, context
    and tensor parallel, with data parallelism): the same bounds as the layouts driven by hand."""
    _check_plan_run(dist_pool(4).run(_through_plan, residual, dims_kw, tie), residual)


@pytest.mark.parametrize(
    "residual,dims_kw,tie",
    [
        ("standard", {"pp": 2, "cp": 2}, False),
        ("block", {"pp": 2, "cp": 2}, True),
        ("block", {"pp": 2, "cp": 2, "pp_virtual": 2}, False),
        ("full", {"pp": 2, "cp": 2}, False),
    ],
)
def test_pipeline_composes_with_context_parallel(dist_pool, residual, dims_kw, tie):
    """pp=2 × cp=2 through the trainer's `ParallelPlan`: ring attention inside the stages, depth
    states (and AttnRes blocks) crossing stages as zigzag sequence shards, the cross-stage cache on,
    the loss on the last stage summed over the cp group. Losses, gradients, updated parameters and
    gradient norms within the model's fp32 bound of one process over 3 SGD steps."""
    _check_plan_run(dist_pool(4).run(_through_plan, residual, dims_kw, tie), residual)


@pytest.mark.parametrize(
    "dims_kw,tie",
    [
        ({"cp": 4, "cp_ulysses": 4}, True),  # 4 heads, 2 KV heads repeated over 4 members
        ({"cp": 4, "cp_ulysses": 2}, False),  # hybrid: Ulysses pairs, a ring of 2 across
        ({"pp": 2, "cp": 2, "cp_ulysses": 2}, False),
        ({"tp": 2, "cp": 2, "cp_ulysses": 2}, True),  # 2 heads and 1 KV head per tp rank
        ({"dp_shard": 2, "cp": 2, "cp_ulysses": 2}, False),  # FSDP over dp_shard × cp
    ],
)
def test_ulysses_and_hybrid_context_parallel_match_single_process(dist_pool, dims_kw, tie):
    """Ulysses (`parallel.cp_ulysses` = cp) and hybrid (2 Ulysses × 2 ring) context parallelism
    through the trainer's `ParallelPlan`, alone and with pp, tp and FSDP, Block AttnRes: losses,
    gradients, updated parameters and gradient norms within the model's fp32 bound of one
    process over 3 SGD steps."""
    _check_plan_run(dist_pool(4).run(_through_plan, "block", dims_kw, tie), "block")


@pytest.mark.slow
@pytest.mark.parametrize(
    "dims_kw",
    [
        {"pp": 2, "cp": 2, "tp": 2},
        {"pp": 2, "cp": 2, "dp_shard": 2},
        {"pp": 2, "tp": 2, "dp_shard": 2},
    ],
)
def test_pipeline_context_and_tensor_or_data_parallel_on_8_ranks(dist_pool, dims_kw):
    """Eight processes: pp=2 × cp=2 × tp=2, pp=2 × cp=2 × dp_shard=2 and pp=2 × tp=2 × dp_shard=2
    (the vocabulary-sharded embedding and head owned by the stages FSDP wraps), Block AttnRes, tied
    embeddings, through the `ParallelPlan`, within the same bound as one process."""
    _check_plan_run(dist_pool(8).run(_through_plan, "block", dims_kw, True), "block")


@pytest.mark.parametrize(
    "residual,dims_kw",
    [
        ("full", {"dp_replicate": 2, "dp_shard": 2}),
        ("full", {"dp_shard": 4}),
        ("block", {"dp_replicate": 2, "dp_shard": 2}),
    ],
)
def test_zero3_with_cpu_offload_matches_single_process(dist_pool, residual, dims_kw):
    """Full AttnRes without pipelining: ZeRO-3 inside a shard group (HSDP) or over all ranks, with
    FSDP2's CPU offload of parameters, gradients and optimizer states (`train.offload_params`),
    through the trainer's plan: the same bounds as one process."""
    _check_plan_run(dist_pool(4).run(_through_plan, residual, dims_kw, True, 3, True), residual)
