"""Document masking (`data.document_mask`) in every layout: a training step through the trainer's
`ParallelPlan` on packed rows gives the loss and gradients of running each document alone in one
process — under ring attention (cp = 2: zigzag, and chunks balanced over the documents with a
sliding window), Ulysses (cp_ulysses = 2, window), pipeline stages
(pp = 2) and tensor parallelism (tp = 2, with the EOS-target loss mask).

fp32 tolerances (tests/tolerances.py): the layout and the per-document runs sum in other orders
(ring merges, row-parallel GEMMs, micro-batch accumulation, shorter sequences), bounded by
`fp32_model_bound` of the model on the batch: the loss relative to itself, each gradient relative
to its largest entry.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import cached_mesh, small_config
from torch.distributed.tensor import DTensor

from depthscale.model.documents import DocumentPacking, Documents
from depthscale.model.transformer import Transformer
from depthscale.parallel.mesh import ParallelDims
from depthscale.parallel.parallelize import parallelize
from tolerances import check, fp32_model_bound, scaled_err

BATCH, SEQ, EOS = 4, 24, 1


def _rows() -> tuple[torch.Tensor, torch.Tensor]:
    """Packed rows: documents of 1 to ~12 tokens (EOS about every 6th token), one row starting
    with EOS, one without any."""
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(2, 64, (BATCH, SEQ + 1), generator=g)
    tokens[torch.rand(BATCH, SEQ + 1, generator=g) < 0.17] = EOS
    tokens[1, 0] = EOS
    tokens[3] = torch.randint(2, 64, (SEQ + 1,), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _config(dims_kw: dict, window: int):
    cfg = small_config("block", dims_kw, batch=BATCH, seq=SEQ)
    cfg.model.n_layers, cfg.model.sliding_window = 2, window
    return cfg


def _alone(model: Transformer, tokens, labels, packing: DocumentPacking) -> torch.Tensor:
    """The step's loss with every document run as its own sequence: per row (one-row
    micro-batches), the mean over its counted targets; then the mean over rows."""
    docs = Documents.of(tokens, EOS)
    labels = packing.labels(labels)
    row_means = []
    for b in range(tokens.shape[0]):
        total = 0.0
        for doc in docs.host_ids[b].unique():
            at = (docs.host_ids[b] == doc).nonzero().flatten()
            logits = model(tokens[b : b + 1, at])
            total = total + F.cross_entropy(
                logits.flatten(0, 1), labels[b, at], ignore_index=-100, reduction="sum"
            )
        row_means.append(total / (labels[b] != -100).sum())
    return torch.stack(row_means).mean()


def _step(dims_kw: dict, window: int, mask_eos_target: bool):
    # cp_ulysses (a split of cp) and cp_balance (its chunk order) are no degrees
    sizes = {k: v for k, v in dims_kw.items() if k not in ("cp_ulysses", "cp_balance")}
    dims = ParallelDims(**sizes).validate(dist.get_world_size())
    cfg = _config(dims_kw, window)
    torch.manual_seed(0)
    ref = Transformer(cfg.model)
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    plan = parallelize(model, cached_mesh(dims), dims, cfg)
    packing = DocumentPacking(EOS, mask_eos_target)
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
    return share.item() / dist.get_world_size(), ref_loss.item(), worst


@pytest.mark.parametrize(
    "dims_kw,window,mask_eos_target",
    [
        ({"cp": 2, "cp_balance": "zigzag"}, 0, False),
        ({"cp": 2}, 5, False),
        ({"pp": 2}, 5, False),
        ({"tp": 2}, 0, True),
        ({"cp": 2, "cp_ulysses": 2}, 5, False),
    ],
    ids=["cp-zigzag", "cp-balanced-window", "pp-window", "tp-eos-mask", "cp-ulysses-window"],
)
def test_a_packed_step_equals_its_documents_alone(dist_pool, dims_kw, window, mask_eos_target):
    bound = fp32_model_bound(_config(dims_kw, window).model, SEQ, BATCH)
    for loss, ref_loss, worst in dist_pool(2).run(_step, dims_kw, window, mask_eos_target):
        check(abs(loss - ref_loss) / ref_loss, bound, "loss")
        check(worst, bound, "worst gradient")
