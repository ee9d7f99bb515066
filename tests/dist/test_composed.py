"""Composed layouts through the real `parallelize()`: tp × dp_shard (and tp × dp_replicate) match
one process on loss and gradients over several optimizer steps, for every residual mode."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from depthscale.config import Config
from depthscale.model.transformer import Transformer, cross_entropy
from depthscale.parallel.mesh import ParallelDims
from depthscale.parallel.parallelize import dp_rank_and_size, parallelize
from depthscale.parallel.tensor_parallel import tp_sync_replicated_grads

BATCH, SEQ = 4, 16


def _config(residual: str, chunks: int) -> Config:
    cfg = Config()
    m = cfg.model
    m.vocab_size, m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.max_seq_len = 64, 32, 2, 4, 2, SEQ
    m.residual, m.attnres_n_blocks = residual, 2
    cfg.parallel.tp_overlap_chunks = chunks
    return cfg


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _setup(residual: str, dims_kw: dict, chunks: int):
    """Mesh, the single-process reference and the parallelized copy (same seed), their optimizers,
    and this rank's rows of the batch."""
    dims = ParallelDims(**dims_kw).validate(dist.get_world_size())
    cfg = _config(residual, chunks)
    for name, value in dims_kw.items():
        setattr(cfg.parallel, name, value)
    mesh = dims.build_mesh("cpu")
    torch.manual_seed(0)
    ref = Transformer(cfg.model)
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    parallelize(model, mesh, dims, cfg)
    rank, size = dp_rank_and_size(mesh, dims)
    rows = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
    opts = torch.optim.SGD(ref.parameters(), lr=0.5), torch.optim.SGD(model.parameters(), lr=0.5)
    return dims, mesh, ref, model, opts, rows


def _finish_step(ref, model, opts, worst):
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        worst = max(worst, (_full(p.grad) - ref_grads[name].grad).abs().max().item())
    for opt in opts:
        opt.step()
        opt.zero_grad()
    return worst


def _composed(residual: str, dims_kw: dict, chunks: int, steps: int = 3):
    dims, _, ref, model, opts, rows = _setup(residual, dims_kw, chunks)
    g = torch.Generator().manual_seed(1)
    losses, ref_losses, worst = [], [], 0.0
    for _ in range(steps):
        tokens = torch.randint(0, 64, (BATCH, SEQ), generator=g)
        labels = torch.randint(0, 64, (BATCH, SEQ), generator=g)
        ref_loss = cross_entropy(ref(tokens), labels)
        ref_loss.backward()
        loss = cross_entropy(model(tokens[rows]), labels[rows])
        loss.backward()
        if dims.tp > 1:
            tp_sync_replicated_grads(model)
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
    """fp32: losses within 1e-5 and gradients within 2e-5 over 3 SGD steps (TP reorders the sums in
    the row-parallel GEMMs and reduce-scatters; the gap is fp32 rounding, not drift)."""
    for losses, ref_losses, worst in dist_pool(4).run(_composed, residual, dims_kw, chunks):
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        assert worst < 2e-5


def _composed_cp(residual: str, dims_kw: dict, steps: int = 3):
    from depthscale.parallel import context_parallel as cpar

    dims, mesh, ref, model, opts, rows = _setup(residual, dims_kw, 1)
    cp, cp_rank, cp_group = dims.cp, mesh.get_local_rank("cp"), mesh["cp"].get_group()
    g = torch.Generator().manual_seed(1)
    losses, ref_losses, worst = [], [], 0.0
    for _ in range(steps):
        tokens = torch.randint(0, 64, (BATCH, SEQ), generator=g)
        labels = torch.randint(0, 64, (BATCH, SEQ), generator=g)
        ref_loss = cross_entropy(ref(tokens), labels)
        ref_loss.backward()
        positions = cpar.positions_for(SEQ, cp_rank, cp, "zigzag")
        x = cpar.shard_sequence(tokens[rows], cp_rank, cp, 1, "zigzag")
        y = cpar.shard_sequence(labels[rows], cp_rank, cp, 1, "zigzag")
        loss, report = cpar.cp_loss(model(x, positions=positions), y, cp_group)
        loss.backward()
        cpar.cp_all_reduce_grads(model, cp_group)
        if dims.tp > 1:
            tp_sync_replicated_grads(model)
        total = report.clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
        ref_losses.append(ref_loss.item())
        worst = _finish_step(ref, model, opts, worst)
    return losses, ref_losses, worst


@pytest.mark.parametrize("dims_kw", [{"cp": 2, "dp_shard": 2}, {"cp": 2, "tp": 2}])
def test_context_parallel_composes_with_dp_and_tp(dist_pool, dims_kw):
    """Block AttnRes with ring attention (zigzag) on cp=2 × dp_shard=2 and cp=2 × tp=2: losses within
    1e-5 and gradients within 2e-5 of one process over 3 SGD steps (fp32)."""
    for losses, ref_losses, worst in dist_pool(4).run(_composed_cp, "block", dims_kw):
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        assert worst < 2e-5
