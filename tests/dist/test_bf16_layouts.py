"""bf16 in every layout: 10 free-running AdamW steps under bf16 autocast, built the way the trainer
builds a model (meta device, then `parallelize` materialises each rank's shards), against the same
steps in one process.

One dtype policy holds everywhere (`Transformer.embed`): under autocast the depth state — the
residual stream, every AttnRes source and the partial sums — is in the compute dtype, so pipeline
hops, ring blocks and FSDP's bf16 parameters all meet the same tensors, and the fused AttnRes kernels
take the reads. AttnRes softmax statistics, the loss, gradient reductions, master weights and the
optimizer stay fp32.

Tolerance, derived per step k: a layout changes only where bf16 roundings fall (sum order in
reduce-scatters, row-parallel partial sums, ring merges, micro-batch accumulation). The distance of
the one-process bf16 curve from its fp32 twin, g_k = |L_bf16(k) − L_fp32(k)|, measures what bf16
rounding does to this curve; a layout's bf16 curve is another draw of the same roundings, so by the
triangle inequality it lies within 2·g of the one-process bf16 curve. Gaps cross zero now and then,
so g is the running maximum over steps ≤ k, with a factor 3 (not 2) for draws whose rounding is
larger than the reference's, plus one bf16 rounding of the loss's scale (2^-8 relative: bf16 logits
carry that much). Seen: at most a third of the bound. The bound stays a small fraction of what the
run learns (asserted), so a layout that trains differently cannot hide in it; gradients themselves
are held to fp32 bounds by the parity suites (test_composed.py, test_data_parallel.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import cached_mesh, small_config

from depthscale.config import Config
from depthscale.model.transformer import Transformer
from depthscale.parallel.mesh import ParallelDims
from depthscale.parallel.parallelize import dp_rank_and_size, parallelize
from depthscale.train.optim import build_optimizer

BATCH, SEQ, STEPS, VOCAB = 4, 16, 10, 64
U_BF16 = 2.0**-8


def _config(residual: str, dims_kw: dict) -> Config:
    """`residual` 'moe': block AttnRes with MoE FFNs (8 experts, top 2, the first layer dense)."""
    cfg = small_config("block" if residual == "moe" else residual, dims_kw, BATCH, SEQ, VOCAB)
    if residual == "moe":
        m = cfg.model
        m.moe_experts, m.moe_top_k, m.moe_ffn_dim, m.moe_first_dense = 8, 2, 32, 1
    cfg.train.dtype = "bfloat16"
    cfg.optim.lr, cfg.optim.weight_decay = 1e-2, 0.0
    return cfg


def _autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _curve(cfg: Config, mesh, dims: ParallelDims, dtype: str = "bfloat16") -> list[float]:
    """The global mean loss of each of STEPS AdamW steps, through the trainer's plan."""
    cfg.train.dtype = dtype
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    plan = parallelize(model, mesh, dims, cfg, device=torch.device("cpu"))
    optimizer = build_optimizer(model, cfg.optim)
    rank, size = dp_rank_and_size(mesh, dims)
    rows = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
    # one batch, learned by heart: the loss must fall, so a broken update shows
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    x, y = tokens[rows, :-1], tokens[rows, 1:]
    autocast = _autocast if dtype == "bfloat16" else None
    losses = []
    for _ in range(STEPS):
        share = (
            plan.forward_backward(model, x, y, autocast=autocast)
            if autocast is not None
            else plan.forward_backward(model, x, y)
        )
        plan.reduce_gradients()
        plan.clip_gradients(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        share = share.detach().float().reshape(())
        if mesh is not None:
            dist.all_reduce(share)
            share /= dist.get_world_size()
        losses.append(share.item())
    return losses


_ONE_PROCESS: dict[str, dict] = {}  # per worker: the reference curves, computed once per residual


def _layout_curves(residual: str, dims_kw: dict) -> dict:
    """On every rank: the layout's bf16 curve, and the one-process bf16 and fp32 curves."""
    dims = ParallelDims(**{k: v for k, v in dims_kw.items() if k not in ("pp_virtual", "ep")})
    mesh = cached_mesh(dims)
    out = {"layout": _curve(_config(residual, dims_kw), mesh, dims)}
    if residual not in _ONE_PROCESS:
        one = ParallelDims()
        _ONE_PROCESS[residual] = {
            "bf16": _curve(_config(residual, {}), None, one),
            "fp32": _curve(_config(residual, {}), None, one, dtype="float32"),
        }
    return out | _ONE_PROCESS[residual]


def tolerance(bf16: list[float], fp32: list[float]) -> list[float]:
    """Per-step bound on |layout − one process| for bf16 curves (module docstring)."""
    bounds, gap = [], 0.0
    for a, b in zip(bf16, fp32):
        gap = max(gap, abs(a - b))
        bounds.append(3 * gap + U_BF16 * abs(a))
    return bounds


LAYOUTS = [
    ({"dp_shard": 2}, 2),
    ({"dp_replicate": 2, "dp_shard": 2}, 4),
    ({"tp": 2}, 2),
    ({"pp": 2}, 2),
    ({"pp": 2, "pp_virtual": 2}, 2),
    ({"cp": 2}, 2),
    ({"pp": 2, "tp": 2}, 4),
]


CASES = [(r, *layout) for r in ("standard", "block") for layout in LAYOUTS]
CASES.append(("moe", {"dp_shard": 2, "ep": 2}, 2))  # expert parallelism: all-to-all in bf16


@pytest.mark.parametrize("residual,dims_kw,world", CASES, ids=lambda v: str(v))
def test_bf16_loss_curve_matches_one_process(dist_pool, residual, dims_kw, world):
    results = dist_pool(world).run(_layout_curves, residual, dims_kw)
    r = results[0]
    assert all(x == r for x in results), "ranks disagree on the global loss"
    bounds = tolerance(r["bf16"], r["fp32"])
    diffs = [abs(a - b) for a, b in zip(r["layout"], r["bf16"])]
    for k, (d, b) in enumerate(zip(diffs, bounds)):
        assert d <= b, f"step {k + 1}: |layout − one process| = {d:.3g} > bound {b:.3g}"
    learned = r["bf16"][0] - r["bf16"][-1]
    assert learned > 1.0, f"the one-process run learned only {learned:.3g}"
    assert max(bounds) < 0.1 * learned, "the bound would hide a run that trains differently"
