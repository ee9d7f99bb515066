"""Map between Hugging Face Llama checkpoints and depthscale models.

The model follows HF Llama conventions (rotate-half RoPE, fp32 RMSNorm statistics, SwiGLU, no
biases), so a checkpoint converts by renaming tensors alone: no weight permutation. Only json and
safetensors are needed here; `transformers` is never imported, so conversion works without it.
Anything a depthscale model cannot represent (RoPE scaling other than linear and llama3, biases,
other architectures) and anything HF Llama cannot represent (AttnRes, parallel blocks, sliding
windows) is refused with a `ConfigError` naming the field, rather than converted into a model that
silently computes something else.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from depthscale.config import ModelConfig
from depthscale.errors import CheckpointError, ConfigError
from depthscale.interop import hf_moe
from depthscale.interop.hf_depthscale import (
    MODEL_TYPE,
    hf_dimensions,
    load_exactly,
    load_remote_checkpoint,
    needs_remote_code,
    save_remote_checkpoint,
)
from depthscale.interop.safetensors_shards import DEFAULT_SHARD_BYTES, save_weights
from depthscale.model.transformer import Transformer
from depthscale.shape import ModelShape

__all__ = [
    "config_from_hf",
    "hf_config_from",
    "load_hf_checkpoint",
    "save_hf_checkpoint",
    "state_dict_from_hf",
    "state_dict_to_hf",
]

# Per-layer names: depthscale suffix -> HF suffix (both under the layer prefix).
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w_gate.weight": "mlp.gate_proj.weight",
    "feed_forward.w_up.weight": "mlp.up_proj.weight",
    "feed_forward.w_down.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_FROM_HF_LAYER = {hf: ds for ds, hf in _LAYER_NAMES.items()}
_FROM_HF_TOP = {hf: ds for ds, hf in _TOP_NAMES.items()}
_HF_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_DS_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)")

# HF LlamaConfig defaults, used for keys a config.json leaves out.
_HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
}


# HF rope_type -> model.rope_scaling, and the HF keys of each scaling -> ModelConfig fields.
_ROPE_KINDS = {"default": "none", "linear": "linear", "llama3": "llama3"}
_ROPE_KEYS: dict[str, dict[str, str]] = {
    "linear": {"factor": "rope_scaling_factor"},
    "llama3": {
        "factor": "rope_scaling_factor",
        "low_freq_factor": "rope_low_freq_factor",
        "high_freq_factor": "rope_high_freq_factor",
        "original_max_position_embeddings": "rope_original_max_len",
    },
}


# --------------------------------------------------------------------------------------------
# Configs


def _hf_value(hf_config: Mapping[str, Any], key: str) -> Any:
    """hf_config[key], or HF LlamaConfig's default where the key is missing or null."""
    value = hf_config.get(key)
    return _HF_DEFAULTS[key] if value is None else value


def _rope_parameters(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The RoPE dict transformers 5.x makes of a config.json, wherever the version that wrote it
    put the values: a 4.x `rope_scaling` wins over 5.x `rope_parameters`, and keys it lacks come
    from the top level (`rope_theta`; llama3's `original_max_position_embeddings`, which wins
    when present there and otherwise defaults to `max_position_embeddings`)."""
    params = dict(hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {})
    params.setdefault("rope_type", params.get("type", "default"))
    if params.get("rope_theta") is None:
        params["rope_theta"] = _hf_value(hf_config, "rope_theta")
    if params["rope_type"] == "llama3":
        top_level = hf_config.get("original_max_position_embeddings")
        if top_level is not None:
            params["original_max_position_embeddings"] = top_level
        elif params.get("original_max_position_embeddings") is None:
            params["original_max_position_embeddings"] = _hf_value(
                hf_config, "max_position_embeddings"
            )
    return params


def _rope_number(params: Mapping[str, Any], key: str, kind: type[int] | type[float]) -> int | float:
    """params[key] as `kind`; ints pass as floats (JSON writes 8.0 as 8), nothing else does."""
    value, rope_type = params.get(key), params["rope_type"]
    if value is None:
        raise ConfigError(f"HF config rope_type={rope_type!r} needs RoPE parameter {key}; missing")
    if isinstance(value, bool) or not isinstance(value, kind | int):
        raise ConfigError(
            f"HF config RoPE parameter {key}={value!r} (rope_type={rope_type!r}) must be "
            f"{'an integer' if kind is int else 'a number'}"
        )
    return kind(value)


def _rope_fields(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The ModelConfig RoPE fields of an HF config. Scaling types the model does not implement
    (yarn, dynamic, longrope, ...) are refused, since their logits would differ, and so are
    parameters transformers only warns about (a factor below 1, high_freq_factor not above
    low_freq_factor), which give shrunk, infinite or NaN frequencies."""
    params = _rope_parameters(hf_config)
    rope_type = params["rope_type"]
    if rope_type not in _ROPE_KINDS:
        raise ConfigError(
            f"HF config uses RoPE scaling rope_type={rope_type!r}, which depthscale does not "
            f"implement; allowed: none, {', '.join(map(repr, _ROPE_KINDS))}"
        )
    fields: dict[str, Any] = {"rope_scaling": _ROPE_KINDS[rope_type]}
    for hf_key, field in {"rope_theta": "rope_theta", **_ROPE_KEYS.get(rope_type, {})}.items():
        kind = int if field == "rope_original_max_len" else float
        fields[field] = _rope_number(params, hf_key, kind)
    try:
        ModelConfig(**fields).check_rope()
    except ConfigError as err:
        raise ConfigError(f"HF config RoPE parameters {params}: {err}") from None
    return fields


_HF_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
)
_HF_POSITIVE_FLOATS = ("rms_norm_eps", "initializer_range")


def _check_hf_numbers(hf_config: Mapping[str, Any]) -> None:
    """Sizes are integers >= 1 and eps/init are finite numbers > 0, named by their HF key: a
    config.json that says otherwise would build a model that fails somewhere deep inside."""
    for key in (*_HF_SIZES, "num_key_value_heads", "head_dim"):
        value = hf_config.get(key)
        if value is None and key not in _HF_SIZES:
            continue
        value = _hf_value(hf_config, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"HF config {key}={value!r} is not allowed; allowed: an integer >= 1")
    for key in _HF_POSITIVE_FLOATS:
        value = _hf_value(hf_config, key)
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not (ok and math.isfinite(value) and value > 0):
            raise ConfigError(f"HF config {key}={value!r} is not allowed; allowed: a number > 0")


def _check_hf_heads(dim: int, n_heads: int, n_kv_heads: int) -> None:
    """The head layout a Llama attention can have (transformers fails on the rest, later)."""
    if dim % n_heads or (dim // n_heads) % 2:
        raise ConfigError(
            f"HF config hidden_size={dim} / num_attention_heads={n_heads} is not an even "
            "integer; allowed: an even head size (RoPE rotates pairs)"
        )
    if n_heads % n_kv_heads:
        raise ConfigError(
            f"HF config num_key_value_heads={n_kv_heads} does not divide "
            f"num_attention_heads={n_heads}"
        )


def config_from_hf(hf_config: Mapping[str, Any]) -> ModelConfig:
    """The depthscale `ModelConfig` of an HF Llama `config.json` dict.

    Raises ConfigError (a ValueError) for anything the depthscale model would compute differently
    (RoPE scaling other than linear and llama3, biases, a decoupled head_dim, another activation
    or architecture), because a converted model that loads but gives other logits is worse than
    no conversion.
    """

    def get(key: str) -> Any:
        return _hf_value(hf_config, key)

    model_type = hf_config.get("model_type")
    if model_type not in ("llama", hf_moe.MODEL_TYPE):
        raise ConfigError(
            f"HF config model_type={model_type!r} is not supported; allowed: 'llama', 'mixtral'"
        )
    moe = hf_moe.moe_fields(hf_config) if model_type == hf_moe.MODEL_TYPE else {}
    _check_hf_numbers(hf_config)
    rope = _rope_fields(hf_config)
    for key in ("attention_bias", "mlp_bias"):
        if hf_config.get(key):
            raise ConfigError(f"HF config sets {key}=true; depthscale layers have no biases")
    if get("hidden_act") != "silu":
        raise ConfigError(
            f"HF config hidden_act={get('hidden_act')!r} is not supported; allowed: 'silu'"
        )
    dim, n_heads = get("hidden_size"), get("num_attention_heads")
    n_kv_heads = hf_config.get("num_key_value_heads") or n_heads
    _check_hf_heads(dim, n_heads, n_kv_heads)
    head_dim = hf_config.get("head_dim")
    if head_dim is not None and head_dim * n_heads != dim:
        raise ConfigError(
            f"HF config head_dim={head_dim} differs from hidden_size / num_attention_heads = "
            f"{dim} / {n_heads}; depthscale derives head_dim from dim and n_heads"
        )
    return ModelConfig(
        vocab_size=get("vocab_size"),
        dim=dim,
        n_layers=get("num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ffn_dim=get("intermediate_size"),
        norm_eps=float(get("rms_norm_eps")),
        max_seq_len=get("max_position_embeddings"),
        tie_embeddings=bool(get("tie_word_embeddings")),
        init_std=float(get("initializer_range")),
        residual="standard",
        **rope,
        **moe,
    )


def _check_exportable(cfg: ModelConfig) -> None:
    """HF Llama has no AttnRes, parallel block or sliding window: refuse rather than drop them."""
    if cfg.residual != "standard":
        raise ConfigError(
            f"model.residual={cfg.residual!r} has no Hugging Face Llama counterpart; only "
            "residual='standard' models can be exported"
        )
    if cfg.parallel_block:
        raise ConfigError("model.parallel_block=true has no Hugging Face Llama counterpart")
    if cfg.sliding_window:
        raise ConfigError(
            f"model.sliding_window={cfg.sliding_window} has no Hugging Face Llama counterpart "
            "(Llama attends to the full context)"
        )
    if ModelShape.from_config(cfg).moe:
        hf_moe.check_exportable(cfg)


def hf_config_from(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The HF Llama `config.json` dict of a depthscale `ModelConfig` (inverse of config_from_hf).

    Writes RoPE both in 5.x form (`rope_parameters`) and 4.x form (`rope_theta`, `rope_scaling`)
    so either transformers version reads it. Token ids are null: the model does not know its
    tokenizer (`save_hf_checkpoint` fills them in from the one it is given).
    """
    _check_exportable(cfg)
    if cfg.vocab_size <= 0:
        raise ConfigError("model.vocab_size must be resolved (> 0) before exporting")
    rope_type = {kind: hf for hf, kind in _ROPE_KINDS.items()}[cfg.rope_scaling]
    scaling: dict[str, Any] = {"rope_type": rope_type}
    scaling |= {hf: getattr(cfg, field) for hf, field in _ROPE_KEYS.get(rope_type, {}).items()}
    moe = hf_moe.hf_fields(cfg) if ModelShape.from_config(cfg).moe else {}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **hf_dimensions(cfg),
        "hidden_act": "silu",
        "rope_parameters": scaling | {"rope_theta": cfg.rope_theta},
        "rope_scaling": scaling if cfg.rope_scaling != "none" else None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "use_cache": True,
        "dtype": str(dtype).removeprefix("torch."),
    } | moe


# --------------------------------------------------------------------------------------------
# State dicts


def state_dict_from_hf(
    hf_sd: Mapping[str, Tensor], tie_embeddings: bool = False, cfg: ModelConfig | None = None
) -> dict[str, Tensor]:
    """Rename HF Llama tensors to depthscale names (and Mixtral's experts with `cfg`: `hf_moe`).

    Old checkpoints' `rotary_emb.inv_freq` buffers are dropped (depthscale recomputes RoPE tables).
    Unknown names pass through unchanged so strict loading reports them. With `tie_embeddings`,
    `output.weight` is the embedding, as in HF, which ignores (and often omits) `lm_head.weight`
    when tied.
    """
    out: dict[str, Tensor] = {}
    if cfg is not None and ModelShape.from_config(cfg).moe:
        out, hf_sd = hf_moe.from_hf(hf_sd, cfg)
    for name, tensor in hf_sd.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        match = _HF_LAYER_RE.fullmatch(name)
        if match and match.group(2) in _FROM_HF_LAYER:
            out[f"layers.{match.group(1)}.{_FROM_HF_LAYER[match.group(2)]}"] = tensor
        else:
            out[_FROM_HF_TOP.get(name, name)] = tensor
    if tie_embeddings and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def state_dict_to_hf(sd: Mapping[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Rename depthscale tensors to HF Llama names; drop `output.weight` when tied (HF re-ties
    `lm_head` to the embedding on load, and safetensors refuses shared tensors)."""
    _check_exportable(cfg)
    out: dict[str, Tensor] = {}
    if ModelShape.from_config(cfg).moe:
        out, sd = hf_moe.to_hf(sd, cfg)
    unknown: list[str] = []
    for name, tensor in sd.items():
        if name == "output.weight" and cfg.tie_embeddings:
            continue
        match = _DS_LAYER_RE.fullmatch(name)
        if match and match.group(2) in _LAYER_NAMES:
            out[f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"] = tensor
        elif name in _TOP_NAMES:
            out[_TOP_NAMES[name]] = tensor
        else:
            unknown.append(name)
    if unknown:
        raise ConfigError(f"tensors with no Hugging Face Llama counterpart: {', '.join(unknown)}")
    return out


# --------------------------------------------------------------------------------------------
# Checkpoint directories


def _read_json(file: Path, what: str) -> dict[str, Any]:
    """A JSON object from `file`; anything else there is named with what it should have been."""
    try:
        data = json.loads(file.read_bytes())
    except ValueError as err:  # also UnicodeDecodeError: bytes that are not text
        raise CheckpointError(f"{file} is not valid JSON ({err}); allowed: {what}") from None
    if not isinstance(data, dict):
        raise CheckpointError(
            f"{file} holds a JSON {type(data).__name__}, not an object; allowed: {what}"
        )
    return data


def _read_index(path: Path, index_name: str) -> list[Path]:
    what = 'a shard index {"weight_map": {"tensor name": "shard file", ...}}'
    weight_map = _read_json(path / index_name, what).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{path / index_name} has no weight_map; allowed: {what}")
    return [path / shard for shard in sorted(set(weight_map.values()))]


def _load_file(file: Path) -> dict[str, Tensor]:
    """One weights file, named when it is not what its name says (truncated, another format)."""
    if not file.is_file():
        raise CheckpointError(f"{file}: no such file; allowed: a weights file (safetensors, .bin)")
    if file.suffix == ".safetensors":
        try:
            return load_file(file)
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{file} is not a readable safetensors file ({err})") from None
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # unpickling arbitrary bytes fails in many ways (no code runs)
        reason = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:120]}"
        raise CheckpointError(f"{file} is not a readable PyTorch weights file ({reason})") from None


def _load_weights(path: Path) -> dict[str, Tensor]:
    """All tensors of an HF directory: safetensors (single, indexed shards, or any *.safetensors),
    else pytorch_model.bin (single or indexed), loaded with weights_only=True (no pickled code)."""
    if (path / "model.safetensors.index.json").is_file():
        files = _read_index(path, "model.safetensors.index.json")
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    else:
        files = sorted(path.glob("*.safetensors"))
    if files:
        sd: dict[str, Tensor] = {}
        for file in files:
            sd.update(_load_file(file))
        return sd
    if (path / "pytorch_model.bin.index.json").is_file():
        files = _read_index(path, "pytorch_model.bin.index.json")
    elif (path / "pytorch_model.bin").is_file():
        files = [path / "pytorch_model.bin"]
    if not files:
        raise CheckpointError(
            f"{path} has no weights: expected model.safetensors, model.safetensors.index.json, "
            "*.safetensors or pytorch_model.bin"
        )
    sd = {}
    for file in files:
        sd.update(_load_file(file))
    return sd


def load_hf_checkpoint(path: str | Path) -> Transformer:
    """A depthscale `Transformer` (fp32 parameters) with the weights of an HF Llama directory.

    Loading is strict: a missing or unexpected tensor raises CheckpointError naming them, since a
    partly loaded model would silently keep random weights.
    """
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path} is not a Hugging Face model directory: no config.json")
    config = _read_json(config_file, "a Hugging Face Llama config")
    if config.get("model_type") == MODEL_TYPE:  # our remote-code export of an AttnRes model
        return load_remote_checkpoint(path, config, _load_weights(path))
    try:
        cfg = config_from_hf(config)
    except ConfigError as err:
        raise ConfigError(f"{config_file}: {err}") from None
    model = Transformer(cfg)
    sd = state_dict_from_hf(_load_weights(path), tie_embeddings=cfg.tie_embeddings, cfg=cfg)
    load_exactly(model, sd, path)
    return model


def save_hf_checkpoint(
    model: Transformer,
    path: str | Path,
    token_ids: Mapping[str, int] | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> None:
    """Write `config.json` + `model.safetensors` (shards and their index past `max_shard_bytes`)
    that `LlamaForCausalLM.from_pretrained` loads (a model Llama cannot express: the remote-code
    export of interop/hf_depthscale.py instead);
    with `token_ids` ({"bos_token_id": ..., "eos_token_id": ...}, from the exported tokenizer)
    also in config.json and a generation_config.json, so `generate()` stops at EOS."""
    if needs_remote_code(model.cfg):
        save_remote_checkpoint(model, path, token_ids, max_shard_bytes)
        return
    path = Path(path)
    dtype = model.tok_embeddings.weight.dtype
    config = hf_config_from(model.cfg, dtype) | dict(token_ids or {})
    tensors = state_dict_to_hf(model.state_dict(), model.cfg)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if token_ids:
        generation = {**token_ids, "_from_model_config": True}
        (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tensors = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
    save_weights(tensors, path, max_shard_bytes)
