"""Hugging Face export of the architectures `LlamaForCausalLM` cannot express: AttnRes (block,
full), parallel blocks, sliding windows.

Such a model is written as a transformers *remote-code* directory: `config.json` whose `auto_map`
names the classes of `modeling_depthscale.py` (copied beside it: torch and transformers only, no
depthscale), and `model.safetensors` holding depthscale's state dict under its own names. So

    AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)

loads it anywhere, and `load_remote_checkpoint` (`convert hf-to-ds`) reads it back exactly: the
config also carries depthscale's whole `[model]` table. Plain Llama models keep exporting as
`LlamaForCausalLM` (interop/hf_llama.py), which loads without remote code.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from depthscale.config import ModelConfig
from depthscale.errors import CheckpointError, ConfigError
from depthscale.interop import hf_moe
from depthscale.interop.safetensors_shards import DEFAULT_SHARD_BYTES, save_weights
from depthscale.model.residual import block_assignment
from depthscale.model.transformer import Transformer

MODEL_TYPE = "depthscale"
MODELING_FILE = Path(__file__).with_name("hf_remote") / "modeling_depthscale.py"
AUTO_MAP = {
    "AutoConfig": "modeling_depthscale.DepthscaleConfig",
    "AutoModelForCausalLM": "modeling_depthscale.DepthscaleForCausalLM",
}


def needs_remote_code(cfg: ModelConfig) -> bool:
    """Whether plain HF Llama (or Mixtral, for MoE) lacks something this model computes."""
    if cfg.moe_experts and not hf_moe.expressible(cfg):
        return True
    return cfg.residual != "standard" or cfg.parallel_block or cfg.sliding_window > 0


def hf_dimensions(cfg: ModelConfig) -> dict[str, Any]:
    """The sizes every HF decoder config names the same way (Llama's and ours)."""
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
    }


def remote_config(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """config.json of a remote-code export: what modeling_depthscale.DepthscaleConfig reads, plus
    depthscale's `[model]` table for the way back."""
    if cfg.vocab_size <= 0:
        raise ConfigError("model.vocab_size must be resolved (> 0) before exporting")
    attnres = cfg.residual != "standard"
    return {
        "architectures": ["DepthscaleForCausalLM"],
        "model_type": MODEL_TYPE,
        "auto_map": AUTO_MAP,
        **hf_dimensions(cfg),
        "rope_kind": cfg.rope_scaling,
        "rope_factor": cfg.rope_scaling_factor,
        "rope_low_freq_factor": cfg.rope_low_freq_factor,
        "rope_high_freq_factor": cfg.rope_high_freq_factor,
        "rope_original_max_len": cfg.rope_original_max_len,
        "residual": cfg.residual,
        "attnres_blocks": block_assignment(cfg) if attnres else [],
        "attnres_key_norm_gain": cfg.attnres_key_norm_gain,
        "attnres_eps": cfg.attnres_eps,
        "parallel_block": cfg.parallel_block,
        "attention_window": cfg.sliding_window,
        "moe_experts": cfg.moe_experts,
        "moe_top_k": cfg.moe_top_k,
        "moe_ffn_dim": cfg.moe_hidden_dim,
        "moe_shared_experts": cfg.moe_shared_experts,
        "moe_gate": cfg.moe_gate,
        "moe_normalize_top_k": cfg.moe_normalize_top_k,
        "moe_layers": [i for i in range(cfg.n_layers) if cfg.is_moe_layer(i)],
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "use_cache": True,
        "dtype": str(dtype).removeprefix("torch."),
        "depthscale": dataclasses.asdict(cfg),
    }


def save_remote_checkpoint(
    model: Transformer,
    path: str | Path,
    token_ids: Mapping[str, int] | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> None:
    """config.json, modeling_depthscale.py and the safetensors (sharded past `max_shard_bytes`; a
    tied embedding stored twice: safetensors keeps no shared tensors, the remote model ties
    nothing)."""
    path = Path(path)
    dtype = model.tok_embeddings.weight.dtype
    config = remote_config(model.cfg, dtype) | dict(token_ids or {})
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    shutil.copyfile(MODELING_FILE, path / MODELING_FILE.name)
    if token_ids:
        generation = {**token_ids, "_from_model_config": True}
        (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tensors = {n: t.detach().cpu().clone().contiguous() for n, t in model.state_dict().items()}
    save_weights(tensors, path, max_shard_bytes)


def model_config_of(config: Mapping[str, Any], where: Path) -> ModelConfig:
    """The depthscale ModelConfig a remote-code config.json carries."""
    table = config.get("depthscale")
    if not isinstance(table, dict):
        raise CheckpointError(
            f"{where}: a depthscale export whose config has no 'depthscale' table"
        )
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise CheckpointError(f"{where}: unknown depthscale model keys {unknown}")
    try:
        return ModelConfig(**table)
    except TypeError as err:
        raise CheckpointError(f"{where}: {err}") from None


def load_remote_checkpoint(path: Path, config: Mapping[str, Any], weights) -> Transformer:
    """A depthscale Transformer from a remote-code export (`weights`: its tensors by name)."""
    model = Transformer(model_config_of(config, path / "config.json"))
    load_exactly(model, weights, path)
    return model


def load_exactly(model: Transformer, weights: Mapping[str, Any], path: Path) -> None:
    """Every tensor of `model` from `weights`, none left over, shapes equal; else CheckpointError
    naming what differs (a partly loaded model would silently keep random weights)."""
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{path} does not match its config.json: missing tensors {missing or 'none'}; "
            f"unexpected tensors {unexpected or 'none'}"
        )
    try:
        model.load_state_dict(dict(weights), strict=True)
    except RuntimeError as err:  # shape mismatches
        raise CheckpointError(f"{path} does not match its config.json: {err}") from err
