"""Context-parallel chunks balanced over packed documents (`parallel.cp_balance = "documents"`):
a training step through the trainer's `ParallelPlan` on packed rows gives the loss and gradients
of running each document alone in one process — as zigzag does (`test_document_mask_layouts.py`,
whose rows and reference this reuses) — on cp = 2 (causal and with a sliding window) and on an odd
ring, cp = 3 (slow). The layouts the step ran are checked not to be zigzag (else the test would
not test the balance), and the step reports the cp ranks' max / mean attention work the layouts
give (`cp/work_max_mean`).

fp32 tolerances: `fp32_model_bound`, as in test_document_mask_layouts.py.
"""

import pytest
import torch
import torch.distributed as dist
from harness import cached_mesh, small_config
from test_document_mask_layouts import BATCH, EOS, SEQ, _alone, _rows
from torch.distributed.tensor import DTensor

from depthscale.model.documents import DocumentPacking, Documents
from depthscale.model.transformer import Transformer
from depthscale.parallel.cp_balance import layout_for
from depthscale.parallel.mesh import ParallelDims
from depthscale.parallel.parallelize import parallelize
from depthscale.parallel.sequence_layout import positions_for
from tolerances import check, fp32_model_bound, scaled_err

CHUNK = 2
"""parallel.cp_balance_chunk: 2-token chunks, so the tiny rows have room to be balanced."""


def _config(cp: int, window: int):
    cfg = small_config("block", {"cp": cp}, batch=BATCH, seq=SEQ)
    cfg.model.n_layers, cfg.model.sliding_window = 2, window
    cfg.parallel.cp_balance, cfg.parallel.cp_balance_chunk = "documents", CHUNK
    return cfg


def _balanced_step(cp: int, window: int):
    dims = ParallelDims(cp=cp).validate(dist.get_world_size())
    cfg = _config(cp, window)
    torch.manual_seed(0)
    ref = Transformer(cfg.model)
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    plan = parallelize(model, cached_mesh(dims), dims, cfg)
    packing = DocumentPacking(EOS)
    plan.pack_documents(packing)
    tokens, labels = _rows()
    ref_loss = _alone(ref, tokens, labels, packing)
    ref_loss.backward()
    share = plan.forward_backward(model, tokens, labels)  # dp = 1: every rank has every row
    plan.reduce_gradients()
    dist.all_reduce(share)
    ref_grads = dict(ref.named_parameters(remove_duplicate=False))
    worst = 0.0
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        worst = max(worst, scaled_err(grad, ref_grads[name].grad))
    zigzag = [positions_for(SEQ, r, cp, "zigzag") for r in range(cp)]
    moved = [  # the ring planned on a layout other than zigzag's positions
        not all(torch.equal(p, z) for p, z in zip(plan_.pos, zigzag))
        for plan_ in model.layers["0"].attention.attention_fn._plans.values()
    ]
    reported = plan.finish_step()["cp/work_max_mean"]
    return share.item() / dist.get_world_size(), ref_loss.item(), worst, any(moved), reported


def _expected_imbalance(cp: int, window: int) -> float:
    """What the step should report: its one-row micro-batches' layouts, Σ max / Σ mean work."""
    tokens, _ = _rows()
    top = mean = 0.0
    for row in tokens.split(1):
        documents = DocumentPacking(EOS).documents(row)
        starts = None if documents is None else documents.host_starts
        balance = "documents" if documents is not None else "zigzag"
        layout = layout_for(starts, SEQ, cp, window, CHUNK, balance)
        top, mean = top + max(layout.work), mean + sum(layout.work) / cp
    return top / mean


def _run(dist_pool, cp: int, window: int) -> None:
    bound = fp32_model_bound(_config(cp, window).model, SEQ, BATCH)
    zigzag = [
        layout_for(Documents.of(row, EOS).host_starts, SEQ, cp, window, balance="zigzag")
        for row in _rows()[0].split(1)
    ]
    expected = _expected_imbalance(cp, window)
    assert expected < max(z.imbalance for z in zigzag)  # these rows unbalance zigzag
    for loss, ref_loss, worst, moved, reported in dist_pool(cp).run(_balanced_step, cp, window):
        check(abs(loss - ref_loss) / ref_loss, bound, "loss")
        check(worst, bound, "worst gradient")
        assert moved  # the ring ran a layout other than zigzag
        assert reported == pytest.approx(expected)


@pytest.mark.parametrize("window", [0, 5], ids=["causal", "window"])
def test_balanced_layout_step_equals_its_documents_alone(dist_pool, window):
    _run(dist_pool, 2, window)


@pytest.mark.slow
def test_balanced_layout_on_an_odd_ring(dist_pool):
    _run(dist_pool, 3, 5)
