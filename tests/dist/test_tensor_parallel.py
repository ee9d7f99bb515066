"""Tensor + sequence parallelism (tp=2, gloo) against the single-process model: logits, loss, every
gradient and three SGD steps; the chunked MegaScale overlap against the unchunked path; collective
counts; bad layouts."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from depthscale.config import ModelConfig
from depthscale.errors import ConfigError
from depthscale.model.transformer import Transformer, TransformerBlock, cross_entropy
from depthscale.parallel.loss import TokenLoss, vocab_parallel_cross_entropy
from depthscale.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPContext,
    apply_tensor_parallel,
    collectives_per_step,
    tp_sync_replicated_grads,
)
from depthscale.parallel.tp_comm import count_collectives
from depthscale.train.offload import saved_activation_bytes
from tolerances import check, copy_params_, fp32_model_bound

TP = 2
B, T, VOCAB = 2, 16, 64
LR = 0.1

_mesh = None


def _tp_mesh():
    global _mesh
    if _mesh is None:
        _mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    return _mesh


def _cfg(**kw) -> ModelConfig:
    base = dict(
        vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=64, init_std=0.1
    )
    return ModelConfig(**(base | kw))


def _build(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> Transformer:
    """Same seed on every rank and for the reference; 1-D params perturbed so that norm gains and
    AttnRes queries are not trivially ones / zeros (non-uniform depth weights)."""
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.3 * torch.randn_like(p))
    return model.to(dtype)


def _batch(seq: int = T):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (B, seq), generator=g), torch.randint(
        0, VOCAB, (B, seq), generator=g
    )


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _rel(a, b) -> float:
    """Relative error in norm: |a - b| / |b|."""
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _step(model, tokens, labels, tp: bool):
    """One forward + backward; returns the full logits and the loss. Under tp the logits are this
    rank's vocabulary slice and the loss vocabulary-parallel (as the trainer runs it); the slices
    are gathered afterwards, only to compare them."""
    logits = model(tokens)
    if not tp:
        loss = cross_entropy(logits, labels)
        loss.backward()
        return logits.detach(), loss.detach()
    group = _tp_mesh().get_group()
    loss, _ = TokenLoss(vocab_group=group)(logits, labels)
    loss.backward()
    tp_sync_replicated_grads(model)
    return _gather_vocab(logits.detach(), group), loss.detach()


def _gather_vocab(logits, group):
    slices = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(slices, logits.contiguous(), group=group)
    return torch.cat(slices, dim=-1)


def _parity(
    cfg_kw: dict, chunks: int, dtype: torch.dtype, steps: int = 3, recompute: str = "none"
) -> dict:
    """Single-process reference and tp model side by side for `steps` SGD steps: per step the
    relative errors of logits, loss, gradients (worst tensor) and, after the update, parameters.
    fp32: every step starts from the reference's parameters (training amplifies a rounding
    difference in the parameters ×10-20 per step here, so free-running fp32 trajectories have no
    fixed bound); fp64 runs free: its rounding stays far below the limit after 3 steps."""
    cfg = _cfg(**cfg_kw)
    ref, tpm = _build(cfg, dtype), _build(cfg, dtype)
    apply_tensor_parallel(tpm, _tp_mesh(), chunks=chunks)
    tpm.set_recompute(recompute)
    assert list(tpm.state_dict()) == list(ref.state_dict())
    assert isinstance(tpm.layers["0"].attention.wq.weight, DTensor)
    # one model: tp changes no class and installs its collectives through the projections seam
    assert type(tpm) is Transformer
    assert all(type(block) is TransformerBlock for block in tpm.layers.values())
    assert f"projections=sequence_parallel(tp={TP}, chunks={chunks})" in repr(tpm)
    tokens, labels = _batch()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=LR)
    opt_tp = torch.optim.SGD(tpm.parameters(), lr=LR)
    tp_params = dict(tpm.named_parameters())
    errs, counts = [], []
    for _ in range(steps):
        if dtype == torch.float32:
            copy_params_(tpm, ref)
        logits_ref, loss_ref = _step(ref, tokens, labels, tp=False)
        with count_collectives() as step_counts:
            logits_tp, loss_tp = _step(tpm, tokens, labels, tp=True)
        counts.append(dict(step_counts))
        err = {"logits": _rel(logits_tp, logits_ref), "loss": _rel(loss_tp, loss_ref)}
        err["grad"] = max(_rel(_full(tp_params[n].grad), p.grad) for n, p in ref.named_parameters())
        opt_ref.step()
        opt_tp.step()
        opt_ref.zero_grad()
        opt_tp.zero_grad()
        err["param"] = max(
            _rel(_full(tp_params[n].detach()), p.detach()) for n, p in ref.named_parameters()
        )
        errs.append(err)
    return {
        "errs": errs,
        "counts": counts,
        "expected": _expected_collectives(cfg, chunks, recompute),
        "loss": loss_tp.item(),
    }


def _expected_collectives(cfg: ModelConfig, chunks: int, recompute: str) -> dict:
    """Selective recompute re-runs each sublayer's forward collectives in backward."""
    counts = collectives_per_step(cfg, chunks)
    if recompute != "none":
        counts["all_gather"] += chunks * cfg.n_sublayers
        counts["reduce_scatter"] += chunks * cfg.n_sublayers
    pieces = -(-(T // TP) // cfg.ffn_chunk_size) if cfg.ffn_chunk_size else 1
    if pieces > 1 and not cfg.parallel_block:
        # a blockwise MLP gathers / scatters once per piece of the sequence shard (forward and
        # backward), and its checkpointed pieces replay their forward in backward. Unfused
        # (chunks = 1) the replay stops once the saved tensors are back (checkpoint's early stop),
        # before the reduce-scatter; the fused chunked operator replays it with its GEMM.
        counts["all_gather"] += (3 * pieces - 2) * chunks * cfg.n_layers
        replayed = pieces if chunks > 1 else 0
        counts["reduce_scatter"] += (2 * pieces - 2 + replayed) * chunks * cfg.n_layers
    return counts


# fp64 isolates the algorithm from rounding: observed errors <= 3e-15 through 3 free-running SGD steps
# (limit 1e-12). fp32: tp reorders the sums of the row-parallel GEMMs and reduce-scatters, so every
# step (from the same parameters) is bounded by the model's fp32 chain bound (tests/tolerances.py);
# parameters after the update p - lr·g inherit lr·(gradient error), well inside the same bound.
FP64_TOL = 1e-12


def _tols(cfg_kw: dict, dtype: torch.dtype) -> float:
    if dtype == torch.float64:
        return FP64_TOL
    return fp32_model_bound(_cfg(**cfg_kw), T, B)


def _check(results: list[dict], cfg_kw: dict, dtype: torch.dtype) -> None:
    bound = _tols(cfg_kw, dtype)
    for r in results:
        for step, err in enumerate(r["errs"]):
            for key, value in err.items():
                check(value, bound, f"{dtype} step {step} {key}")
        assert all(c == r["expected"] for c in r["counts"]), r
    assert results[0]["loss"] == results[1]["loss"]  # every tp rank returns the same logits


CASES = {
    "standard-gqa": dict(residual="standard", n_kv_heads=2),
    "standard-parallel": dict(residual="standard", parallel_block=True),
    "full-gqa": dict(residual="full", n_kv_heads=2),
    "full-parallel": dict(residual="full", parallel_block=True),
    "standard-untied": dict(residual="standard", tie_embeddings=False),
    "block-untied-gqa": dict(
        residual="block", attnres_n_blocks=2, tie_embeddings=False, n_kv_heads=2
    ),
    "block": dict(residual="block", attnres_n_blocks=2),
    "block-parallel-gqa": dict(
        residual="block", attnres_n_blocks=2, parallel_block=True, n_kv_heads=2
    ),
    "block-blockwise-ffn": dict(residual="block", attnres_n_blocks=2, ffn_chunk_size=4),
}
DTYPES = {"fp64": torch.float64, "fp32": torch.float32}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(CASES))
def test_tp_matches_single_process(dist_pool, case, dtype):
    _check(dist_pool(TP).run(_parity, CASES[case], 1, DTYPES[dtype]), CASES[case], DTYPES[dtype])


@pytest.mark.parametrize(
    ("case", "chunks"),
    [("block", 2), ("block-parallel-gqa", 4), ("standard-gqa", 4), ("block-blockwise-ffn", 2)],
)
def test_chunked_overlap_matches_single_process(dist_pool, case, chunks):
    _check(
        dist_pool(TP).run(_parity, CASES[case], chunks, torch.float64), CASES[case], torch.float64
    )


def _chunked_vs_unchunked(cfg_kw: dict, chunks: int) -> dict:
    """The fused chunked operators against the unfused path (not only against the reference). fp32:
    the paths differ in GEMM shapes (chunked pieces), so in summation order."""
    cfg = _cfg(**cfg_kw)
    a, b = _build(cfg), _build(cfg)
    apply_tensor_parallel(a, _tp_mesh(), chunks=1)
    apply_tensor_parallel(b, _tp_mesh(), chunks=chunks)
    tokens, labels = _batch()
    la, _ = _step(a, tokens, labels, tp=True)
    with count_collectives() as step_counts:
        lb, _ = _step(b, tokens, labels, tp=True)
    counts = dict(step_counts)
    pb = dict(b.named_parameters())
    grad = max(_rel(_local(pb[n].grad), _local(p.grad)) for n, p in a.named_parameters())
    return {"logits": _rel(lb, la), "grad": grad, "counts": counts}


@pytest.mark.parametrize("chunks", [2, 4])
def test_chunked_equals_unchunked(dist_pool, chunks):
    cfg_kw = dict(residual="block", attnres_n_blocks=2, n_kv_heads=2)
    bound = fp32_model_bound(_cfg(**cfg_kw), T, B)  # two fp32 summation orders of one model
    for r in dist_pool(TP).run(_chunked_vs_unchunked, cfg_kw, chunks):
        check(r["logits"], bound, "logits")
        check(r["grad"], bound, "grad (worst tensor)")
        # 2 layers × 2 sublayers; per sublayer: chunks AG + chunks RS forward, the same backward
        # plus the head's input gather (chunked) and the embedding's reduce-scatter, both with
        # their backward; all-reduces: the loss's max and sums, the replicated-gradient sync
        s = 4
        assert r["counts"] == {
            "all_gather": 2 * chunks * s + chunks + 1,
            "reduce_scatter": 2 * chunks * s + chunks + 1,
            "all_reduce": 3,
        }


def _linear_pair(chunks: int) -> dict:
    """ColumnParallelLinear then RowParallelLinear on a sequence shard = two nn.Linear on the
    full sequence; input gradient returns as this rank's shard, weight gradients as DTensor shards."""
    torch.manual_seed(0)
    fc1, fc2 = (
        torch.nn.Linear(32, 64, bias=False).double(),
        torch.nn.Linear(64, 32, bias=False).double(),
    )
    x = torch.randn(B, T, 32, dtype=torch.float64, requires_grad=True)
    (fc2(fc1(x)) ** 2).sum().backward()
    col, row = (
        cls(lin, _ctx(chunks))
        for cls, lin in ((ColumnParallelLinear, fc1), (RowParallelLinear, fc2))
    )
    t, r = T // TP, dist.get_rank()
    xs = x.detach()[:, r * t : (r + 1) * t].clone().requires_grad_()
    y = row(col(xs))  # [B, T/tp, 32]
    # each rank's loss covers its own tokens; the sharded weights see every token through the
    # gather / reduce-scatter, so their gradients are complete without a tp all-reduce
    (y**2).sum().backward()
    grads = [m.weight.grad for m in (col, row)]
    return {
        "y": _rel(y, fc2(fc1(x))[:, r * t : (r + 1) * t]),
        "x_grad": _rel(xs.grad, x.grad[:, r * t : (r + 1) * t]),
        "w_grad": max(_rel(g.full_tensor(), lin.weight.grad) for g, lin in zip(grads, (fc1, fc2))),
    }


def _ctx(chunks: int) -> TPContext:
    mesh = _tp_mesh()
    return TPContext(mesh, mesh.get_group(), TP, mesh.get_local_rank(), chunks)


@pytest.mark.parametrize("chunks", [1, 2])
def test_column_row_parallel_linear(dist_pool, chunks):
    for r in dist_pool(TP).run(_linear_pair, chunks):
        assert max(r.values()) < 1e-12, r


def _autocast_smoke(chunks: int) -> tuple[float, float]:
    cfg = _cfg(residual="block", attnres_n_blocks=2, parallel_block=True)
    m = _build(cfg)
    apply_tensor_parallel(m, _tp_mesh(), chunks=chunks)
    tokens, labels = _batch()
    loss_fn = TokenLoss(vocab_group=_tp_mesh().get_group())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_bf16, _ = loss_fn(m(tokens), labels)
    loss_bf16.backward()
    tp_sync_replicated_grads(m)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in m.parameters())
    with torch.no_grad():
        loss, _ = loss_fn(m(tokens), labels)
    return loss_bf16.item(), loss.item()


@pytest.mark.parametrize("chunks", [1, 2])
def test_bf16_autocast_runs(dist_pool, chunks):
    for bf16, fp32 in dist_pool(TP).run(_autocast_smoke, chunks):
        assert abs(bf16 - fp32) < 0.05 * fp32


def _bad_layout(cfg_kw: dict, seq: int, chunks: int) -> str:
    try:
        m = Transformer(_cfg(**cfg_kw))
        apply_tensor_parallel(m, _tp_mesh(), chunks=chunks)
        m(_batch(seq)[0])
    except ConfigError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    ("cfg_kw", "seq", "chunks", "match"),
    [
        (dict(dim=48, n_heads=3), T, 1, r"model\.n_heads=3 is not divisible by tp=2"),
        (
            dict(n_kv_heads=1),
            T,
            1,
            r"kv_heads \(n_kv_heads or n_heads\)=1 is not divisible by tp=2",
        ),
        (dict(ffn_dim=65), T, 1, r"hidden_dim \(ffn_dim\)=65 is not divisible by tp=2"),
        (dict(vocab_size=65), T, 1, r"vocab_size=65 is not divisible by tp=2"),
        ({}, 15, 1, r"seq_len=15 is not divisible by tp=2"),
        ({}, T, 3, r"seq_len/tp=8 .* not divisible by chunks=3"),
    ],
)
def test_bad_layout_names_values(dist_pool, cfg_kw, seq, chunks, match):
    for msg in dist_pool(TP).run(_bad_layout, cfg_kw, seq, chunks):
        assert re.search(match, msg), msg


def _dcp_roundtrip(path: str) -> dict:
    """DCP checkpoints reshard between the tp model (DTensor shards) and the single-process model.
    A checkpoint round trip copies values: the loaded parameters equal the saved ones bit for bit."""
    import torch.distributed.checkpoint as dcp

    cfg = _cfg(residual="block", attnres_n_blocks=2, n_kv_heads=2)
    ref, tpm = _build(cfg), _build(cfg)
    apply_tensor_parallel(tpm, _tp_mesh(), chunks=2)
    tokens, labels = _batch()
    for model, tp in ((ref, False), (tpm, True)):  # one SGD step so weights differ from init
        _step(model, tokens, labels, tp)
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    dcp.save(tpm.state_dict(), checkpoint_id=f"{path}/tp")
    torch.manual_seed(123)
    plain = Transformer(cfg)  # other weights, overwritten by the load
    sd = plain.state_dict()
    dcp.load(sd, checkpoint_id=f"{path}/tp")
    plain.load_state_dict(sd)
    saved_tp = [_full(p.detach()) for p in tpm.parameters()]
    tp_to_plain = [
        n for (n, p), q in zip(plain.named_parameters(), saved_tp) if not torch.equal(p, q)
    ]

    dcp.save(ref.state_dict(), checkpoint_id=f"{path}/plain")
    other = Transformer(cfg)
    apply_tensor_parallel(other, _tp_mesh())
    sd = other.state_dict()
    dcp.load(sd, checkpoint_id=f"{path}/plain")
    other.load_state_dict(sd)
    plain_to_tp = [
        n
        for (n, p), q in zip(other.named_parameters(), ref.parameters())
        if not torch.equal(_full(p.detach()), q)
    ]
    return {"tp_to_plain": tp_to_plain, "plain_to_tp": plain_to_tp}


def test_dcp_checkpoint_reshards_to_and_from_single_process(dist_pool, tmp_path):
    for r in dist_pool(TP).run(_dcp_roundtrip, str(tmp_path)):
        assert r["tp_to_plain"] == [] and r["plain_to_tp"] == [], r  # names of differing tensors


def _vocab_parallel_loss(dtype: torch.dtype) -> dict:
    """`vocab_parallel_cross_entropy` on this rank's vocabulary slice against `F.cross_entropy` on
    the full logits: per-token losses (ignored labels give 0) and the logits' gradient, for a loss
    weighting tokens unequally; fp64 (algorithm) and bf16 logits (fp32 math inside)."""
    g = torch.Generator().manual_seed(5)
    full = (4 * torch.randn(24, VOCAB, generator=g, dtype=torch.float64)).to(dtype)
    labels = torch.randint(0, VOCAB, (24,), generator=g)
    labels[[3, 7]] = -100
    weights = torch.rand(24, generator=g, dtype=torch.float64)
    ref_logits = full.detach().double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(ref_logits, labels, reduction="none")
    (ref * weights).sum().backward()
    group, r, n = _tp_mesh().get_group(), dist.get_rank(), VOCAB // TP
    mine = full.detach()[:, r * n : (r + 1) * n].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(mine, labels, group)
    (loss * weights.to(loss.dtype)).sum().backward()
    return {
        "loss": (loss.double() - ref.detach()).abs().max().item(),
        "ignored": loss[[3, 7]].abs().max().item(),
        "grad": (mine.grad.double() - ref_logits.grad[:, r * n : (r + 1) * n]).abs().max().item(),
        "grad_dtype": str(mine.grad.dtype),
    }


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_vocab_parallel_cross_entropy_matches_the_gathered_loss(dist_pool, dtype):
    # fp64: exact up to rounding. bf16 logits: both sides see the same rounded logits, the math is
    # fp32 here (log-sum-exp over 32 of 64 entries per rank, |z| < 20: errors ~1e-5), the reference
    # fp64; the gradient is rounded back to bf16 (relative 2^-8 of entries <= 1).
    tol = {"loss": 1e-12, "grad": 1e-12} if dtype == torch.float64 else {"loss": 1e-4, "grad": 8e-3}
    for r in dist_pool(TP).run(_vocab_parallel_loss, dtype):
        assert r["ignored"] == 0.0
        assert r["grad_dtype"] == str(dtype)
        assert r["loss"] < tol["loss"] and r["grad"] < tol["grad"], r


def _selective_saves_less(cfg_kw: dict) -> dict:
    """Bytes autograd keeps for backward in one tp forward, without and with selective recompute."""
    cfg, tokens = _cfg(**cfg_kw), _batch()[0]
    saved = {}
    for mode in ("none", "selective"):
        m = _build(cfg)
        apply_tensor_parallel(m, _tp_mesh())
        m.set_recompute(mode)
        params = [p.to_local() if isinstance(p, DTensor) else p for p in m.parameters()]
        saved[mode] = saved_activation_bytes(lambda m=m: m(tokens), params)
    return saved


@pytest.mark.parametrize("case", ["block", "block-parallel-gqa", "standard-gqa"])
def test_selective_recompute_with_tp_matches_single_process(dist_pool, case):
    """Selective recompute wraps the sequence-parallel block's sublayers through the same seams as
    the plain block's: fp64 parity with one process (recomputation replays the collectives), and
    the forward keeps fewer bytes for backward than without recompute."""
    results = dist_pool(TP).run(_parity, CASES[case], 2, torch.float64, 3, "selective")
    _check(results, CASES[case], torch.float64)
    for saved in dist_pool(TP).run(_selective_saves_less, CASES[case]):
        assert saved["selective"] < 0.8 * saved["none"], saved
