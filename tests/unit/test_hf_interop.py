"""HF Llama <-> depthscale conversion: same logits both ways, clear errors for what cannot map."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from depthscale.config import ModelConfig
from depthscale.errors import CheckpointError, ConfigError
from depthscale.interop.hf_llama import (
    config_from_hf,
    hf_config_from,
    load_hf_checkpoint,
    save_hf_checkpoint,
)
from depthscale.model.transformer import Transformer

transformers = pytest.importorskip("transformers")


def tiny_hf(tied: bool) -> "transformers.LlamaForCausalLM":
    """Random tiny HF Llama; weights and norm gains perturbed so a swapped tensor changes logits."""
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=300,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        tie_word_embeddings=tied,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    return model


def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens, use_cache=False).logits


@pytest.mark.parametrize("tied", [True, False])
def test_round_trip_matches_hf_logits(tmp_path, tied):
    hf = tiny_hf(tied)
    hf.save_pretrained(tmp_path / "hf")
    tokens = torch.randint(0, 300, (2, 24))
    expected = hf_logits(hf, tokens)

    model = load_hf_checkpoint(tmp_path / "hf").eval()
    assert model.cfg.tie_embeddings is tied and model.cfg.kv_heads == 2
    assert model.cfg.rope_theta == 500000.0 and model.cfg.norm_eps == 1e-5
    assert (model.output.weight is model.tok_embeddings.weight) is tied
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), expected, atol=1e-4, rtol=0)

    save_hf_checkpoint(model, tmp_path / "ds")
    assert ("lm_head.weight" in load_file(tmp_path / "ds" / "model.safetensors")) is not tied
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ds").eval()
    assert back.config.tie_word_embeddings is tied
    torch.testing.assert_close(hf_logits(back, tokens), expected, atol=1e-4, rtol=0)


def test_sharded_and_bin_checkpoints_load(tmp_path):
    hf = tiny_hf(tied=False)
    tokens = torch.randint(0, 300, (1, 16))
    expected = hf_logits(hf, tokens)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    (tmp_path / "bin").mkdir()
    hf.config.to_json_file(tmp_path / "bin" / "config.json")
    torch.save(hf.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    for name in ("sharded", "bin"):
        model = load_hf_checkpoint(tmp_path / name).eval()
        with torch.no_grad():
            torch.testing.assert_close(model(tokens), expected, atol=1e-4, rtol=0)


def test_missing_tensor_is_a_clear_error(tmp_path):
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, max_seq_len=16)
    save_hf_checkpoint(Transformer(cfg), tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.0.mlp.up_proj.weight"]
    weights["model.layers.0.extra.weight"] = torch.zeros(1)
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensors \['layers.0.feed_forward.w_up"):
        load_hf_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="unexpected tensors.*extra"):
        load_hf_checkpoint(tmp_path)


BASE = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "vocab_size": 300,
}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "RoPE scaling.*llama3"),
        ({"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}}, "RoPE.*linear"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"head_dim": 32}, "head_dim=32"),
        ({"model_type": "mistral"}, "model_type='mistral'"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ],
)
def test_unsupported_hf_config_is_refused(extra, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf(BASE | extra)


def test_config_round_trip_and_defaults():
    cfg = config_from_hf(BASE | {"rope_scaling": None, "rope_theta": 123.0})
    assert cfg.kv_heads == 4 and cfg.tie_embeddings is False and cfg.rope_theta == 123.0
    assert config_from_hf(json.loads(json.dumps(hf_config_from(cfg)))) == cfg


def test_exporting_attnres_model_is_refused(tmp_path):
    cfg = ModelConfig(
        vocab_size=64,
        dim=32,
        n_layers=2,
        n_heads=2,
        max_seq_len=16,
        residual="block",
        attnres_n_blocks=2,
    )
    with pytest.raises(ConfigError, match="residual='block' has no Hugging Face"):
        save_hf_checkpoint(Transformer(cfg), tmp_path)
    assert not (tmp_path / "config.json").exists()
