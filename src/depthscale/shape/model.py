"""What a model *is*, torch-free: its shapes, block assignment, MoE layers, exact parameter counts
(total and active) and FLOPs, for two families. The model (`model/`), the planner (`plan/`), the
logged MFU (`observe/metrics.py`) and the Hugging Face export read these facts here; nothing
restates them.

- `llama`: depthscale's own block (`model/transformer.py`): RMSNorm, RoPE, grouped-query attention,
  SwiGLU, no biases, and a standard, Block or Full Attention-Residual stream. Counts are exact
  (`tests/unit/test_plan_model.py` checks them against `sum(p.numel())` and `FlopCounterMode`).
- `gpt`: the GPT-3 / Megatron-LM layer of the published tables (Narayanan et al. 2021, Korthikanti
  et al. 2022, MegaScale 2024): learned positions, LayerNorm with biases, full multi-head attention
  with biases, a 4h GELU MLP. Parameters by SC'21 Eq. 2.

The FLOP convention, the one `depthscale plan` predicts with and the trainer logs MFU with:

- a matmul of [M, K] by [K, N] costs 2·M·N·K; every weight matmul counts (attention q/k/v/o,
  the FFN, an MoE layer's router and the k routed and shared experts a token goes through, the
  LM head); the embedding lookup is a gather and costs nothing;
- the attention core (QKᵀ and AV) costs 4·T·K·head_dim per head per sequence forward, with K = T
  keys per query: the **whole** score matrix, masked causal half included — Megatron's Eq. 7,
  PaLM's appendix B, torchtitan, and what `FlopCounterMode` counts for a causal SDPA — so our MFU
  compares with published ones. With a sliding window w < T, K = w. (Counting only the unmasked
  half, (T+1)/2 keys, would read lower by up to a third of the attention share);
- elementwise work (norms, RoPE, softmax, SiLU) and the Attention-Residual depth read (~8·S·d
  FLOPs per token per sublayer over S sources against ~12·d² of matmuls, memory-bound) are not
  counted, so AttnRes changes parameters, never FLOPs;
- backward costs twice the forward. Model FLOPs exclude recomputation (MFU's numerator);
  hardware FLOPs include it (HFU's numerator).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from depthscale.errors import ConfigError

Family = Literal["llama", "gpt"]

ELEMENTWISE_PASSES = 2.0
"""Memory-bound traffic of a forward per byte it keeps for backward (each written once, read once
by the next op); backward moves twice the forward's. The planner charges elementwise time with it
and the calibration (`parallel/calibrate.py`) times the same bytes, so both read it here."""

EXPERTS_KEY = "model.moe_experts"
"""The config key of the routed experts per MoE layer, as `from_config` reads it and the rules
(`shape/layout.py`) name it."""


@dataclass(frozen=True)
class ModelShape:
    n_layers: int
    dim: int
    n_heads: int
    kv_heads: int
    ffn_dim: int
    vocab: int
    family: Family = "llama"
    residual: str = "standard"
    blocks: tuple[int, ...] = ()
    """Block index of every sublayer (AttnRes); empty for the standard residual."""
    parallel_block: bool = False
    sliding_window: int = 0
    tie_embeddings: bool = True
    key_norm_gain: bool = True
    max_positions: int = 0
    """gpt: learned position embeddings (SC'21 counts them with s = sequence length)."""
    n_experts: int = 0
    """Mixture of Experts (`model/moe.py`): routed experts of each MoE layer (0: dense)."""
    moe_top_k: int = 0
    moe_ffn: int = 0
    """One expert's hidden size."""
    moe_shared: int = 0
    moe_layers: tuple[int, ...] = ()
    """The layers whose FFN is MoE."""
    moe_balance_loss: bool = False
    """The load-balancing auxiliary loss is computed (`moe_balance = "aux_loss"`, coefficient > 0)."""
    moe_z_loss: bool = False
    """The router z-loss is computed (`moe_z_loss` > 0)."""
    moe_normalize: bool = True
    """Each token's top-k weights are renormalised (`moe_normalize_top_k`)."""
    name: str = ""

    @classmethod
    def from_config(cls, cfg: Any, name: str = "") -> ModelShape:
        """Our model as `Transformer(cfg)` builds it (`cfg`: a `config.ModelConfig`, which this
        room does not import)."""
        n_sub = cfg.n_sublayers
        moe = {}
        if cfg.moe_experts:
            moe = dict(
                n_experts=cfg.moe_experts,
                moe_top_k=cfg.moe_top_k,
                moe_ffn=cfg.moe_hidden_dim,
                moe_shared=cfg.moe_shared_experts,
                moe_layers=moe_layers(cfg.n_layers, cfg.moe_first_dense, cfg.moe_every),
                moe_balance_loss=cfg.moe_balance == "aux_loss" and cfg.moe_aux_loss > 0,
                moe_z_loss=cfg.moe_z_loss > 0,
                moe_normalize=cfg.moe_normalize_top_k,
            )
        blocks = ()
        if cfg.residual != "standard":
            blocks = tuple(
                block_assignment(cfg.residual, n_sub, cfg.attnres_block_size, cfg.attnres_n_blocks)
            )
        return cls(
            n_layers=cfg.n_layers,
            dim=cfg.dim,
            n_heads=cfg.n_heads,
            kv_heads=cfg.kv_heads,
            ffn_dim=cfg.hidden_dim,
            vocab=cfg.vocab_size,
            residual=cfg.residual,
            blocks=blocks,
            parallel_block=cfg.parallel_block,
            sliding_window=cfg.sliding_window,
            tie_embeddings=cfg.tie_embeddings,
            key_norm_gain=cfg.attnres_key_norm_gain,
            name=name,
            **moe,
        )

    @classmethod
    def gpt(
        cls, n_layers: int, dim: int, n_heads: int, vocab: int, seq_len: int, name: str = ""
    ) -> ModelShape:
        """A GPT-3-style model (Megatron-LM): 4h GELU MLP, MHA, learned positions, untied head
        counted once (Megatron ties the output layer to the input embedding)."""
        return cls(
            n_layers=n_layers,
            dim=dim,
            n_heads=n_heads,
            kv_heads=n_heads,
            ffn_dim=4 * dim,
            vocab=vocab,
            family="gpt",
            max_positions=seq_len,
            name=name,
        )

    def with_(self, **changes) -> ModelShape:
        return replace(self, **changes)

    # -- shapes -----------------------------------------------------------------------------

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def n_sublayers(self) -> int:
        return self.n_layers * (1 if self.parallel_block else 2)

    @property
    def attnres(self) -> bool:
        return self.residual != "standard"

    @property
    def n_blocks(self) -> int:
        """Depth sources at the end: b_0 (the embedding) plus one per block."""
        return 1 + (self.blocks[-1] + 1 if self.blocks else 0)

    # -- parameters ---------------------------------------------------------------------------

    def layer_params(self, layer: int | None = None) -> int:
        """Parameters of layer `layer` (None: a dense layer); an MoE layer counts its router,
        every routed expert and the shared experts."""
        d, f = self.dim, self.ffn_dim
        if self.family == "gpt":
            return 12 * d * d + 13 * d  # SC'21: QKV+O 4h²+4h, MLP 8h²+5h, two LayerNorms 4h
        attention = 2 * d * d + 2 * d * self.kv_dim  # wq, wo; wk, wv
        norms = d if self.parallel_block else 2 * d
        residual = self.sublayers_per_layer * self._residual_params()
        ffn = 3 * d * f
        if layer in self.moe_layers:
            ffn = d * self.n_experts + 3 * d * self.moe_ffn * (self.n_experts + self.moe_shared)
        return attention + ffn + norms + residual

    @property
    def moe(self) -> bool:
        return self.n_experts > 0

    @property
    def moe_aux(self) -> bool:
        """An auxiliary loss is computed (balance or z-loss): under cp/tp its counts are summed
        over the ranks holding the rows' other tokens."""
        return self.moe_balance_loss or self.moe_z_loss

    def expert_params(self, layer: int) -> int:
        """Parameters of layer `layer`'s routed experts (0 in a dense layer)."""
        if layer not in self.moe_layers:
            return 0
        return 3 * self.dim * self.moe_ffn * self.n_experts

    @property
    def sublayers_per_layer(self) -> int:
        return 1 if self.parallel_block else 2

    def _residual_params(self) -> int:
        """An AttnResidual: a pseudo-query (d) and its key-norm gain (d)."""
        if not self.attnres:
            return 0
        return self.dim * (2 if self.key_norm_gain else 1)

    def embedding_params(self) -> int:
        return self.vocab * self.dim + self.max_positions * self.dim

    def head_params(self) -> int:
        """Final norm, the AttnRes output read and, untied, the LM head."""
        if self.family == "gpt":
            return 0  # SC'21's count (final LayerNorm left out; the head is tied)
        head = 0 if self.tie_embeddings else self.vocab * self.dim
        return self.dim + self._residual_params() + head

    def params(self) -> int:
        layers = sum(self.layer_params(i) for i in range(self.n_layers))
        return self.embedding_params() + layers + self.head_params()

    def idle_params(self) -> int:
        """Parameters a token does not use: in every MoE layer, the routed experts it is not
        sent to."""
        return (
            len(self.moe_layers) * (self.n_experts - self.moe_top_k) * 3 * self.dim * self.moe_ffn
        )

    def active_params(self) -> int:
        """Parameters a token uses: an MoE layer's router, k routed and the shared experts."""
        return self.params() - self.idle_params()

    # -- FLOPs (forward, per sequence of `seq` tokens) --------------------------------------

    def layer_matmul_flops(self, seq: int, layer: int | None = None) -> float:
        """Forward FLOPs of one layer's weight matmuls for one sequence (an MoE layer: the
        router, and the k routed and shared experts each token goes through)."""
        d, f = self.dim, self.ffn_dim
        if self.family == "gpt":
            return 2.0 * seq * (12 * d * d)
        ffn = 3 * d * f
        if layer in self.moe_layers:
            ffn = d * self.n_experts + 3 * d * self.moe_ffn * (self.moe_top_k + self.moe_shared)
        return 2.0 * seq * (2 * d * d + 2 * d * self.kv_dim + ffn)

    def attention_flops(self, seq: int) -> float:
        """Forward FLOPs of one layer's attention core (QKᵀ and AV) for one sequence: the full
        T × T score matrix (Megatron / PaLM / FlopCounterMode), or T × window with a window."""
        keys = seq if not self.sliding_window or self.sliding_window >= seq else self.sliding_window
        return 4.0 * seq * keys * self.dim

    def logits_flops(self, seq: int) -> float:
        return 2.0 * seq * self.dim * self.vocab

    def forward_flops(self, seq: int) -> float:
        """Model forward FLOPs per sequence (matmuls, attention, LM head)."""
        matmuls = sum(self.layer_matmul_flops(seq, i) for i in range(self.n_layers))
        return matmuls + self.n_layers * self.attention_flops(seq) + self.logits_flops(seq)

    def model_flops(self, seq: int) -> float:
        """Training FLOPs per sequence without recomputation (MFU's numerator): 3× forward."""
        return 3.0 * self.forward_flops(seq)

    def recompute_flops(self, seq: int, recompute: str) -> float:
        """Forward FLOPs per sequence that a recompute mode runs again in backward: `full` and
        `sublayer` re-run every layer's matmuls and attention; our `selective` keeps those outputs
        and re-runs memory-bound ops only; Megatron's selective re-runs the attention core."""
        if recompute in ("full", "sublayer"):
            return self.n_layers * (self.layer_matmul_flops(seq) + self.attention_flops(seq))
        if recompute == "selective" and self.family == "gpt":
            return self.n_layers * self.attention_flops(seq)
        return 0.0

    def hardware_flops(self, seq: int, recompute: str) -> float:
        """Training FLOPs per sequence including recomputation (HFU's numerator)."""
        return self.model_flops(seq) + self.recompute_flops(seq, recompute)

    def model_flops_per_token(self, seq: int) -> float:
        """Training FLOPs per token of sequences of `seq` tokens, without recomputation: what a
        logged MFU and the planner's MFU both divide by the peak."""
        return self.model_flops(seq) / seq

    def hardware_flops_per_token(self, seq: int, recompute: str) -> float:
        """Training FLOPs per token including what `recompute` runs again (HFU)."""
        return self.hardware_flops(seq, recompute) / seq

    def flop_formula(self) -> str:
        if self.family == "gpt":
            return "72·B·L·s·h²·(1 + s/(6h) + V/(12·h·L)) (Korthikanti Eq. 7)"
        return (
            "3 × [L·(2·s·(2d² + 2·d·d_kv + 3·d·f) + 4·s·s_att·d) + 2·s·d·V] per sequence "
            "(matmuls 2·M·N·K, full score matrix)"
        )


def block_assignment(residual: str, n_sublayers: int, block_size: int, n_blocks: int) -> list[int]:
    """Block index of every sublayer. Full AttnRes: one block each; standard: one block for all;
    Block AttnRes with block size S: consecutive groups of S, the last may be shorter; with N
    blocks: S = L // N and leftover sublayers join the last block."""
    n = n_sublayers
    if residual == "full":
        return list(range(n))
    if residual == "standard":
        return [0] * n
    if block_size:
        return [t // block_size for t in range(n)]
    if not 1 <= n_blocks <= n:  # also reached by models built without Config.validate()
        raise ConfigError(
            f"model.attnres_n_blocks={n_blocks} must be in 1..{n} (the number of sublayers)"
        )
    size = n // n_blocks
    return [min(t // size, n_blocks - 1) for t in range(n)]


def is_moe_layer(layer: int, n_experts: int, first_dense: int, every: int) -> bool:
    """Whether layer `layer` has a Mixture-of-Experts FFN: MoE models keep their first
    `first_dense` layers dense, then every `every`-th layer is MoE."""
    k = layer - first_dense
    return n_experts > 0 and k >= 0 and k % every == 0


def moe_layers(n_layers: int, first_dense: int, every: int) -> tuple[int, ...]:
    """The MoE layers of an MoE model of `n_layers` layers (`is_moe_layer`)."""
    return tuple(i for i in range(n_layers) if is_moe_layer(i, 1, first_dense, every))
