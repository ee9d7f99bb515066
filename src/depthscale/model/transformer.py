"""A decoder-only Llama-style language model whose residual stream is a depth state.

`Transformer.forward` = `embed` → `TransformerBlock`s → `head`; pipeline stages call the three pieces
separately, so layers live in a `ModuleDict` keyed by their global index (names stay stable when a
stage keeps only some of them).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from depthscale.config import ModelConfig
from depthscale.model.documents import Documents
from depthscale.model.init import fill_constant_, fill_seeded_
from depthscale.model.layers import (
    LOCAL,
    Attention,
    KVCache,
    Projections,
    RMSNorm,
    RopeScaling,
    SwiGLU,
    rope_tables,
)
from depthscale.model.moe import MoE
from depthscale.model.recompute import LAYER_MODES, RecomputeMode, check_mode, checkpoint_layer
from depthscale.model.residual import (
    AttnResidual,
    DepthState,
    initial_state,
    link_groups,
    make_output_residual,
    make_residual,
)


class TransformerBlock(nn.Module):
    """Attention then MLP, each a sublayer reading and writing the depth state; or, as a MegaScale
    parallel block, both reading the same normalized input as one sublayer with summed outputs.

    Two seams let layouts and memory policies change how it computes without a second forward:
    `projections` (how the linear projections run: plain, or sharded by tensor parallelism) and
    `recompute` (what backward recomputes instead of keeping: `model/recompute.py`). Both show in
    `print(model)`."""

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.parallel = cfg.parallel_block
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.feed_forward = MoE(cfg) if cfg.is_moe_layer(layer_id) else SwiGLU(cfg)
        if self.parallel:
            self.residual = make_residual(cfg, layer_id)
        else:
            self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.attention_residual = make_residual(cfg, 2 * layer_id)
            self.ffn_residual = make_residual(cfg, 2 * layer_id + 1)
        self.projections: Projections = LOCAL
        self.recompute: RecomputeMode = "none"
        self._compiled_parts: dict = {}
        """Compiled norm + sublayer bodies by method name (`compile`, AttnRes blocks)."""

    def residuals(self) -> list[nn.Module]:
        """This layer's residual modules in sublayer order."""
        return [self.residual] if self.parallel else [self.attention_residual, self.ffn_residual]

    def forward(
        self,
        state: DepthState,
        cos: Tensor,
        sin: Tensor,
        positions: Tensor | None = None,
        cache: KVCache | None = None,
        start: int = 0,
        documents: Documents | None = None,
    ) -> DepthState:
        args = (state, cos, sin, positions, cache, start, documents)
        if self.recompute in LAYER_MODES and torch.is_grad_enabled():
            return checkpoint_layer(self.sublayers, self.recompute, *args)
        return self.sublayers(*args)

    def sublayers(
        self,
        state: DepthState,
        cos: Tensor,
        sin: Tensor,
        positions: Tensor | None = None,
        cache: KVCache | None = None,
        start: int = 0,
        documents: Documents | None = None,
    ) -> DepthState:
        """read → norm → sublayer → write, once per sublayer. The depth reads are per token, so
        packed documents change only attention (and RoPE, through cos/sin)."""
        part = self._compiled_parts.get
        where = (cos, sin, positions, cache, start, documents)
        if self.parallel:
            h, state = self.residual.read(state)
            y = part("normed_parallel", self.normed_parallel)(h, *where)
            return self.residual.write(state, y)
        h, state = self.attention_residual.read(state)
        y = part("normed_attention", self.normed_attention)(h, *where)
        state = self.attention_residual.write(state, y)
        h, state = self.ffn_residual.read(state)
        return self.ffn_residual.write(state, part("normed_mlp", self.normed_mlp)(h))

    def normed_attention(self, h: Tensor, *where) -> Tensor:
        """The attention sublayer's output for its depth read `h`: norm, then the body."""
        return self._body(self.attention_sublayer, self.attention_norm(h), *where)

    def normed_mlp(self, h: Tensor) -> Tensor:
        return self._body(self.mlp_sublayer, self.ffn_norm(h))

    def normed_parallel(self, h: Tensor, *where) -> Tensor:
        return self._body(self.parallel_sublayer, self.attention_norm(h), *where)

    def _body(self, sublayer, *args) -> Tensor:
        """Run a sublayer body, checkpointed under `recompute = "sublayer"`."""
        if self.recompute == "sublayer" and torch.is_grad_enabled():
            return checkpoint(sublayer, *args, use_reentrant=False)
        return sublayer(*args)

    def compile(self, *args, **kwargs) -> None:
        """Compile this layer in place (`nn.Module.compile`, what `train.compile` calls on every
        layer; arguments as `torch.compile`'s) into graphs that every layer at every depth shares
        (dynamo keys its cache by code and lifts parameters as graph inputs).

        A standard residual's state is one tensor of one shape: the whole layer compiles, and
        Inductor fuses each write into the next norm. An AttnRes depth state grows with depth
        (b_0 and every completed block), and a layer's place in its AttnRes block decides what its
        reads do (phase 1 at the first sublayer, a commit at the last): compiled whole, each layer
        would be a graph of its own — minutes of Inductor before the first step of a deep
        model. So the depth reads and writes run eagerly — the fused kernels (Triton,
        C++) they call are what a compiled read calls too on CUDA, exact and with their gradients
        chained, which custom ops under the compiler cannot — and each sublayer's norm and body
        compile: one graph for attention and one for the MLP (one for a parallel block), whatever
        the depth and the AttnRes variant. `compiled_parts` names what was compiled."""
        if not any(isinstance(r, AttnResidual) for r in self.residuals()):
            super().compile(*args, **kwargs)
            return
        names = ("normed_parallel",) if self.parallel else ("normed_attention", "normed_mlp")
        self._compiled_parts = {n: torch.compile(getattr(self, n), *args, **kwargs) for n in names}

    def __getstate__(self) -> dict:
        """As `nn.Module` drops its compiled call: copies and pickles hold no compiled code."""
        state = super().__getstate__()
        state["_compiled_parts"] = {}
        return state

    @property
    def compiled_parts(self) -> list[str]:
        """What `compile` compiled: ["layer"], the sublayer parts, or nothing."""
        if self._compiled_call_impl is not None:
            return ["layer"]
        return list(self._compiled_parts)

    def attention_sublayer(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        positions: Tensor | None = None,
        cache: KVCache | None = None,
        start: int = 0,
        documents: Documents | None = None,
    ) -> Tensor:
        return self.attention(x, cos, sin, positions, cache, start, self.projections, documents)

    def mlp_sublayer(self, x: Tensor) -> Tensor:
        return self.feed_forward(x, self.projections)

    def parallel_sublayer(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        positions: Tensor | None = None,
        cache: KVCache | None = None,
        start: int = 0,
        documents: Documents | None = None,
    ) -> Tensor:
        """MegaScale's parallel block: attention and MLP on the same input, outputs summed. Their
        projections form one column group (q, k, v, gate, up) and one row sum (wo, w_down), so a
        sharded layout gathers and scatters once for both. A blockwise MLP runs chunk by chunk on
        its own instead (its memory saving is why it was asked for)."""
        attn, mlp, proj = self.attention, self.feed_forward, self.projections
        if mlp.chunk_size > 0:
            y = self.attention(x, cos, sin, positions, cache, start, proj, documents)
            return y + mlp(x, proj)
        cols = (attn.wq, attn.wk, attn.wv, mlp.w_gate, mlp.w_up)
        q, k, v, gate, up = proj.column(x, cols)
        ya = attn.attend(q, k, v, cos, sin, positions, cache, start, documents)
        return proj.row((ya, mlp.activation(gate, up)), (attn.wo, mlp.w_down))

    def extra_repr(self) -> str:
        return f"projections={self.projections!r}, recompute={self.recompute}"


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError(
                "ModelConfig.vocab_size must be resolved (> 0) before building the model"
            )
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        self.output_residual = make_output_residual(cfg)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, RopeScaling.of(cfg))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.seq_shards = 1
        """The depth state holds 1/seq_shards of every sequence: sequence parallelism, whose
        projections gather the whole sequence for attention (set by tensor parallelism)."""
        self.link_depth_groups()
        self.reset_parameters()

    def set_recompute(self, mode: RecomputeMode) -> None:
        """What backward recomputes in every layer (`model.recompute` modes). Set it before the
        model is sharded or wrapped: it is part of the layer, not a patch applied afterwards."""
        check_mode(mode)
        for layer in self.layers.values():
            layer.recompute = mode

    def link_depth_groups(self) -> None:
        """Group the AttnRes sublayers by block for two-phase reads (again after dropping layers)."""
        link_groups([m for layer in self.layers.values() for m in layer.residuals()])

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """Normal(0, init_std) weights; output projections scaled by 1/sqrt(2·layers) (GPT-2) so the
        residual stream's variance does not grow with depth; AttnRes queries zero, norm gains one.

        Every weight is drawn from its own generator, seeded by `seed` (default: the process seed,
        `torch.initial_seed()`) and its name, never from the global stream. So a model built on the
        meta device, split into stages, sharded and only then materialised draws exactly the values
        one process does (a sharded parameter draws its full tensor on its device and keeps its
        slice: the memory of one parameter), and the global RNG is left as it was. Values depend on
        the device type's generator (CPU and CUDA draw different numbers), not on the layout."""
        seed = torch.initial_seed() if seed is None else seed
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if p.is_meta:
                continue
            if name.endswith(("wo.weight", "w_down.weight", "experts.w_down")):
                fill_seeded_(
                    p, self._init_key(name), seed, lambda t, g: t.normal_(0.0, out_std, generator=g)
                )
            elif p.ndim >= 2:
                fill_seeded_(
                    p, self._init_key(name), seed, lambda t, g: t.normal_(0.0, std, generator=g)
                )
            elif name.endswith("pseudo_query"):
                fill_constant_(p, 0.0)
            else:
                fill_constant_(p, 1.0)
        for name, buffer in self.named_buffers():
            if name.endswith("expert_bias") and not buffer.is_meta:
                buffer.zero_()
        if not self.rope_cos.is_meta:
            cfg = self.cfg
            cos, sin = rope_tables(
                cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, RopeScaling.of(cfg)
            )
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def _init_key(self, name: str) -> str:
        """The name a weight's initial values are drawn under: a pipeline's last stage keeps its
        own copy of a tied embedding as `output.weight`, and it must start equal to the first's."""
        if self.cfg.tie_embeddings and name == "output.weight":
            return "tok_embeddings.weight"
        return name

    def rope(
        self, positions: Tensor | None, seq_len: int, documents: Documents | None = None
    ) -> tuple[Tensor, Tensor]:
        """cos/sin [T, hd] of the positions (None: 0..seq_len−1); with packed `documents`, of
        each token's position in its document: [B, 1, T, hd]."""
        if documents is not None:
            p = documents.rope_positions(positions, seq_len)
            return self.rope_cos[p].unsqueeze(1), self.rope_sin[p].unsqueeze(1)
        if positions is None:
            return self.rope_cos[:seq_len], self.rope_sin[:seq_len]
        return self.rope_cos[positions], self.rope_sin[positions]

    def rope_for(
        self,
        state: DepthState,
        positions: Tensor | None = None,
        documents: Documents | None = None,
    ) -> tuple[Tensor, Tensor]:
        """RoPE tables for the layers that run on `state`: the given positions, or the whole
        sequence (0..T-1; under sequence parallelism the state holds 1/seq_shards of it)."""
        return self.rope(positions, state.seq_len * self.seq_shards, documents)

    def embed(self, tokens: Tensor) -> DepthState:
        """The initial depth state. Under autocast it holds the compute dtype, like every sublayer
        output after it: one dtype for the whole depth state in every layout (the embedding
        lookup itself is not autocast, so with fp32 weights it would be the one fp32 source)."""
        h = self.tok_embeddings(tokens)
        device = h.device.type
        if torch.is_autocast_enabled(device):
            h = h.to(torch.get_autocast_dtype(device))
        return initial_state(self.cfg, h)

    def run_layers(
        self,
        state: DepthState,
        positions: Tensor | None = None,
        caches: list[KVCache] | None = None,
        start: int = 0,
        documents: Documents | None = None,
    ) -> DepthState:
        if caches is not None and self.seq_shards > 1:
            raise NotImplementedError(
                "KV-cache decoding is not sequence-parallel; generate with the single-process model"
            )
        if caches is not None and documents is not None:
            raise ValueError("KV-cache decoding runs one document per row: pass no documents")
        cos, sin = self.rope_for(state, positions, documents)
        for i, layer in enumerate(self.layers.values()):
            cache = caches[i] if caches is not None else None
            state = layer(state, cos, sin, positions, cache, start, documents)
        return state

    def head(self, state: DepthState) -> Tensor:
        """Final depth aggregation (AttnRes), final norm, LM head -> logits."""
        if isinstance(self.output_residual, AttnResidual):
            h, _ = self.output_residual.read(state)
        else:
            h = state.partial
        return self.output(self.norm(h))

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor | None = None,
        caches: list[KVCache] | None = None,
        start: int = 0,
        documents: Documents | None = None,
    ) -> Tensor:
        """tokens [B, T] -> logits [B, T, vocab]. With KV caches, tokens sit at positions
        start..start+T-1. `documents` (`model/documents.py`): the rows are packed documents, and
        attention and RoPE positions stay within each."""
        if caches is not None and positions is None:
            positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        state = self.run_layers(self.embed(tokens), positions, caches, start, documents)
        return self.head(state)

    def make_caches(
        self, batch: int, max_len: int, dtype: torch.dtype | None = None
    ) -> list[KVCache]:
        p = self.tok_embeddings.weight
        return [
            KVCache(
                batch, self.cfg.kv_heads, max_len, self.cfg.head_dim, dtype or p.dtype, p.device
            )
            for _ in range(self.cfg.n_layers)
        ]

    def num_params(self, exclude_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if exclude_embedding:
            n -= self.tok_embeddings.weight.numel()
        return n


def cross_entropy(logits: Tensor, labels: Tensor, ignore_index: int = -100) -> Tensor:
    """Mean token cross-entropy, computed in fp32 at least (bf16 logits are upcast)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=ignore_index)
