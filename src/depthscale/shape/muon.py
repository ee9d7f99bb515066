"""Muon's facts that need no torch: which parameters are its matrices, what Newton–Schulz costs,
how its update is scaled, and which rank of a shard group orthogonalises which matrix.

One home for them: the optimizer (`train/muon.py`) and the planner (`plan/states.py`,
`plan/comm.py`) read them here, so the planned states, FLOPs and bytes are the ones the optimizer
has and moves.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

NS_STEPS = 5
MAX_NS_STEPS = 20
"""More Newton–Schulz steps than this buy nothing the quintic has not reached (5 suffice)."""
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""The quintic Newton–Schulz iteration of `torch.optim.Muon` (Keller Jordan's coefficients)."""

ADAMW_NAMES = ("tok_embeddings.weight", "output.weight", "router.weight")
"""Matrices Muon leaves to AdamW: the token embedding and the output head (Moonlight, Kimi K2:
their rows are looked up / read out one token at a time, not a hidden linear map), and the MoE
router (a tiny [experts, dim] map whose rows must stay comparable to each other)."""

NEVER_MUON = ("pseudo_query", "attnres", "key_norm")
"""Name fragments of AttnRes parameters: vectors, and AdamW's whatever their shape."""


def is_muon_matrix(name: str, ndim: int) -> bool:
    """Whether the parameter `name` of `ndim` dimensions is one of Muon's hidden matrices: 2-D
    weights (attention and FFN projections, each its own matrix) and 3-D expert stacks (each expert
    its own matrix) — not the embedding, the head, the router, norms, biases or AttnRes parameters.
    Matched by whole name components, so a wrapper's prefix is allowed."""
    if ndim < 2 or any(fragment in name for fragment in NEVER_MUON):
        return False
    return not any(name == tail or name.endswith("." + tail) for tail in ADAMW_NAMES)


def matrix_dims(shape: Sequence[int]) -> tuple[int, int, int]:
    """(matrices, m, n) of a parameter: its last two dimensions are one matrix, any leading ones
    (an expert stack) count matrices."""
    return math.prod(shape[:-2]), shape[-2], shape[-1]


def update_scale(shape: Sequence[int]) -> float:
    """Moonlight's RMS matching, 0.2·√max(m, n): an orthogonal m×n update has RMS 1/√max(m, n),
    AdamW's is about 0.2, so this scale lets Muon reuse AdamW's learning rate and weight decay."""
    _, m, n = matrix_dims(shape)
    return 0.2 * math.sqrt(max(m, n))


def ns_flops(shape: Sequence[int], steps: int = NS_STEPS) -> int:
    """Multiply-add FLOPs (2 per MAC) of `steps` quintic Newton–Schulz iterations on a parameter of
    `shape`: with s = min(m, n), l = max(m, n) (tall matrices are transposed), each iteration forms
    A = X Xᵀ (2·s²·l), B = bA + cA² (2·s³) and aX + BX (2·s²·l)."""
    k, m, n = matrix_dims(shape)
    s, big = min(m, n), max(m, n)
    return k * steps * (4 * s * s * big + 2 * s**3)


def assign_owners(costs: Sequence[float], ranks: int) -> list[int]:
    """The rank of `ranks` that orthogonalises each matrix, balancing the summed cost: greedy
    longest-processing-time first (largest cost to the least loaded rank; ties to the lower index
    and the lower rank), within 4/3 of the optimum and deterministic, so every rank computes the
    same owners without talking."""
    if ranks < 1:
        raise ValueError(f"assign_owners: ranks={ranks} must be >= 1")
    owners = [0] * len(costs)
    loads = [(0.0, r) for r in range(ranks)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, r = heapq.heappop(loads)
        owners[i] = r
        heapq.heappush(loads, (load + costs[i], r))
    return owners
