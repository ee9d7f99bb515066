"""What an MoE layer adds to a layout's step time (`model/moe.py`, `parallel/expert_parallel.py`).

- **Its FFN's GEMMs.** The router scores the rank's tokens in fp32 (autocast is off there); the
  routed experts are one grouped GEMM whose groups are the rows each expert received — with
  fine-grained experts a group is small, and the efficiency follows its smallest dimension, as
  every GEMM's does here; the shared experts are a dense SwiGLU, tensor-parallel like one.
- **Expert parallelism's exchanges.** Per MoE layer and micro-batch each rank sends its routed
  rows (tokens·k, when routing is balanced) to the ranks holding their experts and takes the
  outputs back, after a small all-to-all of row counts; backward runs both exchanges again, and a
  recompute re-runs the forward's. They block: the experts need their rows and the combine needs
  the outputs, so all of it shows.
- **The experts' FSDP traffic** over the ranks holding the same experts ((dp_shard / ep) × cp): the
  estimate's `_fsdp` gathers and scatters them with the layers; where there are no such ranks,
  their gradient mean over the replicas, once per step (fp32).

Bytes are `plan/comm.py`'s (`moe_payload`), which `tests/dist/test_plan_comm.py` counts on gloo.
"""

from __future__ import annotations

from depthscale.plan.hardware import Cluster
from depthscale.plan.layout import Layout
from depthscale.shape import ModelShape

COUNT_BYTES = 8
"""One int64 row count per expert, exchanged before the rows."""


def ffn_gemm_seconds(s: ModelShape, c: Cluster, lay: Layout, tokens: int, dtype: str) -> float:
    """Forward seconds of one MoE FFN's GEMMs for a micro-batch of `tokens` (this cp rank's)."""
    d, f, shared = s.dim, s.moe_ffn, s.moe_shared * s.moe_ffn
    routed = tokens / lay.tp  # each tp rank routes its own shard of the sequence
    rows = routed * s.moe_top_k  # what this rank's experts compute, routing balanced
    per_expert = rows * lay.ep / s.n_experts  # an ep group's rows over all experts
    router = 2 * routed * s.n_experts * d  # FLOPs, in fp32
    seconds = router / c.gemm_flops("float32", min(routed, s.n_experts, d))
    seconds += 2 * rows * 3 * d * f / c.gemm_flops(dtype, min(per_expert, f, d))  # gate, up; down
    if shared:  # sequence-parallel like a dense FFN: every token, the tp rank's share of it
        width = shared / lay.tp
        seconds += 2 * tokens * 3 * d * width / c.gemm_flops(dtype, min(tokens, width, d))
    return seconds


def _ep_inter(c: Cluster, lay: Layout) -> bool:
    """Whether an ep group spans nodes: its ranks are consecutive in dp_shard, tp·cp apart."""
    return lay.tp * lay.cp * lay.ep > c.gpus_per_node


def all_to_all_seconds(
    s: ModelShape, c: Cluster, lay: Layout, tokens: int, e: int
) -> tuple[float, float]:
    """(forward, backward) seconds of one MoE layer's exchanges for one micro-batch; a recompute
    adds the forward's again (counted by the caller)."""
    if lay.ep == 1:
        return 0.0, 0.0
    rows = tokens / lay.tp * s.moe_top_k * s.dim * e
    inter = _ep_inter(c, lay)
    counts = c.op_time("all_to_all", s.n_experts * COUNT_BYTES, lay.ep, inter)
    one_way = c.op_time("all_to_all", rows, lay.ep, inter)
    return counts + 2 * one_way, 2 * one_way


def all_to_all_bytes(s: ModelShape, lay: Layout, tokens: int, e: int, passes: int) -> float:
    """Bytes one rank hands to all-to-alls in a step, `passes` = its MoE layers × micro-batches
    (`plan.comm.moe_payload`'s, in closed form)."""
    if lay.ep == 1:
        return 0.0
    rows = tokens / lay.tp * s.moe_top_k * s.dim * e
    forwards = 2 if lay.recompute != "none" else 1
    return passes * (forwards * (s.n_experts * COUNT_BYTES + 2 * rows) + 2 * rows)


def expert_reduce(c: Cluster, lay: Layout, experts: float) -> tuple[float, float]:
    """(bytes on the wire, seconds) of the experts' fp32 gradient mean over the replicas, where
    FSDP has no expert shard group to reduce them in (dp_shard = ep, no cp)."""
    n = lay.dp_replicate
    if lay.ep == 1 or lay.expert_shard > 1 or n == 1 or not experts:
        return 0.0, 0.0
    payload = experts * 4
    return 2 * (n - 1) / n * payload, c.op_time("all_reduce", payload, n, True)
