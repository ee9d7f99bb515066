"""The layouts Ulysses context parallelism takes (`parallel.cp_ulysses`), torch-free: the config
checks, the planner and the runtime (`ulysses.py`) read these rules from here.

A Ulysses group of u ranks splits each tp rank's heads u ways: the query heads must divide, and
the KV heads either divide too (each member gets KV heads of its own) or are fewer and divide u
(each is repeated for the u / KV members whose query heads read it). u divides cp: the rest of cp
is the ring across the groups."""

from __future__ import annotations


def kv_heads_sent(kv_heads: int, ulysses: int) -> int:
    """KV heads (per tp rank) each rank sends through the exchange: its own, or each repeated so
    that every member of the group gets one (fewer KV heads than members)."""
    return kv_heads if kv_heads % ulysses == 0 else ulysses


def ulysses_problem(n_heads: int, kv_heads: int, tp: int, cp: int, ulysses: int) -> str | None:
    """What is wrong with `ulysses` as cp's Ulysses degree, as one line naming the keys and what
    is allowed; None if nothing (tp not dividing the heads is tensor parallelism's own error)."""
    u = ulysses
    if u == 1:
        return None
    if cp % u:
        return f"parallel.cp_ulysses={u} must divide parallel.cp={cp}; allowed: a divisor of {cp}"
    if n_heads % tp or kv_heads % tp:
        return None
    heads, kv = n_heads // tp, kv_heads // tp
    if heads % u:
        return (
            f"parallel.cp_ulysses={u} must divide the query heads per tp rank (model.n_heads="
            f"{n_heads} / parallel.tp={tp} = {heads}); allowed: a common divisor of {heads} "
            f"and parallel.cp={cp}"
        )
    if kv % u and u % kv:
        return (
            f"parallel.cp_ulysses={u} and the KV heads per tp rank (model.n_kv_heads={kv_heads} "
            f"/ parallel.tp={tp} = {kv}) must divide one another (fewer KV heads are repeated "
            f"over the Ulysses group); allowed: cp_ulysses a multiple or a divisor of {kv}"
        )
    return None


def ulysses_degrees(n_heads: int, kv_heads: int, tp: int, cp: int) -> list[int]:
    """Every Ulysses degree cp may take with these heads, 1 (the ring) first."""
    return [u for u in range(1, cp + 1) if not ulysses_problem(n_heads, kv_heads, tp, cp, u)
            and cp % u == 0]  # fmt: skip
