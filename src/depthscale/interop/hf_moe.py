"""Hugging Face Mixtral ↔ depthscale MoE models (`model/moe.py`), on top of the Llama mapping.

Mixtral is Llama with every FFN a Mixture of Experts: softmax router (`block_sparse_moe.gate`), the
top-k weights renormalised, experts `w2(silu(w1 x) · w3 x)`, no shared experts. A depthscale model
with `residual='standard'`, MoE on every layer, softmax gating with normalised top-k and no
shared experts or balancing bias computes exactly that. The checkpoint format is the hub's (what
`save_pretrained` writes in transformers 4 and 5): one `w1/w2/w3` per expert, [out, in]; here the
experts are stacked [E, in, out], so each converts by a transpose. Anything else is refused with
a ConfigError naming the setting (a model that loads but routes differently is worse than none).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from depthscale.config import ModelConfig
from depthscale.errors import ConfigError
from depthscale.shape import ModelShape

MODEL_TYPE = "mixtral"
_EXPERT_RE = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")
_ROUTER_RE = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.gate\.weight")
_OURS = {"w1": "w_gate", "w3": "w_up", "w2": "w_down"}
_THEIRS = {ours: theirs for theirs, ours in _OURS.items()}


def moe_fields(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The `ModelConfig` MoE fields of a Mixtral config.json (the rest is Llama's)."""
    if hf_config.get("sliding_window"):
        raise ConfigError(
            f"HF config sliding_window={hf_config['sliding_window']}: Mistral-style windows are "
            "not converted; allowed: null"
        )
    experts = hf_config.get("num_local_experts", 8)
    top_k = hf_config.get("num_experts_per_tok", 2)
    return {
        "moe_experts": experts,
        "moe_top_k": top_k,
        "moe_ffn_dim": hf_config.get("intermediate_size", 14336),
        "moe_gate": "softmax",
        "moe_normalize_top_k": True,
        "moe_balance": "aux_loss",
        "moe_aux_loss": float(hf_config.get("router_aux_loss_coef", 0.001)),
    }


def check_exportable(cfg: ModelConfig) -> None:
    """What Mixtral cannot express, refused by name."""
    refusals = {
        "model.moe_gate='sigmoid'": cfg.moe_gate != "softmax",
        "model.moe_normalize_top_k=false": not cfg.moe_normalize_top_k,
        f"model.moe_shared_experts={cfg.moe_shared_experts}": cfg.moe_shared_experts > 0,
        "model.moe_balance='bias' (the bias changes which experts are chosen)": cfg.moe_balance
        == "bias",
        f"model.moe_first_dense={cfg.moe_first_dense}": cfg.moe_first_dense > 0,
        f"model.moe_every={cfg.moe_every}": cfg.moe_every > 1,
    }
    named = [what for what, refused in refusals.items() if refused]
    if named:
        raise ConfigError(
            f"{', '.join(named)} has no Mixtral counterpart; Mixtral is every layer MoE, softmax "
            "routing with normalised top-k, no shared experts"
        )


def expressible(cfg: ModelConfig) -> bool:
    """Whether Mixtral computes this MoE model (else it exports as remote code)."""
    try:
        check_exportable(cfg)
    except ConfigError:
        return False
    return True


def hf_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The Mixtral config.json keys that differ from the Llama export's."""
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": MODEL_TYPE,
        "intermediate_size": cfg.moe_hidden_dim,
        "num_local_experts": cfg.moe_experts,
        "num_experts_per_tok": cfg.moe_top_k,
        "router_aux_loss_coef": cfg.moe_aux_loss,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
        "sliding_window": None,
    }


def from_hf(hf_sd: Mapping[str, Tensor], cfg: ModelConfig) -> tuple[dict[str, Tensor], dict]:
    """(depthscale tensors of the routers and stacked experts, the HF tensors left for the Llama
    mapping). Each layer's router bias (aux-loss-free balancing; Mixtral has none) is zero."""
    n = ModelShape.from_config(cfg).n_experts
    experts: dict[tuple[int, str], dict[int, Tensor]] = {}
    out: dict[str, Tensor] = {}
    rest = {}
    for name, tensor in hf_sd.items():
        if m := _EXPERT_RE.fullmatch(name):
            experts.setdefault((int(m.group(1)), m.group(3)), {})[int(m.group(2))] = tensor
        elif m := _ROUTER_RE.fullmatch(name):
            out[f"layers.{m.group(1)}.feed_forward.router.weight"] = tensor
            out[f"layers.{m.group(1)}.feed_forward.router.expert_bias"] = torch.zeros(n)
        else:
            rest[name] = tensor
    for (layer, w), by_expert in experts.items():
        if sorted(by_expert) != list(range(n)):
            missing = sorted(set(range(n)) - set(by_expert))
            raise ConfigError(f"layer {layer} {w}: experts {missing} missing from the checkpoint")
        stacked = torch.stack([by_expert[e].t() for e in range(n)])
        out[f"layers.{layer}.feed_forward.experts.{_OURS[w]}"] = stacked
    return out, rest


def to_hf(sd: Mapping[str, Tensor], cfg: ModelConfig) -> tuple[dict[str, Tensor], dict]:
    """(HF tensors of the routers and per-expert weights, the depthscale tensors left for the
    Llama mapping)."""
    out: dict[str, Tensor] = {}
    rest = {}
    for name, tensor in sd.items():
        m = re.fullmatch(r"layers\.(\d+)\.feed_forward\.(.+)", name)
        key = m.group(2) if m else None
        if key == "router.weight":
            out[f"model.layers.{m.group(1)}.block_sparse_moe.gate.weight"] = tensor
        elif key == "router.expert_bias":
            continue  # zero unless moe_balance='bias', which check_exportable refused
        elif key in ("experts.w_gate", "experts.w_up", "experts.w_down"):
            w = _THEIRS[key.removeprefix("experts.")]
            for e in range(tensor.shape[0]):
                prefix = f"model.layers.{m.group(1)}.block_sparse_moe.experts.{e}"
                out[f"{prefix}.{w}.weight"] = tensor[e].t().contiguous()
        else:
            rest[name] = tensor
    return out, rest
