"""#38 hazard 14: collectives in compiled layers. A compiled tensor-parallel model is one graph:
its collectives are traced as torch's functional collectives (`parallel/tp_comm.py`), where c10d's
Work objects and the span context managers broke a one-layer model's graph 19-21 times
(`torch._dynamo.explain`, measured before the change); `fullgraph=True` now compiles, and the
compiled run (AOT autograd: the backward's collectives are traced too) gives the eager run's loss
and gradients. The chunked (MegaScale overlap) operators by default; the plain ones as a slow case
(each ~30 s of compiling on 2 gloo ranks). Ring attention stays out of the graph as one clean
break (it was 16)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

TP = 2


def _model(chunks: int):
    from torch.distributed.device_mesh import init_device_mesh

    from depthscale.config import ModelConfig
    from depthscale.model.transformer import Transformer
    from depthscale.parallel.tensor_parallel import apply_tensor_parallel

    cfg = ModelConfig(
        vocab_size=64, dim=32, n_layers=1, n_heads=4, ffn_dim=64, max_seq_len=64, init_std=0.1
    )
    torch.manual_seed(0)
    model = Transformer(cfg)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    apply_tensor_parallel(model, mesh, chunks)
    return model


def _compiled_vs_eager(chunks: int) -> dict:
    import torch._dynamo

    from depthscale.parallel.tp_comm import count_collectives

    tokens = torch.randint(0, 64, (2, 16 // TP), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    runs = []
    for compiled in (False, True):
        model = _model(chunks)
        run = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        with count_collectives() as counts:
            loss = run(tokens).float().square().mean()
            loss.backward()
        grads = [getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for p in model.parameters()]
        runs.append((loss.detach(), grads, sum(counts.values())))
    (eager_loss, eager_grads, eager_count), (loss, grads, count) = runs
    errs = [(a - b).abs().max() / b.abs().max() for a, b in zip(grads, eager_grads, strict=True)]
    return {
        "loss": (abs(loss - eager_loss) / abs(eager_loss)).item(),
        "grads": max(errs).item(),
        "counted": (eager_count, count),
    }


@pytest.mark.parametrize("chunks", [2, pytest.param(1, marks=pytest.mark.slow)])
def test_compiled_tp_model_is_one_graph_and_matches_eager(dist_pool, chunks):
    for r in dist_pool(TP).run(_compiled_vs_eager, chunks):
        # the same aten ops run in the same order: equal up to a few fp32 roundings
        assert r["loss"] <= 1e-6 and r["grads"] <= 1e-5, r
        # a compiled layer's collectives are not counted (tp_comm's note): the eager run's are
        assert r["counted"][0] > 0 and r["counted"][1] == 0, r


def _compiled_ring() -> dict:
    import torch._dynamo

    from depthscale.parallel.context_parallel import RingAttention, positions_for

    ring = RingAttention(dist.group.WORLD, layout="contiguous")
    pos = positions_for(32, dist.get_rank(), TP, "contiguous")
    g = torch.Generator().manual_seed(dist.get_rank())
    q, k, v = (torch.randn(1, h, 16, 8, generator=g) for h in (4, 2, 2))

    def layer(q, k, v):
        return ring(q * 2, k, v, pos, pos, 0).relu()

    torch._dynamo.reset()
    breaks = torch._dynamo.explain(layer)(q, k, v).graph_break_count
    runs = []
    for fn in (layer, torch.compile(layer, backend="aot_eager")):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.square().sum().backward()
        runs.append([out.detach(), *(t.grad for t in leaves)])
    return {"breaks": breaks, "diff": max((a - b).abs().max().item() for a, b in zip(*runs))}


def test_compiled_layer_leaves_the_ring_out_as_one_break(dist_pool):
    for r in dist_pool(TP).run(_compiled_ring):
        assert r["breaks"] == 1 and r["diff"] <= 1e-6, r
