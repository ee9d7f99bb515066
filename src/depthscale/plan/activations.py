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

from depthscale.plan.spec import ModelSpec

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
    spec: ModelSpec,
    tokens: int,
    seq: int,
    bf16: bool,
    recompute: str = "none",
    tp: int = 1,
    bf16_weights_gathered: bool = False,
) -> Activations:
    """depthscale's model for one micro-batch of `tokens` (micro-batch × local sequence `seq`)."""
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute {recompute!r}; allowed: {', '.join(RECOMPUTE_MODES)}")
    a = 2 if bf16 else F32
    d, f, kv, h = spec.dim, spec.ffn_dim, spec.kv_dim, spec.n_heads
    n = tokens / tp
    casts = bf16 and not bf16_weights_gathered
    attention = n * (a * (2 * d + 2 * kv) + F32 * h) + (4 * seq * spec.head_dim * a if bf16 else 0)
    mlp = n * 4 * a * f  # gate, up, silu(gate), silu·up
    if spec.parallel_block:
        subs = [(5, 2 * d * d + 2 * d * kv + 3 * d * f, attention + mlp)]
        kept_mm = n * (a * (4 * d + 2 * kv + 2 * f) + F32 * h)  # q k v out, gate up, 2 row outs
    else:
        subs = [(3, 2 * d * d + 2 * d * kv, attention), (2, 3 * d * f, mlp)]
        kept_mm = n * (a * (4 * d + 2 * kv + 2 * f) + F32 * h)  # q k v out wo; gate up down
    norm_core = n * (F32 * d + F32 + a * d)  # fp32 input, rsqrt, x̂
    reads = _read_bytes(spec, n, a)
    per = len(subs)
    layers = []
    for i in range(spec.n_layers):
        read = sum(reads[i * per : (i + 1) * per])
        if recompute == "none":
            kept = read + sum(
                norm_core + n * (2 * d * k if bf16 else F32 * d) + body for k, _, body in subs
            )
            kept += sum(2 * w / tp for _, w, _ in subs) if casts else 0.0
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


def _read_bytes(spec: ModelSpec, n: float, a: int) -> list[float]:
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


def _writes(spec: ModelSpec, layer: int, selective: bool) -> tuple[int, bool]:
    """(blocks the layer completes, whether its last write is a partial sum that goes on) — not
    counting, under selective recompute, a write that is a matmul's own output (the first
    sublayer of a block writes y itself; the parallel block writes a sum), kept already."""
    bl, per = spec.blocks, spec.sublayers_per_layer

    def new(j: int) -> bool:
        raw = (j == 0 or bl[j - 1] != bl[j]) and not spec.parallel_block
        return not (selective and raw)

    ends = sum(
        1
        for j in range(layer * per, (layer + 1) * per)
        if (j == len(bl) - 1 or bl[j + 1] != bl[j]) and new(j)
    )
    last = (layer + 1) * per - 1
    return ends, new(last)


def _boundary(spec: ModelSpec, layer: int, n: float, a: int, selective: bool) -> float:
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
    spec: ModelSpec, micro_batch: int, seq: int, tp: int, sp: bool, recompute: str
) -> float:
    """Korthikanti et al. 2022, Table 2: one GPT layer's bf16 activations for one micro-batch."""
    s, b, hdim, heads = seq, micro_batch, spec.dim, spec.n_heads
    sbh = s * b * hdim
    scores = 5 * heads * s / hdim
    if recompute == "full":
        return 2 * sbh / (tp if sp else 1)
    if recompute == "selective":
        return sbh * (34 / tp if sp else 10 + 24 / tp)
    return sbh * ((34 + scores) / tp if sp else 10 + (24 + scores) / tp)
