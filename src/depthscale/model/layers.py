"""Transformer building blocks: RMSNorm, RoPE (plain, or linear / Llama 3 scaled), grouped-query
attention (full or sliding window), SwiGLU.

Conventions follow Hugging Face Llama (rotate-half RoPE, fp32 RMSNorm statistics) so checkpoints map
one-to-one. Shapes use `view(B, T, -1, head_dim)` so tensor parallelism can shard heads without the
module knowing its local head count.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from depthscale.config import ModelConfig, RopeScalingKind
from depthscale.model.attention_logits import max_logits
from depthscale.model.document_attention import document_attention
from depthscale.model.documents import Documents
from depthscale.model.window_attention import window_attention


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: the `model.rope_scaling*` fields (see ModelConfig)."""

    kind: RopeScalingKind = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192

    @classmethod
    def of(cls, cfg: ModelConfig) -> RopeScaling:
        return cls(
            cfg.rope_scaling,
            cfg.rope_scaling_factor,
            cfg.rope_low_freq_factor,
            cfg.rope_high_freq_factor,
            cfg.rope_original_max_len,
        )


def _llama3_scaled(inv_freq: Tensor, s: RopeScaling) -> Tensor:
    """Llama 3.1 scaling: wavelengths above original_max_len / low_freq_factor are divided by the
    factor, those below original_max_len / high_freq_factor kept, the band between blended.
    Written op for op as transformers' `_compute_llama3_parameters`, so the fp32 result is
    bit-identical to it (and to Meta's `apply_scaling`)."""
    low_freq_wavelen = s.original_max_len / s.low_freq_factor
    high_freq_wavelen = s.original_max_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_len / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling = RopeScaling()) -> Tensor:
    """Inverse frequencies [head_dim / 2] in fp32: theta^(-2i/head_dim), then scaled."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    return inv_freq


def rope_tables(
    head_dim: int, max_len: int, theta: float, scaling: RopeScaling = RopeScaling()
) -> tuple[Tensor, Tensor]:
    """cos/sin tables [max_len, head_dim] in fp32 (rotate-half layout: frequencies repeated twice)."""
    inv_freq = rope_frequencies(head_dim, theta, scaling)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [B, H, T, hd] by the angles of its positions (cos/sin already gathered: [T, hd],
    or [B, 1, T, hd] when each row has its own positions)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + _rotate_half(x) * sin


def attention_mask(q_pos: Tensor, k_pos: Tensor, window: int, causal: bool = True) -> Tensor:
    """Boolean [Tq, Tk] mask (True = attend) by position: causal (keys at or before the query) or
    bidirectional; with `window` > 0 only keys less than `window` positions away."""
    diff = q_pos[:, None] - k_pos[None, :]
    allowed = diff >= 0 if causal else torch.ones_like(diff, dtype=torch.bool)
    if window > 0:
        allowed &= diff.abs() < window
    return allowed


def sdpa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: Tensor | None,
    k_pos: Tensor | None,
    window: int,
    documents: Documents | None = None,
) -> Tensor:
    """Causal attention on `scaled_dot_product_attention`; q [B,H,Tq,hd], k/v [B,Hkv,Tk,hd].

    Positions of None mean 0..T-1 with Tq == Tk, which lets SDPA use its fused causal path, and a
    sliding window there run blockwise (`window_attention`: cost ∝ T·window, not T²). Explicit
    positions (KV-cache decoding) build the dense mask. `documents`: rows of packed documents,
    attended within each (`document_attention`); whole rows only (positions None).
    """
    gqa = q.shape[1] != k.shape[1]
    if documents is not None:
        if q_pos is not None:
            raise ValueError(
                "document masking runs on whole rows (positions None); a sharded or cached "
                "sequence attends through its own attention function"
            )
        return outside_graph(document_attention)(q, k, v, window, documents)
    if q_pos is None and window == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if q_pos is None and window < q.shape[2]:
        return window_attention(q, k, v, window)
    if q_pos is None:
        q_pos = k_pos = torch.arange(q.shape[2], device=q.device)
    mask = attention_mask(q_pos, k_pos, window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


_OUTSIDE_GRAPH: dict[Callable, Callable] = {}


def outside_graph(fn: Callable) -> Callable:
    """`fn` left out of any compiled graph (`torch.compiler.disable`), as ring attention is: for
    work whose host-side planning or data-dependent shapes a graph cannot hold (packed documents,
    MoE routing) and that would otherwise recompile per batch. Wrapped once, on first use (the
    wrapper imports dynamo, which importing the model must not); call it once outside any compiled
    region (a layer's constructor) where the first use could be inside one."""
    if fn not in _OUTSIDE_GRAPH:
        _OUTSIDE_GRAPH[fn] = torch.compiler.disable(fn)
    return _OUTSIDE_GRAPH[fn]


AttentionFn = Callable[
    [Tensor, Tensor, Tensor, Tensor | None, Tensor | None, int, Documents | None], Tensor
]


class Projections:
    """How a sublayer applies its linear projections: `column` maps one input through a group of
    linears that read it (q, k, v; gate, up), `row` sums the outputs of the linears that write the
    sublayer's result (wo; w_down; both in the parallel block). Here each is a plain linear.

    This is the one seam a layout changes to shard the projections: tensor parallelism installs
    `parallel.tensor_parallel.SequenceParallelProjections`, which gathers the sequence once per
    column group and reduce-scatters the summed row outputs, overlapped with the GEMMs. The block,
    attention and MLP code stays the same."""

    def column(self, x: Tensor, linears: Sequence[nn.Module]) -> list[Tensor]:
        return [linear(x) for linear in linears]

    def row(self, ys: Sequence[Tensor], linears: Sequence[nn.Module]) -> Tensor:
        out = linears[0](ys[0])
        for y, linear in zip(ys[1:], linears[1:], strict=True):
            out = out + linear(y)
        return out

    def __repr__(self) -> str:
        return "local"


LOCAL = Projections()
"""The single-process projections (stateless, shared)."""


class KVCache(nn.Module):
    """Preallocated keys and values of one attention layer, for incremental decoding."""

    def __init__(
        self,
        batch: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        shape = (batch, kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        end = start + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(
                f"KV cache holds {self.k.shape[2]} positions; asked to write up to {end}"
            )
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE. `attention_fn` is the seam where context
    parallelism plugs in ring attention; the projections are where tensor parallelism shards."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.window = cfg.sliding_window
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.attention_fn: AttentionFn = sdpa_attention
        self.record_logits = False
        """`record_max_logits` (QK-clip, `train/qk_clip.py`): training forwards keep, in
        `logit_max`, each local head's largest attention logit since QK-clip last read it."""
        self.logit_max: Tensor | None = None

    def record_max_logits(self) -> None:
        """From now on, fold each training forward's per-head max logit into `logit_max`
        (`attention_logits.max_logits`; not in evaluation, no-grad or KV-cache forwards)."""
        outside_graph(_record_logits)  # wrapped here, outside any compiled region
        self.record_logits = True

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        positions: Tensor | None = None,
        cache: KVCache | None = None,
        start: int = 0,
        proj: Projections = LOCAL,
        documents: Documents | None = None,
    ) -> Tensor:
        q, k, v = proj.column(x, (self.wq, self.wk, self.wv))
        y = self.attend(q, k, v, cos, sin, positions, cache, start, documents)
        return proj.row((y,), (self.wo,))

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cos: Tensor,
        sin: Tensor,
        positions: Tensor | None = None,
        cache: KVCache | None = None,
        start: int = 0,
        documents: Documents | None = None,
    ) -> Tensor:
        """Everything between the projections: projected q/k/v [B, T, heads·hd] (any number of
        local heads, which is how tensor parallelism reuses it) → [B, T, heads·hd] before `wo`.
        `documents`: the packed documents of the rows (cos/sin then restart in each)."""
        B, T, _ = q.shape
        q = q.view(B, T, -1, self.head_dim).transpose(1, 2)
        k = k.view(B, T, -1, self.head_dim).transpose(1, 2)
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.record_logits and self.training and torch.is_grad_enabled() and cache is None:
            outside_graph(_record_logits)(self, q, k, positions, documents)
        k_pos = positions
        if cache is not None:
            k, v = cache.update(start, k, v)
            k_pos = torch.arange(k.shape[2], device=q.device)
        y = self.attention_fn(q, k, v, positions, k_pos, self.window, documents)
        return y.transpose(1, 2).reshape(B, T, -1)


def _record_logits(
    attn: Attention, q: Tensor, k: Tensor, positions: Tensor | None, documents: Documents | None
) -> None:
    """Fold this forward's per-head max logit into `attn.logit_max` (a recomputed forward, under
    activation checkpointing, folds the same values in again). Whole rows only: a context-parallel
    shard holds part of the keys (the config refuses QK-clip there)."""
    if positions is not None:
        raise ValueError("QK-clip reads the logits of whole rows (positions None), not a shard's")
    now = max_logits(q.detach(), k.detach(), attn.window, documents)
    attn.logit_max = now if attn.logit_max is None else torch.maximum(attn.logit_max, now)


class SwiGLU(nn.Module):
    """w_down(silu(w_gate x) · w_up x). With `chunk_size` > 0 (blockwise FFN, as in BPT) the MLP runs
    over chunks of that many sequence positions (dim -2); under autograd each chunk is checkpointed
    (non-reentrant), so backward keeps only the input and recomputes one chunk's [chunk, hidden]
    intermediates at a time. Exact; the price is one extra MLP forward per training step."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.chunk_size = cfg.ffn_chunk_size
        self.w_gate = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w_up = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w_down = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    @staticmethod
    def activation(gate: Tensor, up: Tensor) -> Tensor:
        return F.silu(gate) * up

    def mlp(self, x: Tensor, proj: Projections = LOCAL) -> Tensor:
        gate, up = proj.column(x, (self.w_gate, self.w_up))
        return proj.row((self.activation(gate, up),), (self.w_down,))

    def forward(self, x: Tensor, proj: Projections = LOCAL) -> Tensor:
        if self.chunk_size <= 0 or x.dim() < 2 or x.shape[-2] <= self.chunk_size:
            return self.mlp(x, proj)
        chunks = x.split(self.chunk_size, dim=-2)
        if torch.is_grad_enabled() and (x.requires_grad or self.w_up.weight.requires_grad):
            outs = [checkpoint(self.mlp, c, proj, use_reentrant=False) for c in chunks]
        else:
            outs = [self.mlp(c, proj) for c in chunks]
        return torch.cat(outs, dim=-2)
