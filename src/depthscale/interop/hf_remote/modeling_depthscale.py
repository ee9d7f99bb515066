"""A depthscale language model for Hugging Face transformers (`trust_remote_code=True`).

This file is copied verbatim into every directory `depthscale convert ds-to-hf` writes for a model
plain `LlamaForCausalLM` cannot express: Attention Residuals (block or full), MegaScale parallel
blocks, causal sliding windows, Mixture-of-Experts FFNs. It imports torch and transformers only, never depthscale, so the
export loads wherever transformers does:

    AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)

The math is depthscale's, written to be read in one sitting (the fused, sharded and pipelined
versions live in depthscale; this is the reference they all equal):

- each sublayer (attention, then the SwiGLU MLP; or both on one input in a parallel block) reads
  its input `h`, computes `y = f(norm(h))` and writes `y` to the residual stream;
- standard residual: read is the running sum, write adds to it;
- Attention Residuals: the stream is a list of completed *sources* (the embedding, then one per
  block) plus the running sum of the current block. A read is a softmax over depth,
  `h = sum_i softmax_i(w . rmsnorm(v_i)) v_i`, with a learned pseudo-query `w` per sublayer; the
  last sublayer of a block commits its running sum as a new source (`attnres_blocks` gives each
  sublayer's block). Before the final norm one more read (its own query) aggregates the sources.
  Reads are per token, so incremental decoding caches attention keys and values only.
- Mixture of Experts (the layers in `moe_layers`): the router scores every expert in fp32
  (softmax or sigmoid), each token goes to its top k (chosen with `router.expert_bias` added, the
  aux-loss-free balancing bias; zero otherwise), weighted by its scores (renormalised when
  `moe_normalize_top_k`), plus the shared experts every token uses.

Parameter names are depthscale's, so the safetensors are its state dict as it is.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel

try:  # transformers 5 renamed the class and keeps the old name as an alias
    from transformers import PreTrainedConfig as _ConfigBase
except ImportError:  # transformers 4
    from transformers import PretrainedConfig as _ConfigBase
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

# transformers 5.2x names the KV cache `cache` (in a forward's arguments and its output) where
# earlier versions say `past_key_values`: take either, return it under the name this one uses.
_CACHE_FIELD = (
    "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
)


class DepthscaleConfig(_ConfigBase):
    model_type = "depthscale"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 256,
        hidden_size: int = 64,
        intermediate_size: int = 192,
        num_hidden_layers: int = 2,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 4,
        head_dim: int = 16,
        max_position_embeddings: int = 2048,
        rms_norm_eps: float = 1e-5,
        rope_theta: float = 10000.0,
        rope_kind: str = "none",
        rope_factor: float = 1.0,
        rope_low_freq_factor: float = 1.0,
        rope_high_freq_factor: float = 4.0,
        rope_original_max_len: int = 8192,
        residual: str = "standard",
        attnres_blocks: list[int] | None = None,
        attnres_key_norm_gain: bool = False,
        attnres_eps: float = 1e-6,
        parallel_block: bool = False,
        attention_window: int = 0,
        moe_experts: int = 0,
        moe_top_k: int = 2,
        moe_ffn_dim: int = 0,
        moe_shared_experts: int = 0,
        moe_gate: str = "softmax",
        moe_normalize_top_k: bool = True,
        moe_layers: list[int] | None = None,
        use_cache: bool = True,
        **kwargs,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.rope_kind = rope_kind
        self.rope_factor = rope_factor
        self.rope_low_freq_factor = rope_low_freq_factor
        self.rope_high_freq_factor = rope_high_freq_factor
        self.rope_original_max_len = rope_original_max_len
        self.residual = residual
        self.attnres_blocks = list(attnres_blocks or [])
        self.attnres_key_norm_gain = attnres_key_norm_gain
        self.attnres_eps = attnres_eps
        self.parallel_block = parallel_block
        self.attention_window = attention_window
        self.moe_experts, self.moe_top_k, self.moe_ffn_dim = moe_experts, moe_top_k, moe_ffn_dim
        self.moe_shared_experts, self.moe_gate = moe_shared_experts, moe_gate
        self.moe_normalize_top_k = moe_normalize_top_k
        self.moe_layers = list(moe_layers or [])
        self.use_cache = use_cache
        # Both matrices are stored (equal when depthscale tied them): no tying rules to differ
        # between transformers versions.
        kwargs["tie_word_embeddings"] = False
        super().__init__(**kwargs)


def inverse_frequencies(cfg: DepthscaleConfig) -> torch.Tensor:
    """RoPE inverse frequencies in fp32, with linear or Llama 3.1 scaling."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    if cfg.rope_kind == "linear":
        return inv_freq / cfg.rope_factor
    if cfg.rope_kind != "llama3":
        return inv_freq
    low_wavelen = cfg.rope_original_max_len / cfg.rope_low_freq_factor
    high_wavelen = cfg.rope_original_max_len / cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / cfg.rope_factor, inv_freq)
    smooth = (cfg.rope_original_max_len / wavelen - cfg.rope_low_freq_factor) / (
        cfg.rope_high_freq_factor - cfg.rope_low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / cfg.rope_factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DepthscaleConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx, self.head_dim = layer_idx, cfg.head_dim
        self.n_heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        d = cfg.hidden_size
        self.wq = nn.Linear(d, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, d, bias=False)

    def forward(self, x, cos, sin, mask, cache: Cache | None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        cos, sin = cos.to(q.dtype)[:, None], sin.to(q.dtype)[:, None]  # [B, 1, T, hd]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        groups = self.n_heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: DepthscaleConfig, hidden: int | None = None) -> None:
        super().__init__()
        d, hidden = cfg.hidden_size, hidden or cfg.intermediate_size
        self.w_gate = nn.Linear(d, hidden, bias=False)
        self.w_up = nn.Linear(d, hidden, bias=False)
        self.w_down = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Router(nn.Module):
    def __init__(self, cfg: DepthscaleConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.moe_experts, cfg.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(cfg.moe_experts))


class Experts(nn.Module):
    def __init__(self, cfg: DepthscaleConfig) -> None:
        super().__init__()
        e, d, f = cfg.moe_experts, cfg.hidden_size, cfg.moe_ffn_dim
        self.w_gate = nn.Parameter(torch.zeros(e, d, f))
        self.w_up = nn.Parameter(torch.zeros(e, d, f))
        self.w_down = nn.Parameter(torch.zeros(e, f, d))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return (F.silu(x @ self.w_gate[e]) * (x @ self.w_up[e])) @ self.w_down[e]


class MoE(nn.Module):
    """Routed experts (top k per token) and shared ones; see the module doc."""

    def __init__(self, cfg: DepthscaleConfig) -> None:
        super().__init__()
        self.top_k, self.gate, self.normalize = cfg.moe_top_k, cfg.moe_gate, cfg.moe_normalize_top_k
        self.router = Router(cfg)
        self.experts = Experts(cfg)
        shared = cfg.moe_shared_experts * cfg.moe_ffn_dim
        self.shared = SwiGLU(cfg, shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        logits = tokens.float() @ self.router.weight.float().t()
        scores = logits.softmax(-1) if self.gate == "softmax" else logits.sigmoid()
        chosen = (scores + self.router.expert_bias.float()).topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        y = torch.zeros(tokens.shape, device=x.device)
        for e in chosen.unique().tolist():
            token, slot = (chosen == e).nonzero(as_tuple=True)
            out = self.experts.expert(e, tokens[token]).float() * weights[token, slot, None]
            y.index_add_(0, token, out)
        y = y.to(x.dtype).view(x.shape)
        return y + self.shared(x) if self.shared is not None else y


class AttnResidual(nn.Module):
    """One sublayer's depth read: a pseudo-query (times a key-norm gain, when trained with one)."""

    def __init__(self, cfg: DepthscaleConfig, ends_block: bool) -> None:
        super().__init__()
        self.ends_block, self.eps = ends_block, cfg.attnres_eps
        self.pseudo_query = nn.Parameter(torch.zeros(cfg.hidden_size))
        self.key_norm = (
            nn.Parameter(torch.ones(cfg.hidden_size)) if cfg.attnres_key_norm_gain else None
        )

    def read(self, sources: list[torch.Tensor]) -> torch.Tensor:
        if len(sources) == 1:
            return sources[0]
        values = torch.stack(sources).float()  # [m, B, T, d]
        query = self.pseudo_query.float()
        if self.key_norm is not None:
            query = query * self.key_norm.float()
        inv_rms = torch.rsqrt(values.pow(2).mean(-1) + self.eps)
        weights = torch.softmax((values @ query) * inv_rms, dim=0)
        return (weights.unsqueeze(-1) * values).sum(0).to(sources[0].dtype)


class Stream:
    """The residual stream of one forward: completed sources and the current block's sum."""

    def __init__(self, embedding: torch.Tensor, attnres: bool) -> None:
        self.attnres = attnres
        self.blocks = [embedding] if attnres else []
        self.partial = None if attnres else embedding

    def sources(self) -> list[torch.Tensor]:
        return self.blocks if self.partial is None else [*self.blocks, self.partial]

    def read(self, residual: AttnResidual | None) -> torch.Tensor:
        return residual.read(self.sources()) if self.attnres else self.partial

    def write(self, residual: AttnResidual | None, y: torch.Tensor) -> None:
        self.partial = y if self.partial is None else self.partial + y
        if residual is not None and residual.ends_block:
            self.blocks.append(self.partial)
            self.partial = None


class Block(nn.Module):
    def __init__(self, cfg: DepthscaleConfig, layer_idx: int) -> None:
        super().__init__()
        self.parallel = cfg.parallel_block
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention = Attention(cfg, layer_idx)
        self.feed_forward = MoE(cfg) if layer_idx in cfg.moe_layers else SwiGLU(cfg)
        blocks = cfg.attnres_blocks

        def residual(sublayer: int) -> AttnResidual | None:
            if cfg.residual == "standard":
                return None
            last = sublayer == len(blocks) - 1 or blocks[sublayer + 1] != blocks[sublayer]
            return AttnResidual(cfg, last)

        if self.parallel:
            self.residual = residual(layer_idx)
        else:
            self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.attention_residual = residual(2 * layer_idx)
            self.ffn_residual = residual(2 * layer_idx + 1)

    def forward(self, stream: Stream, cos, sin, mask, cache) -> None:
        if self.parallel:
            x = self.attention_norm(stream.read(self.residual))
            y = self.attention(x, cos, sin, mask, cache) + self.feed_forward(x)
            stream.write(self.residual, y)
            return
        x = self.attention_norm(stream.read(self.attention_residual))
        stream.write(self.attention_residual, self.attention(x, cos, sin, mask, cache))
        x = self.ffn_norm(stream.read(self.ffn_residual))
        stream.write(self.ffn_residual, self.feed_forward(x))


class DepthscaleForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = DepthscaleConfig
    base_model_prefix = "depthscale"
    _no_split_modules = ["Block"]
    _supports_sdpa = True
    _supports_cache_class = True  # transformers 4.x: hand forward a Cache object, not tuples

    def __init__(self, config: DepthscaleConfig) -> None:
        super().__init__(config)
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        if config.residual != "standard":
            self.output_residual = AttnResidual(config, ends_block=False)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.output = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        """Only for weights a checkpoint lacks: every export holds them all."""
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, 0.0, 0.02)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.tok_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.tok_embeddings = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.output

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.output = value

    def _mask(self, attention_mask, batch: int, q_len: int, past: int, device) -> torch.Tensor:
        """Boolean [B, 1, Tq, Tk] (True = attend): causal by cache index, the sliding window,
        no padded key. Every query keeps its own key, so a padded row attends to something and
        no NaN reaches the values that real rows read."""
        k_len = past + q_len
        q_idx = torch.arange(past, k_len, device=device)[:, None]
        k_idx = torch.arange(k_len, device=device)[None, :]
        allowed = k_idx <= q_idx
        if self.config.attention_window > 0:
            allowed = allowed & (q_idx - k_idx < self.config.attention_window)
        allowed = allowed[None, None].expand(batch, 1, q_len, k_len)
        if attention_mask is not None:
            keys = attention_mask[:, -k_len:].to(torch.bool)[:, None, None, :]
            allowed = allowed & keys
        return allowed | (k_idx == q_idx)[None, None]

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        cache: Cache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        past_key_values = past_key_values if past_key_values is not None else cache
        if inputs_embeds is None:
            inputs_embeds = self.tok_embeddings(input_ids)
        batch, q_len = inputs_embeds.shape[:2]
        device = inputs_embeds.device
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            if attention_mask is not None:  # left padding: positions count real tokens only
                counted = attention_mask.long().cumsum(-1) - 1
                position_ids = counted.clamp(min=0)[:, past : past + q_len]
            else:
                position_ids = torch.arange(past, past + q_len, device=device)[None]
            position_ids = position_ids.expand(batch, q_len)
        # computed here, not kept as a buffer: from_pretrained builds the model on the meta device
        # and fills in only what the checkpoint holds
        angles = position_ids.float()[..., None] * inverse_frequencies(self.config).to(device)
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos(), angles.sin()
        mask = self._mask(attention_mask, batch, q_len, past, device)
        stream = Stream(inputs_embeds, self.config.residual != "standard")
        for layer in self.layers:
            layer(stream, cos, sin, mask, past_key_values if use_cache else None)
        h = stream.read(getattr(self, "output_residual", None))
        keep = slice(-logits_to_keep, None) if logits_to_keep else slice(None)
        logits = self.output(self.norm(h[:, keep]))
        loss = None
        if labels is not None:
            shifted = labels[:, 1:].reshape(-1)
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), shifted)
        cached = {_CACHE_FIELD: past_key_values if use_cache else None}
        return CausalLMOutputWithPast(loss=loss, logits=logits, **cached)
