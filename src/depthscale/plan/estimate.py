"""One layout's prediction: memory per rank, bytes per dimension, step time, MFU.

The time of one micro-batch through one model chunk is built bottom-up — GEMMs at the cluster's
shape-dependent efficiency, attention, memory-bound passes at HBM speed, tensor- and
context-parallel traffic exposed or hidden as the framework overlaps it — and the pipeline is the
simulated schedule over those times (`plan.pipeline`). Data-parallel traffic and the optimizer
step close the step. Every constant is the cluster's or the framework's (`plan.hardware`,
`plan.frameworks`), none is fitted to a layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from depthscale.plan import activations, experts
from depthscale.plan.frameworks import Framework
from depthscale.plan.hardware import Cluster
from depthscale.plan.kernels import UnfusedAttention
from depthscale.plan.layout import Layout
from depthscale.plan.memory import RankParams, memory, rank_params
from depthscale.plan.muon_states import MuonPlan
from depthscale.plan.pipeline import chunk_layers, closed_form, hop_tensors, pipeline_time
from depthscale.shape import ModelShape
from depthscale.shape.model import ELEMENTWISE_PASSES

DDP_BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class Workload:
    spec: ModelShape
    seq: int
    batch: int
    """Global batch in sequences."""
    dtype: str = "bfloat16"
    qk_clip: bool = False
    """optim.qk_clip_tau > 0: the trainer refuses context parallelism with it (`check`)."""


@dataclass
class Estimate:
    layout: Layout
    ok: bool = True
    reason: str = ""
    memory: dict[str, float] = field(default_factory=dict)
    """Bytes on the fullest rank: weights, grads, optimizer, activations, pipeline, transient."""
    comm: dict[str, float] = field(default_factory=dict)
    """Bytes each rank sends per step, per dimension."""
    times: dict[str, float] = field(default_factory=dict)
    step_s: float = math.inf
    mfu: float = 0.0
    hfu: float = 0.0
    tokens_per_s: float = 0.0
    bubble: float = 0.0
    peak_in_flight: tuple[int, ...] = ()
    microbatches: int = 0

    @property
    def peak_bytes(self) -> float:
        return sum(self.memory.values())

    def days(self, tokens: float) -> float:
        return tokens / self.tokens_per_s / 86400 if self.tokens_per_s else math.inf

    def to_json(self) -> dict:
        return {
            "layout": self.layout.to_json(),
            "label": self.layout.label(),
            "ok": self.ok,
            "reason": self.reason,
            "memory_gib": {k: v / 2**30 for k, v in self.memory.items()},
            "peak_gib": self.peak_bytes / 2**30,
            "comm_gb": {k: v / 1e9 for k, v in self.comm.items()},
            "times_s": self.times,
            "step_s": self.step_s,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "tokens_per_s": self.tokens_per_s,
            "bubble": self.bubble,
            "microbatches": self.microbatches,
            "peak_in_flight": list(self.peak_in_flight),
        }


def check(w: Workload, c: Cluster, lay: Layout, fw: Framework, gpus: int) -> str:
    """The first constraint the layout breaks, in words; '' if none (memory is checked later)."""
    s = w.spec
    if lay.world != gpus:
        return f"uses {lay.world} GPUs, not {gpus}"
    if lay.tp > c.gpus_per_node:
        return f"tp {lay.tp} > {c.gpus_per_node} GPUs per node"
    if s.n_heads % lay.tp or s.kv_heads % lay.tp:
        return f"tp {lay.tp} does not divide {s.n_heads} heads / {s.kv_heads} kv heads"
    chunks = lay.pp * lay.v
    if lay.ends and chunks < 3:
        return f"ends={lay.ends} needs pp×v >= 3 (a middle stage to take the layers)"
    if (s.n_layers + 2 * lay.ends) % chunks:
        given = f"{s.n_layers} layers" + (f" + 2·{lay.ends} (ends)" if lay.ends else "")
        return f"pp×v = {chunks} does not divide {given}"
    if lay.ends > (s.n_layers + 2 * lay.ends) // chunks:
        return f"ends={lay.ends}: the end stages have fewer layers than that to give up"
    if w.seq % lay.degrees.seq_multiple:
        return f"2·cp = {2 * lay.cp} does not divide seq {w.seq} (zigzag halves)"
    if w.qk_clip and lay.cp > 1:
        return "QK-clip (optim.qk_clip_tau) needs cp = 1, as the trainer does"
    if (w.seq // lay.cp) % lay.tp:
        return f"tp {lay.tp} does not divide the local sequence {w.seq // lay.cp}"
    if w.batch % (lay.dp * lay.micro_batch):
        return f"batch {w.batch} not divisible by dp×mb = {lay.dp * lay.micro_batch}"
    m = w.batch // (lay.dp * lay.micro_batch)
    if lay.pp > 1 and m < lay.pp:
        return f"{m} micro-batches < pp {lay.pp}"
    if lay.v > 1 and (lay.pp == 1 or m % lay.pp):
        return f"interleaving needs pp > 1 and micro-batches ({m}) divisible by pp {lay.pp}"
    if fw.ours and lay.zero1:
        return "zero1 is Megatron's distributed optimizer; depthscale shards with dp_shard"
    if not fw.ours and (lay.dp_shard > 1 or lay.offload):
        return f"{fw.name} has no FSDP (use dp and zero1)"
    if lay.offload and (lay.shard == 1 or lay.tp > 1 or lay.pp > 1):
        return "offload needs dp_shard×cp > 1 and tp = pp = 1"
    if lay.zero3 and not (fw.ours and lay.pp > 1 and lay.shard > 1):
        return "zero3 re-gathers per micro-batch under pipelines: it needs pp > 1 and FSDP"
    if lay.recompute == "sublayer" and not fw.ours:
        return f"{fw.name} has no sublayer recompute"
    return lay.degrees.expert_rule(s.n_experts)


def estimate(
    w: Workload,
    c: Cluster,
    lay: Layout,
    fw: Framework,
    gpus: int,
    simulate: bool = True,
    muon: MuonPlan | None = None,
) -> Estimate:
    """Predict one layout. `simulate=False` takes the pipeline's closed form (the search's first
    pass) instead of simulating its schedule. `muon` (plan.muon_states.muon_plan): the optimizer
    is Muon; its states replace the moments, and its Newton–Schulz time (the fullest rank's
    FLOPs at the cluster's bf16 GEMM rate) adds to the step, not overlapped: it runs between
    the gradient reduction and the parameter update."""
    est = Estimate(lay)
    reason = check(w, c, lay, fw, gpus)
    if reason:
        est.ok, est.reason = False, reason
        return est
    s = w.spec
    m = w.batch // (lay.dp * lay.micro_batch)
    est.microbatches = m
    e = 2 if w.dtype == "bfloat16" else 4
    tokens = lay.micro_batch * w.seq // lay.cp  # per micro-batch on one cp rank
    st = _stage_costs(w, c, lay, fw, tokens, e)
    makespan, hop_bytes = _makespan(est, w, c, lay, fw, st, m, tokens, e, simulate)
    dp_bytes, exposed_dp = _exposed_dp(c, lay, fw, st, m)
    optimizer = _optimizer_seconds(c, lay, fw, st.params)

    est.step_s = makespan + exposed_dp + optimizer
    if muon is not None:
        est.times["muon_ns_s"] = muon.ns_flops / (c.peak("bfloat16") * c.gemm_efficiency)
        est.times["muon_all_to_all_s"] = _muon_redistribution_s(c, lay, muon)
        est.step_s += est.times["muon_ns_s"] + est.times["muon_all_to_all_s"]
    est.times = {
        **est.times,
        "pipeline_s": makespan,
        "dp_exposed_s": exposed_dp,
        "optimizer_s": optimizer,
        "layer_forward_s": st.layer_f,
        "layer_backward_s": st.layer_b,
        "tp_exposed_per_layer_s": st.tp_exposed,
    }
    rank_layers = st.params.layers  # the first rank's
    est.comm = {
        "tp": _tp_bytes(s, lay, fw, tokens, e) * rank_layers * m,
        "cp": _cp_bytes(w, lay, e) * rank_layers * m,
        "pp": 2 * sum(hop_bytes) / max(lay.pp, 1) * m if lay.pp > 1 else 0.0,
        "dp": dp_bytes,
    }
    if muon is not None:  # the redistribution's all-to-alls (plan.comm.muon_payload)
        est.comm["muon"] = muon.sent_bytes
    if s.moe:  # expert parallelism's all-to-alls, rows out and back (balanced routing)
        est.comm["ep"] = experts.all_to_all_bytes(s, lay, tokens, e, m * st.params.moe_layers)
    peak = c.peak(w.dtype)
    est.mfu = s.model_flops(w.seq) * w.batch / (est.step_s * gpus * peak)
    est.hfu = s.hardware_flops(w.seq, lay.recompute) * w.batch / (est.step_s * gpus * peak)
    est.tokens_per_s = w.batch * w.seq / est.step_s

    est.memory = memory(s, w.seq, lay, fw, est.peak_in_flight, m, st.params, tokens, e)
    if muon is not None and est.memory["optimizer"]:  # offloaded states count on the host
        est.memory["optimizer"] = muon.optimizer_bytes
    if est.peak_bytes > c.usable_bytes():
        est.ok = False
        est.reason = f"OOM by {(est.peak_bytes - c.usable_bytes()) / 2**30:.1f} GiB"
    return est


@dataclass(frozen=True)
class _StageCosts:
    """One micro-batch's times on the busiest rank: per layer, and per pipeline chunk."""

    layer_f: float
    layer_b: float
    tp_exposed: float
    """Tensor-parallel time per layer that compute does not hide (forward + backward)."""
    f_stage: list[float]
    b_stage: list[float]
    fsdp: _Fsdp
    params: RankParams


def _stage_costs(
    w: Workload, c: Cluster, lay: Layout, fw: Framework, tokens: int, e: int
) -> _StageCosts:
    """Compute per micro-batch per layer (an MoE model: the mean over its layer kinds), with the
    tensor-, context- and FSDP traffic it exposes, summed into each chunk's stage time."""
    s = w.spec
    f_layer, b_layer, rc_layer, gemm_layer = _layer_times(w, c, lay, fw, tokens, e)
    if s.moe:
        share = len(s.moe_layers) / s.n_layers
        moe = _layer_times(w, c, lay, fw, tokens, e, moe=True)
        a2a_f, a2a_b = experts.all_to_all_seconds(s, c, lay, tokens, e)
        a2a_rc = a2a_f if lay.recompute != "none" else 0.0
        moe = (moe[0] + a2a_f, moe[1] + a2a_b, moe[2] + a2a_rc, moe[3])
        f_layer, b_layer, rc_layer, gemm_layer = (
            (1 - share) * dense + share * sparse
            for dense, sparse in zip((f_layer, b_layer, rc_layer, gemm_layer), moe)
        )
    params = rank_params(s, lay)
    tp_f, tp_b = _tp_comm(s, c, lay, fw, tokens, e, gemm_layer)
    cp_f, cp_b = _cp_comm(w, c, lay, fw, e, f_layer)
    fsdp = _fsdp(s, c, lay, fw, e, params)
    layer_f = f_layer + tp_f + cp_f
    layer_b = b_layer + rc_layer + tp_b + cp_b
    # FSDP prefetches the next layer's gather behind this layer's compute: what does not fit shows
    # (without overlap, all of it)
    layer_f += max(0.0, fsdp.layer_f_s - layer_f) if fw.dp_overlap else fsdp.layer_f_s
    layer_b += max(0.0, fsdp.layer_b_s - layer_b) if fw.dp_overlap else fsdp.layer_b_s
    head_f, head_b = _head_times(w, c, lay, tokens)
    # stages at the pace of the busiest rank, the last: its chunk's layers and, once per
    # micro-batch, the head and the loss; per micro-batch also the gathers nothing hides (the
    # root's and the first layer's)
    sizes = [len(r) for r in chunk_layers(s, lay)]  # layers per chunk (lighter ends: fewer)
    f_stage = [n * layer_f + head_f / lay.v + fsdp.root_s + fsdp.layer_f_s for n in sizes]
    b_stage = [n * layer_b + head_b / lay.v + fsdp.layer_b_s for n in sizes]
    return _StageCosts(layer_f, layer_b, tp_f + tp_b, f_stage, b_stage, fsdp, params)


def _makespan(
    est: Estimate,
    w: Workload,
    c: Cluster,
    lay: Layout,
    fw: Framework,
    st: _StageCosts,
    m: int,
    tokens: int,
    e: int,
    simulate: bool,
) -> tuple[float, list[float]]:
    """(seconds of the step's forwards and backwards, bytes of each pipeline hop), recording the
    bubble and the peak micro-batches in flight on `est`."""
    s = w.spec
    hops = hop_tensors(s, lay)
    hop_bytes = [h * tokens * s.dim * e / lay.tp for h in hops]  # sequence-parallel: 1/tp each
    if lay.pp == 1:
        est.peak_in_flight = (1,)
        head_f, head_b = _head_times(w, c, lay, tokens)
        return m * (s.n_layers * (st.layer_f + st.layer_b) + head_f + head_b), hop_bytes
    pp_inter = lay.tp * lay.cp * lay.dp * lay.pp > c.gpus_per_node
    hop_time = [c.op_time("p2p", b, lay.pp, pp_inter) for b in hop_bytes]
    hop = sum(hop_time) / len(hop_time) if hop_time else 0.0
    # without overlap: a blocking send and receive around every chunk's compute
    blocking, lat1 = (0.0, hop) if fw.pp_overlap else (2 * hop, 0.0)
    fs = [f + blocking for f in st.f_stage]
    bs = [b + blocking for b in st.b_stage]
    if simulate:
        pipe = pipeline_time(lay.pp, lay.v, m, fs, bs, lat1)
    else:
        pipe = closed_form(lay.pp, lay.v, m, max(fs), max(bs), lat1)
    est.bubble, est.peak_in_flight = pipe.bubble, pipe.peak_in_flight
    return pipe.makespan, hop_bytes


def _exposed_dp(
    c: Cluster, lay: Layout, fw: Framework, st: _StageCosts, m: int
) -> tuple[float, float]:
    """(bytes, exposed seconds) of the data-parallel reductions, the expert reduction and FSDP's
    gathers: what the last micro-batch's backward does not hide."""
    dp_bytes, dp_time = _dp_comm(c, lay, fw, st.params)
    window = sum(st.b_stage[0 :: lay.pp])  # the last micro-batch's backward on this rank
    exposed_dp = max(dp_time / 8, dp_time - window) if fw.dp_overlap else dp_time
    expert_bytes, expert_s = experts.expert_reduce(c, lay, st.params.experts)
    dp_bytes += expert_bytes
    exposed_dp += expert_s  # after the step's backward, before the optimizer
    fsdp, rank_layers = st.fsdp, st.params.layers
    dp_bytes += m * (rank_layers * (fsdp.layer_f + fsdp.layer_b) + fsdp.root)
    # a pipeline stage gathers its units once per step, prefetched one unit ahead through the
    # first micro-batch's forward: the first unit's gather shows, and what outruns the compute
    dp_bytes += fsdp.step
    if fw.dp_overlap:
        exposed_dp += max(fsdp.first_s, fsdp.step_s - rank_layers * st.layer_f)
    else:
        exposed_dp += fsdp.step_s
    return dp_bytes, exposed_dp


def _muon_redistribution_s(c: Cluster, lay: Layout, muon: MuonPlan) -> float:
    """Muon's two all-to-alls over the group that splits its matrices (dp_shard × cp × tp):
    gradient shards to their owners, orthogonalised updates back. `sent_bytes` is what leaves
    the rank in both; an all-to-all's payload in `op_time` includes the rank's own share. Not
    overlapped: it runs between the gradient reduction and the update, as Newton–Schulz does."""
    n = lay.shard * lay.tp
    if n <= 1 or not muon.sent_bytes:
        return 0.0
    inter = lay.tp * lay.cp * lay.dp_shard > c.gpus_per_node
    return c.op_time("all_to_all", muon.sent_bytes * n / (n - 1), n, inter, calls=2)


def _optimizer_seconds(c: Cluster, lay: Layout, fw: Framework, params: RankParams) -> float:
    """The update's memory-bound pass over weights, grads, master weights and moments (read and
    written), at HBM speed, or the host's when the states are offloaded."""
    opt_bytes = fw.weight_bytes + fw.grad_bytes + fw.master_bytes + fw.moment_bytes
    opt_bytes *= params.states(lay) if fw.ours else params.total / (lay.dp if lay.zero1 else 1)
    if lay.offload:
        return 2 * opt_bytes / c.host_bw
    return 2 * opt_bytes / (c.hbm_bw * c.memory_efficiency)


# ---------------------------------------------------------------------------------------------
# time pieces


def _gemms(s: ModelShape, tokens: int, tp: int) -> list[tuple[float, float, float]]:
    d, f, kv = s.dim, s.ffn_dim, s.kv_dim
    if s.family == "gpt":
        return [(tokens, 3 * d / tp, d), (tokens, d, d / tp), (tokens, 4 * d / tp, d),
                (tokens, d, 4 * d / tp)]  # fmt: skip
    return [(tokens, (d + 2 * kv) / tp, d), (tokens, d, d / tp), (tokens, 2 * f / tp, d),
            (tokens, d, f / tp)]  # fmt: skip


def _layer_times(
    w: Workload, c: Cluster, lay: Layout, fw: Framework, tokens: int, e: int, moe: bool = False
) -> tuple[float, float, float, float]:
    """(forward, backward, recompute, GEMM forward) seconds of one layer (`moe`: an MoE layer,
    its exchanges left to the caller) and one micro-batch."""
    s = w.spec
    gemms = _gemms(s, tokens, lay.tp)
    if moe:
        gemms = gemms[:2]  # the attention's; the FFN's are the MoE layer's
    gemm = sum(2 * m_ * n * k / c.gemm_flops(w.dtype, min(m_, n, k)) for m_, n, k in gemms)
    if moe:
        gemm += experts.ffn_gemm_seconds(s, c, lay, tokens, w.dtype)
    seq_local = w.seq // lay.cp
    keys = s.sliding_window if 0 < s.sliding_window < w.seq else w.seq
    heads_dim = s.dim / lay.tp
    if fw.attention == "flash":
        causal = 0.5 if keys == w.seq else 1.0
        flops = 4 * lay.micro_batch * seq_local * keys * heads_dim * causal
        attn_f = flops / (c.peak(w.dtype) * c.attention_efficiency)
        attn_b = 2.5 * attn_f
    else:
        flops = 4 * lay.micro_batch * seq_local * keys * heads_dim
        scores = lay.micro_batch * s.n_heads / lay.tp * seq_local * keys
        bmm = flops / c.gemm_flops(w.dtype, min(seq_local, s.head_dim))
        kernels = UnfusedAttention(e, fw.attention_dropout)  # the scores' passes: plan.kernels
        hbm = c.hbm_bw * c.memory_efficiency
        attn_f = bmm + scores * kernels.forward_bytes / hbm
        attn_b = 2 * bmm + scores * kernels.backward_bytes / hbm
    if fw.ours:
        acts = activations.ours(s, tokens, seq_local, e == 2, "none", lay.tp, True, lay.ep, True)
        kept = acts.layers[s.moe_layers[0] if moe else 0]
    else:
        # without the score matrix: the attention's traffic is charged above
        kept = activations.megatron(s, lay.micro_batch, seq_local, lay.tp, lay.tp > 1, "none", True)
    ew_f = ELEMENTWISE_PASSES * kept / (c.hbm_bw * c.memory_efficiency)
    fwd = gemm + attn_f + ew_f
    bwd = 2 * gemm + attn_b + 2 * ew_f
    if lay.recompute in ("full", "sublayer"):
        rc = fwd
    elif lay.recompute == "selective":
        rc = attn_f if not fw.ours else ew_f
    else:
        rc = 0.0
    return fwd, bwd, rc, gemm


def _tp_bytes(s: ModelShape, lay: Layout, fw: Framework, tokens: int, e: int) -> float:
    """Payload one rank hands to tensor-parallel collectives per layer and micro-batch (forward,
    backward and a recompute that re-runs the layer's collectives)."""
    if lay.tp == 1:
        return 0.0
    per_pass = 2 * s.sublayers_per_layer * tokens * s.dim * e  # an all-gather + reduce-scatter each
    passes = 2.0
    if lay.recompute in ("full", "sublayer") or (fw.ours and lay.recompute == "selective"):
        passes += 1
    if not fw.ours:
        passes += 0.5  # Megatron re-gathers each sublayer's input for the weight gradient
    return per_pass * passes


def _tp_comm(
    s: ModelShape, c: Cluster, lay: Layout, fw: Framework, tokens: int, e: int, gemm: float
) -> tuple[float, float]:
    """Seconds of tensor-parallel traffic per layer and micro-batch, forward and backward: each
    sublayer all-gathers its input and reduce-scatters its output (backward: the mirror pair)."""
    if lay.tp == 1:
        return 0.0, 0.0
    total = _tp_bytes(s, lay, fw, tokens, e)  # payload over forward, backward and recompute
    per_pass = 2 * s.sublayers_per_layer * tokens * s.dim * e  # payload of one pass
    ops = s.sublayers_per_layer
    one = c.op_time("all_gather", per_pass / 2, lay.tp, False, ops) + c.op_time(
        "reduce_scatter", per_pass / 2, lay.tp, False, ops
    )
    if fw.ours:  # tp_comm reorders rank blocks into sequence order and back (a copy each way)
        one += 2 * per_pass / (c.hbm_bw * c.memory_efficiency)
    fwd = one
    bwd = one * (total / per_pass - 1)
    if fw.tp_overlap:
        fwd = max(fwd / 4, fwd - gemm)
        bwd = max(bwd / 4, bwd - 2 * gemm)
    return fwd, bwd


def _cp_bytes(w: Workload, lay: Layout, e: int) -> float:
    if lay.cp == 1:
        return 0.0
    kv = 2 * w.seq // lay.cp * lay.micro_batch * w.spec.kv_dim / lay.tp * e
    return 3 * (lay.cp - 1) * kv  # K, V forward; K, V and dK, dV backward


def _cp_comm(
    w: Workload, c: Cluster, lay: Layout, fw: Framework, e: int, layer_f: float
) -> tuple[float, float]:
    """Ring attention's traffic per layer and micro-batch (forward: K, V; backward: K, V, dK, dV),
    behind the attention it overlaps — or all of it, where transfers do not overlap."""
    if lay.cp == 1:
        return 0.0, 0.0
    inter = lay.tp * lay.cp > c.gpus_per_node
    t = c.op_time("p2p", _cp_bytes(w, lay, e), lay.cp, inter, 3 * (lay.cp - 1))
    if not fw.cp_overlap:
        return t / 3, 2 * t / 3
    return max(0.0, t / 3 - layer_f / 2), max(0.0, 2 * t / 3 - layer_f)


def _head_times(w: Workload, c: Cluster, lay: Layout, tokens: int) -> tuple[float, float]:
    s = w.spec
    n = s.vocab / lay.tp
    f = 2 * tokens * n * s.dim / c.gemm_flops(w.dtype, min(tokens, n, s.dim))
    return f, 2 * f


@dataclass(frozen=True)
class _Fsdp:
    """What FSDP moves per layer and micro-batch (bytes, seconds) and per micro-batch for the
    root unit (embedding, final norm, head: gathered once, kept until its backward) — or, under
    pipelines, once per step for all of a rank's units (`step`, `step_s`; `first_s`: the root's and
    one layer's gather, which nothing hides)."""

    layer_f: float = 0.0
    layer_b: float = 0.0
    root: float = 0.0
    layer_f_s: float = 0.0
    layer_b_s: float = 0.0
    root_s: float = 0.0
    step: float = 0.0
    step_s: float = 0.0
    first_s: float = 0.0


def _fsdp(
    s: ModelShape, c: Cluster, lay: Layout, fw: Framework, e: int, params: RankParams
) -> _Fsdp:
    """depthscale's FSDP2 (`parallel/data_parallel.apply_fsdp`): every micro-batch gathers each
    layer in the compute dtype before its forward and again before its backward (reshard after
    forward), and reduce-scatters its fp32 gradients after its backward. Under pipelines a stage
    keeps its gathered parameters for the whole step (`fsdp_reshard_after_forward = "auto"`):
    each unit is gathered once per step, and the reduce-scatter waits for the step's end
    (`_dp_comm`)."""
    if not fw.ours or lay.shard == 1:
        return _Fsdp()
    inter = lay.tp * lay.cp * lay.dp_shard > c.gpus_per_node
    # FSDP2 copies a gathered buffer out into the parameters, and gradients into one to scatter
    copy = 2 / (c.hbm_bw * c.memory_efficiency)
    gather = gather_s = scatter = scatter_s = 0.0  # bytes on the wire, seconds; per layer
    for elements, n in _fsdp_units(params, lay, per_layer=True):
        part = (n - 1) / n
        gather += part * elements * e
        gather_s += c.op_time("all_gather", elements * e, n, inter) + copy * elements * e
        g = elements * fw.reduce_bytes
        scatter += part * g
        scatter_s += c.op_time("reduce_scatter", g, n, inter) + copy * g
    sh = lay.shard
    root = (s.embedding_params() + s.head_params()) / lay.tp * e
    root_s = c.op_time("all_gather", root, sh, inter) + copy * root
    root *= (sh - 1) / sh
    if lay.pp > 1 and not lay.zero3:
        layers = params.layers
        return _Fsdp(
            step=layers * gather + root,
            step_s=layers * gather_s + root_s,
            first_s=gather_s + root_s,
        )
    if lay.pp > 1:  # zero3: gathered per micro-batch, reduce-scattered once at the step's end
        scatter = scatter_s = 0.0
    return _Fsdp(gather, gather + scatter, root, gather_s, gather_s + scatter_s, root_s)


def _fsdp_units(params: RankParams, lay: Layout, per_layer: bool) -> list[tuple[float, int]]:
    """(elements, ranks sharded over) of what FSDP shards on this rank — the dense weights over
    dp_shard × cp, expert-parallel experts over their own shard group — per layer or in all."""
    dense = params.fsdp_per_layer() if per_layer else params.fsdp
    units = [(dense, lay.shard)]
    if params.experts and lay.expert_shard > 1:
        experts = params.experts_per_layer() if per_layer else params.experts
        units.append((experts, lay.expert_shard))
    return units


def _dp_comm(c: Cluster, lay: Layout, fw: Framework, params: RankParams) -> tuple[float, float]:
    """(bytes on the wire, seconds) of the gradient reduction at the end of a step: FSDP's
    deferred reduce-scatter (pipelines), the all-reduce across HSDP replicas, DDP's all-reduce
    (fp32, in buckets), or Megatron's all-reduce / distributed-optimizer reduce-scatter and
    gather."""
    inter = lay.tp * lay.cp * lay.dp > c.gpus_per_node
    sent = seconds = 0.0
    if fw.ours and lay.shard > 1:
        g = fw.reduce_bytes
        for elements, sh in _fsdp_units(params, lay, per_layer=False):
            if lay.pp > 1:
                sent += (sh - 1) / sh * elements * g
                seconds += c.op_time("reduce_scatter", elements * g, sh, inter)
            if lay.dp_replicate > 1:
                r = lay.dp_replicate
                sent += 2 * (r - 1) / r * elements / sh * g
                seconds += c.op_time("all_reduce", elements / sh * g, r, True)
    elif lay.dp > 1:
        total = params.total
        d = lay.dp
        if lay.zero1:
            grads, weights = total * fw.reduce_bytes, total * fw.weight_bytes
            sent += (d - 1) / d * (grads + weights)
            buckets = max(1.0, grads / DDP_BUCKET_BYTES)
            seconds += c.op_time("reduce_scatter", grads, d, inter, buckets)
            seconds += c.op_time("all_gather", weights, d, inter, buckets)
        else:
            grads = total * fw.reduce_bytes
            sent += 2 * (d - 1) / d * grads
            buckets = max(1.0, grads / DDP_BUCKET_BYTES)
            seconds += c.op_time("all_reduce", grads, d, inter, buckets)
    return sent, seconds
