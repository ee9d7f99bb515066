"""Ulysses and hybrid (Ulysses × ring) context parallelism (`parallel/ulysses.py`) against one
process: attention alone (out, dQ, dK, dV against full-sequence `sdpa_attention`), with causal
rows, sliding windows, GQA with fewer KV heads than the Ulysses degree and packed documents, at
cp_ulysses = cp = 2 and 4 and cp = 4 as 2 × 2; the groups the mesh splits cp into.

The whole model through the trainer's plan (with pp, tp, dp_shard) is in test_composed.py, packed
documents in test_document_mask_layouts.py, the bytes in test_plan_comm.py.

Tolerances (tests/tolerances.py): the same sums as one process in another order (a ring's merges;
Ulysses' attention is the full-row kernel on a head shard, its repeated KV heads' gradients summed
once more), bounded as the ring's: `fp32_sum_bound` of attention's reduction chain.
"""

import pytest
import torch
import torch.distributed as dist
from harness import cached_mesh

from depthscale.model.documents import Documents
from depthscale.model.layers import sdpa_attention
from depthscale.parallel.mesh import ParallelDims, cp_groups
from depthscale.parallel.sequence_layout import positions_for, shard_sequence
from depthscale.parallel.ulysses import UlyssesAttention
from tolerances import check, fp32_sum_bound

B, HD, EOS = 2, 8, 1


def _attention_bound(T: int, H: int, Hkv: int) -> float:
    """Scores (HD), softmax sum, P·V and merges (T each), D and dP (HD each), dQ over T keys, dK/dV
    over the T queries of each of the H/Hkv heads sharing a KV head (test_context_parallel)."""
    return fp32_sum_bound(3 * HD + 3 * T + T * (H // Hkv))


def _documents(T: int) -> Documents:
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(2, 64, (B, T), generator=g)
    tokens[torch.rand(B, T, generator=g) < 0.15] = EOS
    return Documents.of(tokens, EOS)


def _parity(cases):
    """Per (ulysses, T, window, H, Hkv, documents) case: this rank's worst error of out, dq, dk,
    dv, and the sizes of its Ulysses and ring groups."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    mesh = cached_mesh(ParallelDims(cp=cp))
    results = []
    for u, T, window, H, Hkv, packed in cases:
        g = torch.Generator().manual_seed(T + window + H + Hkv)
        q, dout = (torch.randn(B, H, T, HD, generator=g) for _ in range(2))
        k, v = (torch.randn(B, Hkv, T, HD, generator=g) for _ in range(2))
        docs = _documents(T) if packed else None
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = sdpa_attention(*leaves, None, None, window, docs)
        ref.backward(dout)
        refs = [ref.detach()] + [t.grad for t in leaves]

        group, ring = cp_groups(mesh, u)
        fn = UlyssesAttention(group, ring, rank, cp)
        pos = positions_for(T, rank, cp, "zigzag")
        mine = [shard_sequence(t, rank, cp, 2, "zigzag").requires_grad_() for t in (q, k, v)]
        out = fn(*mine, pos, pos, window, docs)
        out.backward(shard_sequence(dout, rank, cp, 2, "zigzag"))
        got = [out.detach()] + [t.grad for t in mine]
        err = max(
            ((a - r[:, :, pos]).abs().max() / r.abs().max().clamp(min=1)).item()
            for a, r in zip(got, refs)
        )
        sizes = (dist.get_world_size(group), dist.get_world_size(ring) if ring else 1)
        results.append((err, sizes))
    return results


# (ulysses, T, window, H, Hkv, packed documents)
CP2 = [
    (2, 32, 0, 4, 1, False),  # one KV head, repeated for both members
    (2, 32, 5, 4, 2, True),
]
CP4 = [
    (4, 64, 0, 4, 2, False),  # pure Ulysses, KV heads repeated
    (4, 64, 7, 4, 1, True),  # window, documents, one KV head for four members
    (4, 64, 0, 8, 4, False),
    (2, 64, 0, 4, 2, False),  # hybrid 2 × 2
    (2, 64, 9, 4, 1, True),  # hybrid, window, documents, KV head repeated
]


@pytest.mark.parametrize(("world", "cases"), [(2, CP2), (4, CP4)])
def test_ulysses_and_hybrid_attention_match_sdpa(dist_pool, world, cases):
    for rank_results in dist_pool(world).run(_parity, cases):
        for (u, T, _, H, Hkv, _), (err, sizes) in zip(cases, rank_results):
            check(err, _attention_bound(T, H, Hkv), f"cp={world} ulysses={u} T={T} H={H}/{Hkv}")
            assert sizes == (u, world // u)
