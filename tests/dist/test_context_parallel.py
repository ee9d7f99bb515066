"""Context parallelism vs one process: ring attention against `sdpa_attention` on the full sequence,
remote K/V gradients, sliding-window skipping, and a full model forward/backward at cp=2.

Every rank builds the same full-sequence inputs from one seed, computes the single-process reference
itself, and runs the ring on its shard; errors come back per rank. fp32 throughout.

Tolerances (tests/tolerances.py): the ring adds the same terms as SDPA in another order (key blocks
and tiles merged by online softmax), so out, dQ, dK, dV differ by at most `fp32_sum_bound` of the
attention's reduction chain (`_attention_terms`), relative to the tensor's magnitude (errors are
divided by max(1, the reference's largest entry): dK/dV grow with sequence and group size). The model
runs compare with `fp32_model_bound`.
"""

import contextlib
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import cached_mesh

from depthscale.config import ModelConfig
from depthscale.model.layers import attention_mask, sdpa_attention
from depthscale.model.transformer import Transformer, cross_entropy
from depthscale.parallel.context_parallel import (
    RingStats,
    apply_context_parallel,
    cp_loss,
    pad_for_cp,
    positions_for,
    ring_attention,
    shard_sequence,
    unshard_sequence,
)
from depthscale.parallel.data_parallel import average_replicated_grads
from depthscale.parallel.mesh import ParallelDims
from tolerances import check, fp32_model_bound, fp32_sum_bound, scaled_err

B, HD = 2, 8


def _attention_terms(T: int, H: int, Hkv: int) -> int:
    """Longest reduction chain of attention forward + backward over T keys: scores (HD), softmax
    sum, P·V and the block/tile merges (T each at most), then D = rowsum(dO·O) and dP (HD each),
    dQ over T keys, and dK/dV over the T queries of each of the H/Hkv heads sharing a K/V head."""
    return 3 * HD + 3 * T + T * (H // Hkv)


def _attention_bound(T: int, H: int, Hkv: int) -> float:
    return fp32_sum_bound(_attention_terms(T, H, Hkv))


def _inputs(T, H, Hkv, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, HD, generator=g)
    k = torch.randn(B, Hkv, T, HD, generator=g)
    v = torch.randn(B, Hkv, T, HD, generator=g)
    dout = torch.randn(B, H, T, HD, generator=g)
    return [t.to(dtype) for t in (q, k, v, dout)]


def _err(mine, ref):
    """Max abs error, relative to the reference's scale when that exceeds 1 (dK/dV sum over the
    queries of a whole head group, so their magnitude grows with sequence and group size)."""
    return ((mine - ref).abs().max() / ref.abs().max().clamp(min=1)).item()


def _reference(q, k, v, dout, window, causal=True):
    """Full-sequence SDPA in fp32: (out, dq, dk, dv)."""
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    pos = torch.arange(q.shape[2])
    if causal:
        out = sdpa_attention(*leaves, pos, pos, window)
    else:
        mask = attention_mask(pos, pos, window, causal=False)
        out = F.scaled_dot_product_attention(*leaves, attn_mask=mask, enable_gqa=True)
    out.backward(dout.float())
    return [out.detach()] + [t.grad for t in leaves]


def _ring(q, k, v, dout, window, mode, stats=None, kv_tile=512, causal=True):
    """Pad to the layout, shard, run the ring; returns this rank's (pos, out, dq, dk, dv)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    T = q.shape[2]
    _, n_chunks = (None, 2 * world) if mode == "zigzag" else (None, world)
    pad = -T % n_chunks
    padded = [torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, k, v, dout)]
    pos = positions_for(T + pad, rank, world, mode)
    local = [shard_sequence(t, rank, world, 2, mode) for t in padded]
    leaves = [t.detach().clone().requires_grad_() for t in local[:3]]
    out = ring_attention(
        *leaves, pos, pos, window, dist.group.WORLD, stats, kv_tile, causal=causal, seq_len=T
    )
    out.backward(local[3])
    return pos, out.detach(), *[t.grad for t in leaves]


def _attention_parity(cases):
    """Max error of out, dq, dk, dv for each (mode, T, window, H, Hkv, kv_tile, causal) case."""
    errors = []
    for mode, T, window, H, Hkv, kv_tile, causal in cases:
        q, k, v, dout = _inputs(T, H, Hkv)
        ref = _reference(q, k, v, dout, window, causal)
        pos, *mine = _ring(q, k, v, dout, window, mode, kv_tile=kv_tile, causal=causal)
        real = pos < T  # padding rows are not part of the reference
        errs = [_err(m[:, :, real], r[:, :, pos[real]]) for m, r in zip(mine, ref)]
        errors.append(errs)
    return errors


# (mode, T, window, H, Hkv, kv_tile, causal): a sample of the grid covering every feature at each cp
CP2_CASES = [
    ("contiguous", 32, 0, 4, 4, 512, True),
    ("zigzag", 32, 0, 4, 2, 512, True),
    ("zigzag", 30, 0, 4, 2, 3, True),  # padded to 32; key tiles of 3 inside each chunk
    ("contiguous", 32, 5, 4, 2, 512, True),
    ("zigzag", 32, 20, 4, 4, 512, True),  # long window: spans several chunks
    ("contiguous", 26, 3, 4, 2, 4, True),  # padded, short window, tiled
    # bidirectional: padding keys must be masked (seq_len), windows look both ways
    ("contiguous", 32, 0, 4, 2, 512, False),
    ("zigzag", 30, 0, 4, 4, 3, False),
    ("contiguous", 26, 5, 4, 2, 4, False),
    ("zigzag", 32, 9, 4, 2, 512, False),
]
CP4_CASES = [
    ("zigzag", 64, 0, 4, 2, 512, True),
    ("contiguous", 64, 0, 4, 4, 5, True),
    ("zigzag", 60, 7, 4, 2, 512, True),  # padded to 64
    ("contiguous", 64, 40, 4, 2, 512, True),  # long window
    ("zigzag", 64, 3, 4, 4, 2, True),
    ("contiguous", 62, 0, 4, 2, 512, True),  # padded
    ("zigzag", 60, 0, 4, 2, 512, False),
    ("contiguous", 64, 0, 4, 4, 5, False),
    ("contiguous", 62, 7, 4, 2, 512, False),
    ("zigzag", 64, 20, 4, 2, 3, False),
]


@pytest.mark.parametrize(("world", "cases"), [(2, CP2_CASES), (4, CP4_CASES)])
def test_ring_attention_matches_sdpa(dist_pool, world, cases):
    for rank_errors in dist_pool(world).run(_attention_parity, cases):
        for case, errs in zip(cases, rank_errors):
            _, T, _, H, Hkv, *_ = case
            check(max(errs), _attention_bound(T, H, Hkv), f"{case} worst of out, dq, dk, dv")


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_attention_matches_sdpa_exhaustive(dist_pool, world):
    cases = list(
        itertools.product(
            ["zigzag", "contiguous"],
            [16 * world, 16 * world - 2, 16 * world - 5],  # even, padded by 2, odd
            [0, 1, 3, 9, 12 * world, 16 * world],
            [4],
            [4, 2, 1],
            [512, 3],
            [True, False],
        )
    )
    for rank_errors in dist_pool(world).run(_attention_parity, cases):
        for case, errs in zip(cases, rank_errors):
            _, T, _, H, Hkv, *_ = case
            check(max(errs), _attention_bound(T, H, Hkv), f"{case} worst of out, dq, dk, dv")


def _bf16_error(mode, window):
    """bf16 ring vs the fp32 reference on the same (bf16-rounded) inputs."""
    q, k, v, dout = _inputs(16 * dist.get_world_size(), 4, 2, seed=4, dtype=torch.bfloat16)
    ref = _reference(q, k, v, dout, window)
    pos, *mine = _ring(q, k, v, dout, window, mode)
    assert all(t.dtype == torch.bfloat16 for t in mine)
    return [_err(m.float(), r[:, :, pos]) for m, r in zip(mine, ref)]


def test_bf16_error_stays_at_one_rounding(dist_pool):
    # merges and dK/dV accumulate in fp32, so only the final cast to bf16 rounds (2^-8 relative)
    for errs in dist_pool(4).run(_bf16_error, "zigzag", 0):
        assert max(errs) < 1e-2, errs


def _remote_kv_gradients(mode):
    """Only the last shard's queries get an output gradient, so every other rank's dK/dV comes
    entirely from remote queries (a ring that reused stale or local K/V would get these wrong)."""
    world = dist.get_world_size()
    T = 16 * world
    q, k, v, dout = _inputs(T, 4, 2, seed=1)
    owner_of_last = world - 1 if mode == "contiguous" else 0  # who holds the final chunk
    last = positions_for(T, owner_of_last, world, mode)
    dout_masked = torch.zeros_like(dout)
    dout_masked[:, :, last] = dout[:, :, last]
    ref = _reference(q, k, v, dout_masked, 0)
    pos, _, dq, dk, dv = _ring(q, k, v, dout_masked, 0, mode)
    err = max(_err(m, r[:, :, pos]) for m, r in zip((dq, dk, dv), ref[1:]))
    return err, dk.abs().max().item(), dv.abs().max().item(), dq.abs().max().item()


@pytest.mark.parametrize("mode", ["contiguous", "zigzag"])
def test_gradients_reach_remote_kv(dist_pool, mode):
    results = dist_pool(4).run(_remote_kv_gradients, mode)
    for rank, (err, dk, dv, _) in enumerate(results):
        check(err, _attention_bound(16 * 4, 4, 2), f"rank {rank} worst of dq, dk, dv")
        assert dk > 1e-3 and dv > 1e-3, (rank, dk, dv)  # every rank's keys are seen remotely
    if mode == "contiguous":  # queries without an output gradient get none
        assert all(r[3] == 0 for r in results[:-1])


def _window_stats(mode, T, window):
    stats = RingStats()
    q, k, v, dout = _inputs(T, 4, 2, seed=2)
    ref = _reference(q, k, v, dout, window)
    pos, *mine = _ring(q, k, v, dout, window, mode, stats)
    err = max(_err(m, r[:, :, pos]) for m, r in zip(mine, ref))
    return err, stats.blocks_computed, stats.blocks_skipped, stats.bytes_sent, stats.messages


def test_sliding_window_skips_blocks_and_bytes(dist_pool):
    pool = dist_pool(4)
    T, w, world = 64, 4, 4
    bound = _attention_bound(T, 4, 2)
    # contiguous, window < chunk: only the previous rank's last w-1 keys are needed — one hop
    kv_bytes = 2 * B * 2 * (w - 1) * HD * 4  # (k, v) × batch × kv heads × keys × hd × fp32
    for rank, (err, computed, skipped, sent, msgs) in enumerate(
        pool.run(_window_stats, "contiguous", T, w)
    ):
        check(err, bound, "windowed, worst of out, dq, dk, dv")
        # forward + backward: the own block, plus the previous rank's (rank 0 has none)
        assert computed == (2 if rank == 0 else 4) and computed + skipped == 2 * world
        # fwd: halo to next (the last rank's block is needed by nobody); bwd: halo again, and the
        # fp32 dK/dV of the halo back to its owner
        to_next = 2 * kv_bytes if rank < world - 1 else 0
        home = kv_bytes if rank > 0 else 0
        assert sent == to_next + home, (rank, sent)
        assert msgs == (2 if rank < world - 1 else 0) + (rank > 0)
    causal = pool.run(_window_stats, "contiguous", T, 0)
    for rank, (err, computed, *_) in enumerate(causal):
        check(err, bound, "causal, worst of out, dq, dk, dv")
        assert computed == 2 * (rank + 1)  # causal contiguous: rank r needs blocks 0..r only
    # zigzag + window: a neighbour's tail is cp-1 hops away, so the ring keeps turning, but it
    # carries only the tails and computes only the neighbouring chunks
    zig_causal = pool.run(_window_stats, "zigzag", T, 0)
    zig_window = pool.run(_window_stats, "zigzag", T, w)
    for r in zig_causal + zig_window:
        check(r[0], bound, "zigzag, worst of out, dq, dk, dv")
    assert sum(r[3] for r in zig_window) < sum(r[3] for r in zig_causal) / 3
    assert [r[1] for r in zig_causal] == [2 * world] * world  # balanced: every block has work
    assert [r[1] for r in zig_window] == [4, 6, 6, 4]


def _cfg(residual, window, chunk):
    return ModelConfig(
        vocab_size=64,
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=32,
        tie_embeddings=False,
        residual=residual,
        attnres_block_size=2,
        sliding_window=window,
        ffn_chunk_size=chunk,
    )


def _model_parity(residual, window, chunk, mode, T, declared):
    rank, world = dist.get_rank(), dist.get_world_size()
    cp_mesh = cached_mesh(ParallelDims(cp=world))["cp"]
    cfg = _cfg(residual, window, chunk)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 64, (B, T), generator=g)
    labels = torch.randint(0, 64, (B, T), generator=g)
    labels[0, :5] = -100  # uneven real-token counts across ranks
    torch.manual_seed(0)
    ref = Transformer(cfg)
    ref_loss = cross_entropy(ref(tokens), labels)
    ref_loss.backward()

    torch.manual_seed(0)
    model = Transformer(cfg)
    stats = RingStats()
    apply_context_parallel(model, cp_mesh, stats, layout=mode if declared else None)
    tokens, labels = pad_for_cp(tokens, labels, world, mode, pad_id=0)
    tok, lab = (shard_sequence(t, rank, world, 1, mode) for t in (tokens, labels))
    pos = positions_for(tokens.shape[1], rank, world, mode)
    with _counting_all_gathers() as gathers:
        logits = model(tok, positions=pos)
    loss, global_loss = cp_loss(logits, lab, cp_mesh.get_group())
    loss.backward()
    average_replicated_grads(list(model.parameters()), cp_mesh.get_group())
    wrong_positions_refused = None
    if declared:  # positions of another layout are refused, not silently attended with
        try:
            model(tok, positions=pos.flip(0))
            wrong_positions_refused = False
        except ValueError as e:
            wrong_positions_refused = "positions_for" in str(e)
    full_logits = [torch.empty_like(logits) for _ in range(world)]
    dist.all_gather(full_logits, logits.detach().contiguous())
    logits_err = scaled_err(unshard_sequence(full_logits, 1, mode)[:, :T], ref(tokens[:, :T]))
    ref_grads = dict(ref.named_parameters())
    grad_err = max(
        scaled_err(p.grad, ref_grads[n].grad)
        for n, p in model.named_parameters()
        if p.grad is not None
    )
    missing = [
        n for n, p in model.named_parameters() if (p.grad is None) != (ref_grads[n].grad is None)
    ]
    return (
        abs(global_loss.item() - ref_loss.item()) / ref_loss.item(),
        logits_err,
        grad_err,
        missing,
        stats.calls,
        gathers[0],
        wrong_positions_refused,
    )


@contextlib.contextmanager
def _counting_all_gathers():
    count, original = [0], dist.all_gather

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    dist.all_gather = counted
    try:
        yield count
    finally:
        dist.all_gather = original


@pytest.mark.parametrize(
    ("residual", "window", "chunk", "mode", "T", "declared"),
    [
        ("block", 0, 0, "zigzag", 30, False),  # padded to 32
        ("standard", 6, 4, "contiguous", 32, False),  # sliding window + blockwise FFN
        ("block", 0, 0, "zigzag", 30, True),
        ("standard", 6, 4, "contiguous", 32, True),
    ],
)
def test_model_forward_backward_matches_single_process(
    dist_pool, residual, window, chunk, mode, T, declared
):
    """Ring attention in every layer of a model at cp=2 against one process. With the sharding
    declared (`apply_context_parallel(layout=...)`, as the trainer does) the layers share one plan
    derived without communication: no all-gather of positions; without it, one per layer call."""
    bound = fp32_model_bound(_cfg(residual, window, chunk), T, B)  # errors: relative
    for loss_err, logits_err, grad_err, missing, calls, gathers, refused in dist_pool(2).run(
        _model_parity, residual, window, chunk, mode, T, declared
    ):
        assert not missing
        assert calls == 2  # both layers went through the ring
        assert gathers == (0 if declared else 2)
        assert refused is (True if declared else None)
        check(loss_err, bound, "loss")
        check(logits_err, bound, "logits")
        check(grad_err, bound, "worst gradient")


def test_sharding_round_trips_and_balances():
    x = torch.arange(40).view(1, 40)
    for mode in ("zigzag", "contiguous"):
        shards = [shard_sequence(x, r, 4, 1, mode) for r in range(4)]
        assert torch.equal(unshard_sequence(shards, 1, mode), x)
        assert all(torch.equal(positions_for(40, r, 4, mode), shards[r][0]) for r in range(4))
    zig = [positions_for(40, r, 4, "zigzag") for r in range(4)]
    assert zig[0].tolist() == [0, 1, 2, 3, 4, 35, 36, 37, 38, 39]
    # causal work (keys each query sees) is equal across zigzag ranks
    assert len({int((p + 1).sum()) for p in zig}) == 1
    tokens, labels = pad_for_cp(torch.ones(2, 13, dtype=torch.long), torch.ones(2, 13), 2, pad_id=7)
    assert (
        tokens.shape == (2, 16) and (tokens[:, 13:] == 7).all() and (labels[:, 13:] == -100).all()
    )
    with pytest.raises(ValueError, match="pad_for_cp"):
        shard_sequence(torch.zeros(1, 13), 0, 2)
