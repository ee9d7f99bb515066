"""Bytes autograd keeps for backward, per micro-batch: depthscale's own inventory, and Megatron's.

`ours` lists, op by op, what `model/` keeps (read off the code; `tests/unit/test_plan_memory.py`
checks it against saved-tensor hooks and the profiler): per token and sublayer, in the dtype each
tensor has. Under bf16 autocast RMSNorm keeps an fp32 copy of its input, each linear keeps its own
bf16 cast of its input, and a weight's bf16 cast is kept per micro-batch unless FSDP already
gathers bf16 weights. `megatron` is Korthikanti et al. 2022, Table 2 (GPT layer, bf16).

Per-token tensors are divided by tp (sequence parallelism: norms and reads see T/tp tokens,
attention and MLP tensors hold heads/tp or ffn/tp); `tokens` is already the local T/cp share.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from depthscale.shape import ModelShape

F32 = 4
RNG_STATE_BYTES = 5056
"""What a checkpoint keeps to replay randomness: the CPU generator's state (`torch.get_rng_state`);
on a GPU the device generator's adds 16 bytes."""
RECOMPUTE_MODES = ("none", "selective", "sublayer", "full")


@dataclass(frozen=True)
class Activations:
    """Bytes one micro-batch keeps: per layer, before the layers and after them."""

    layers: tuple[float, ...]
    embed: float
    head: float
    """Output read, final norm, the head's input and the fp32 log-softmax the loss keeps."""

    def total(self) -> float:
        return sum(self.layers) + self.embed + self.head

    def of_layers(self, layers: range) -> float:
        return sum(self.layers[i] for i in layers)


@lru_cache(maxsize=4096)
def ours(
    spec: ModelShape,
    tokens: int,
    seq: int,
    bf16: bool,
    recompute: str = "none",
    tp: int = 1,
    bf16_weights_gathered: bool = False,
    ep: int = 1,
    experts_gathered: bool | None = None,
) -> Activations:
    """depthscale's model for one micro-batch of `tokens` (micro-batch × local sequence `seq`);
    `ep`: expert parallelism's split of the experts; `experts_gathered`: whether FSDP gathers
    them in bf16 (default: as the other weights) — else a micro-batch keeps their bf16 casts."""
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute {recompute!r}; allowed: {', '.join(RECOMPUTE_MODES)}")
    a = 2 if bf16 else F32
    d, f, kv, h = spec.dim, spec.ffn_dim, spec.kv_dim, spec.n_heads
    n = tokens / tp
    casts = bf16 and not bf16_weights_gathered
    attention = n * (a * (2 * d + 2 * kv) + F32 * h) + (4 * seq * spec.head_dim * a if bf16 else 0)
    mlp = n * 4 * a * f  # gate, up, silu(gate), silu·up
    kept_attention = n * (a * (3 * d + 2 * kv) + F32 * h)  # q k v, attention out, wo
    if spec.parallel_block:
        dense = [(5, 2 * d * d + 2 * d * kv + 3 * d * f, attention + mlp)]
    else:
        dense = [(3, 2 * d * d + 2 * d * kv, attention), (2, 3 * d * f, mlp)]
    dense_mm = kept_attention + n * a * (2 * f + d)  # and gate, up, down
    if experts_gathered is None:
        experts_gathered = bf16_weights_gathered
    moe = _moe(spec, n, a, bf16, not experts_gathered, ep) if spec.moe else None
    norm_core = n * (F32 * d + F32 + a * d)  # fp32 input, rsqrt, x̂
    reads = _read_bytes(spec, n, a)
    per = len(dense)
    layers = []
    for i in range(spec.n_layers):
        subs, kept_mm, experts_cast = dense, dense_mm, 0.0
        if moe and i in spec.moe_layers:
            subs = [dense[0], (2, moe.shared_weights, moe.body)]
            kept_mm, experts_cast = kept_attention + moe.matmul_outputs, moe.experts_cast
        read = sum(reads[i * per : (i + 1) * per])
        if recompute == "none":
            kept = read + sum(
                norm_core + n * (2 * d * k if bf16 else F32 * d) + body for k, _, body in subs
            )
            kept += sum(2 * w / tp for _, w, _ in subs) if casts else 0.0
            kept += experts_cast
        elif recompute == "sublayer":  # norms and reads stay; each body keeps its fp32 input
            kept = read + per * (norm_core + n * F32 * d + RNG_STATE_BYTES)
        elif recompute == "full":
            kept = _boundary(spec, i, n, a, False) + RNG_STATE_BYTES
        else:  # selective: matmul and attention outputs stay
            kept = _boundary(spec, i, n, a, True) + RNG_STATE_BYTES + kept_mm
        layers.append(kept)
    embed = 8.0 * tokens  # token ids (the embedding's backward)
    if spec.attnres or recompute in ("full", "selective"):
        embed += n * a * d  # b_0: a depth source, or the first checkpoint's input
    final = n * (F32 * d + F32 + a * d + (2 * d if bf16 else F32 * d))
    head = final + n * F32 * spec.vocab + F32 + (2 * spec.vocab * d / tp if casts else 0.0)
    if spec.attnres:
        head += reads[-1]
        if recompute in ("full", "selective"):  # the last layer's blocks: the output read's
            head += n * a * d * _writes(spec, spec.n_layers - 1, recompute == "selective")[0]
    return Activations(tuple(layers), embed, head)


@dataclass(frozen=True)
class _MoE:
    body: float
    """What an MoE FFN keeps past its fp32 input (the norm's output, which the router reads)."""
    shared_weights: float
    """Shared-expert parameters of this rank (cast to bf16 per micro-batch, like a dense FFN's)."""
    experts_cast: float
    """The routed experts' bf16 copies a micro-batch keeps (where FSDP does not gather them in
    bf16: no FSDP, or expert parallelism with no other rank holding the same experts)."""
    matmul_outputs: float
    """What selective recompute keeps of it: the router's logits and the GEMMs' outputs."""


def _moe(spec: ModelShape, n: float, a: int, bf16: bool, cast: bool, ep: int) -> _MoE:
    """The MoE FFN (`model/moe.py`) for `n` routed tokens, read off the code (and checked with
    saved-tensor hooks): in fp32 the router's scores [n, E], the top-k indices, the slot order and
    each slot's token (int64, n·k each), each slot's weight, three grouped-GEMM offsets [E]; the
    n·k rows in the compute dtype, the experts' gate, up, silu(gate), silu·up, and the combined
    outputs and their weighted copy in fp32; renormalisation keeps the k weights and their sum,
    the balance loss the score sums and counts, the z-loss the logits and their log-sum-exp.
    Under expert parallelism a rank's experts compute the rows the ep group sends them: n·k when
    routing is balanced, so the same bytes."""
    d, e, f = spec.dim, spec.n_experts, spec.moe_ffn
    rows = n * spec.moe_top_k
    body = F32 * n * e + 3 * 8 * rows + F32 * rows + 3 * F32 * e
    body += a * rows * d + 4 * a * rows * f + 2 * F32 * rows * d
    if spec.moe_normalize:
        body += F32 * (n + rows)
    if spec.moe_balance_loss:
        body += F32 * (n + e)
    if spec.moe_z_loss:
        body += F32 * (n * e + n)
    if spec.moe_aux:
        body += F32 * (e + 1)  # the counts, summed over the rows' ranks
    shared = spec.moe_shared * f
    if shared:
        # autocast casts the input once per projection (gate, up): it caches only leaves' casts
        body += 4 * a * n * shared + (2 * a * n * d if bf16 else 0.0)
    experts_cast = 3 * e // ep * d * f * 2 if bf16 and cast else 0.0
    mm = F32 * n * e + a * rows * (2 * f + d) + a * n * (2 * shared + d) * (shared > 0)
    return _MoE(body, 3 * d * shared, experts_cast, mm)


def _read_bytes(spec: ModelShape, n: float, a: int) -> list[float]:
    """AttnRes bytes per sublayer, and the output read last: the write's output (a partial sum or
    a completed block), a merge's phase-1 output, three fp32 scalars per token and its query, and
    a phase-1 read's fp32 scalars over k sources for S queries (k + 2·S·k) with the S queries."""
    if not spec.attnres:
        return [0.0] * (spec.n_sublayers + 1)
    blocks, d = spec.blocks, spec.dim
    out = []
    done = 1  # completed sources: b_0
    for i, b in enumerate(blocks):
        x = n * a * d
        if i == 0 or blocks[i - 1] != b:
            members = blocks.count(b)
            x += n * F32 * (done + 2 * members * done) + F32 * members * d
        else:
            x += n * (a * d + 3 * F32) + F32 * d
        if i == len(blocks) - 1 or blocks[i + 1] != b:
            done += 1
        out.append(x)
    out.append(n * F32 * 3 * done + F32 * d)
    return out


def _writes(spec: ModelShape, layer: int, selective: bool) -> tuple[int, bool]:
    """(blocks the layer completes, whether its last write is a partial sum that goes on) — not
    counting, under selective recompute, a write that is a matmul's own output (the first
    sublayer of a block writes y itself; the parallel block and MoE write sums), kept already."""
    bl, per = spec.blocks, spec.sublayers_per_layer

    def new(j: int) -> bool:
        moe = j % per == 1 and j // per in spec.moe_layers  # its output is a weighted sum
        raw = (j == 0 or bl[j - 1] != bl[j]) and not spec.parallel_block and not moe
        return not (selective and raw)

    ends = sum(
        1
        for j in range(layer * per, (layer + 1) * per)
        if (j == len(bl) - 1 or bl[j + 1] != bl[j]) and new(j)
    )
    last = (layer + 1) * per - 1
    return ends, new(last)


def _boundary(spec: ModelShape, layer: int, n: float, a: int, selective: bool) -> float:
    """The new tensors a layer's checkpoint keeps as its input: standard, the hidden state;
    AttnRes, the blocks the previous layer completed and, when a block continues into this layer,
    the partial sum and the two-phase memo (each member's phase-1 output and fp32 lse)."""
    if layer == 0:
        return 0.0  # the embedding's output: counted with it
    d = spec.dim
    if not spec.attnres:
        return n * a * d
    ends, partial_new = _writes(spec, layer - 1, selective)
    kept = n * a * d * ends
    j, bl = layer * spec.sublayers_per_layer, spec.blocks
    if bl[j] == bl[j - 1]:
        kept += n * a * d * partial_new + bl.count(bl[j]) * n * (a * d + F32)
    return kept


def megatron(
    spec: ModelShape,
    micro_batch: int,
    seq: int,
    tp: int,
    sp: bool,
    recompute: str,
    flash: bool = False,
) -> float:
    """Korthikanti et al. 2022, Table 2: one GPT layer's bf16 activations for one micro-batch.
    `flash`: a fused attention kernel keeps no score matrix — the 5·a·s/h term (softmax output,
    dropout mask and output, QKᵀ) is not there, only the kernel's per-row statistics."""
    s, b, hdim, heads = seq, micro_batch, spec.dim, spec.n_heads
    sbh = s * b * hdim
    scores = 0.0 if flash else 5 * heads * s / hdim
    if recompute == "full":
        return 2 * sbh / (tp if sp else 1)
    if recompute == "selective":
        return sbh * (34 / tp if sp else 10 + 24 / tp)
    return sbh * ((34 + scores) / tp if sp else 10 + (24 + scores) / tp)
