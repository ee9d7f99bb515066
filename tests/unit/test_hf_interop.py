"""HF Llama <-> depthscale conversion: same logits both ways, clear errors for what cannot map."""

import copy
import dataclasses
import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from depthscale.config import ModelConfig, load_config
from depthscale.errors import CheckpointError
from depthscale.interop.hf_llama import (
    config_from_hf,
    hf_config_from,
    load_hf_checkpoint,
    save_hf_checkpoint,
)
from depthscale.interop.run_dir import hf_to_run, load_run, run_to_hf
from depthscale.model.transformer import Transformer

transformers = pytest.importorskip("transformers")

ROPE = {
    "default": {"rope_type": "default", "rope_theta": 500000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
}


def random_weights(model: "transformers.LlamaForCausalLM", seed: int) -> None:
    """Weights and norm gains perturbed so that a swapped tensor changes the logits."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)


def tiny_hf(tied: bool, rope: str = "default") -> "transformers.LlamaForCausalLM":
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=300,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_parameters=copy.deepcopy(ROPE[rope]),
        tie_word_embeddings=tied,
        attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(config).float().eval()
    random_weights(model, 0)
    return model


def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens, use_cache=False).logits


def reference_and_bound(hf, tokens: torch.Tensor) -> tuple[torch.Tensor, float]:
    """HF's float64 logits, and how far an fp32 implementation of the same model may be from them.

    The float64 run of the same weights is the reference (its RMSNorm and RoPE angles still round
    to fp32, as in every implementation here). HF's own fp32 logits miss it by the fp32 rounding
    error of exactly this computation: dims, depth, sequence length. Another order of the same
    operations rounds differently but no worse in kind, so allow twice HF's error (c = 2 for two
    orderings); a wrong frequency or tensor errs by orders of magnitude more (see the tests).
    """
    reference = hf_logits(copy.deepcopy(hf).double(), tokens)
    hf_error = (hf_logits(hf, tokens).double() - reference).abs().max().item()
    return reference, 2 * hf_error


def error(logits: torch.Tensor, reference: torch.Tensor) -> float:
    return (logits.double() - reference).abs().max().item()


@pytest.mark.parametrize("rope", ["default", "linear", "llama3"])
@pytest.mark.parametrize("tied", [True, False])
def test_round_trip_matches_hf_logits(tmp_path, tied, rope):
    hf = tiny_hf(tied, rope)
    hf.save_pretrained(tmp_path / "hf")
    tokens = torch.randint(0, 300, (2, 48))  # past original_max_position_embeddings (16)
    reference, bound = reference_and_bound(hf, tokens)

    model = load_hf_checkpoint(tmp_path / "hf").eval()
    assert model.cfg.tie_embeddings is tied and model.cfg.kv_heads == 2
    assert model.cfg.rope_theta == ROPE[rope]["rope_theta"] and model.cfg.norm_eps == 1e-5
    assert model.cfg.rope_scaling == {"default": "none"}.get(rope, rope)
    assert (model.output.weight is model.tok_embeddings.weight) is tied
    with torch.no_grad():
        assert error(model(tokens), reference) <= bound
        if rope != "default":  # the scaling matters here: plain RoPE is far outside the bound
            plain = Transformer(dataclasses.replace(model.cfg, rope_scaling="none"))
            plain.load_state_dict(model.state_dict())
            assert error(plain.eval()(tokens), reference) > 1e3 * bound

    save_hf_checkpoint(model, tmp_path / "ds")
    assert ("lm_head.weight" in load_file(tmp_path / "ds" / "model.safetensors")) is not tied
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ds").eval()
    assert back.config.tie_word_embeddings is tied
    assert back.config.rope_parameters == hf.config.rope_parameters
    assert torch.equal(hf_logits(back, tokens), hf_logits(hf, tokens))  # same weights and config


def random_llama(seed: int) -> "transformers.LlamaForCausalLM":
    """A random valid small HF Llama: dims, heads, kv heads (a divisor), FFN and vocab sizes, a
    context often below depthscale's defaults (data.seq_len 128), tied or untied embeddings,
    theta, and a RoPE scaling type with random valid parameters."""
    rng = random.Random(seed)
    n_heads, max_len = rng.choice([1, 2, 4]), rng.choice([8, 16, 40, 64, 100, 128, 200, 512])
    kind = rng.choice(["default", "linear", "llama3"])
    rope = {"rope_type": kind, "rope_theta": 10 ** rng.uniform(2, 6)}
    if kind != "default":
        rope["factor"] = rng.uniform(1.0, 16.0)
    if kind == "llama3":
        low = rng.uniform(0.5, 2.0)
        rope |= {
            "low_freq_factor": low,
            "high_freq_factor": low + rng.uniform(0.5, 4.0),
            "original_max_position_embeddings": rng.randint(2, max_len),
        }
    config = transformers.LlamaConfig(
        hidden_size=n_heads * rng.choice([4, 8, 16]),
        num_hidden_layers=rng.randint(1, 3),
        num_attention_heads=n_heads,
        num_key_value_heads=rng.choice([k for k in range(1, n_heads + 1) if n_heads % k == 0]),
        intermediate_size=rng.randint(8, 96),
        vocab_size=rng.randint(32, 400),
        max_position_embeddings=max_len,
        rms_norm_eps=rng.choice([1e-5, 1e-6]),
        tie_word_embeddings=rng.random() < 0.5,
        rope_parameters=rope,
        attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(config).float().eval()
    random_weights(model, seed)
    return model


@pytest.mark.parametrize("seed", range(20))
def test_random_configs_round_trip_through_a_run_dir(tmp_path, seed):
    """HF -> run directory -> HF keeps config and logits exactly; the run's config.toml validates
    as written (its data.seq_len fits the context); the run's model gives HF's logits."""
    hf = random_llama(seed)
    hf.save_pretrained(tmp_path / "hf")
    hf_to_run(tmp_path / "hf", tmp_path / "run")
    cfg = load_config(tmp_path / "run" / "config.toml")
    assert cfg.data.seq_len <= cfg.model.max_seq_len == hf.config.max_position_embeddings

    run_to_hf(tmp_path / "run", tmp_path / "back")
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert back.config.rope_parameters == hf.config.rope_parameters
    assert back.config.tie_word_embeddings == hf.config.tie_word_embeddings
    length = min(hf.config.max_position_embeddings, 48)
    tokens = torch.randint(0, hf.config.vocab_size, (2, length))
    assert torch.equal(hf_logits(back, tokens), hf_logits(hf, tokens))

    model, _ = load_run(tmp_path / "run")
    reference, bound = reference_and_bound(hf, tokens)
    with torch.no_grad():
        assert error(model(tokens), reference) <= bound


def test_sharded_and_bin_checkpoints_load(tmp_path):
    hf = tiny_hf(tied=False)
    tokens = torch.randint(0, 300, (1, 16))
    reference, bound = reference_and_bound(hf, tokens)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    (tmp_path / "bin").mkdir()
    hf.config.to_json_file(tmp_path / "bin" / "config.json")
    torch.save(hf.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    for name in ("sharded", "bin"):
        model = load_hf_checkpoint(tmp_path / name).eval()
        with torch.no_grad():
            assert error(model(tokens), reference) <= bound


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


LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
UNSUPPORTED_ROPE = (
    "which depthscale does not implement; allowed: none, 'default', 'linear', 'llama3'"
)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
            "rope_type='yarn', " + UNSUPPORTED_ROPE,
        ),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type='dynamic', "),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_type='longrope', "),
        (
            {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}},
            "llama3.*needs RoPE parameter factor; missing",
        ),
        ({"rope_scaling": {"type": "linear", "factor": "2"}}, "factor='2' .*must be a number"),
        ({"rope_scaling": {"type": "linear", "factor": True}}, "factor=True .*must be a number"),
        (
            {"rope_scaling": {"type": "linear", "factor": 0.5}},
            "rope_scaling_factor=0.5 must be finite and >= 1",
        ),
        (
            {"rope_scaling": {"type": "linear", "factor": float("inf")}},
            "rope_scaling_factor=inf must be finite",
        ),
        ({"rope_theta": 0, "rope_scaling": None}, "rope_theta=0.0 must be a finite number > 0"),
        (
            {"rope_scaling": {"rope_type": "llama3", **LLAMA3, "high_freq_factor": 1.0}},
            "'high_freq_factor': 1.0.*rope_high_freq_factor=1.0 must satisfy 0 < low < high",
        ),
        (
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    **LLAMA3,
                    "original_max_position_embeddings": 8.5,
                }
            },
            "original_max_position_embeddings=8.5 .*must be an integer",
        ),
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
    assert cfg.rope_scaling == "none"
    assert config_from_hf(json.loads(json.dumps(hf_config_from(cfg)))) == cfg


LLAMA3_FIELDS = {
    "rope_scaling": "llama3",
    "rope_scaling_factor": 8.0,
    "rope_low_freq_factor": 1.0,
    "rope_high_freq_factor": 4.0,
}


@pytest.mark.parametrize(
    ("extra", "fields"),
    [
        (  # transformers 5.x: everything in rope_parameters
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 5e5,
                    **LLAMA3,
                    "original_max_position_embeddings": 8192,
                },
            },
            LLAMA3_FIELDS | {"rope_theta": 5e5, "rope_original_max_len": 8192},
        ),
        (  # 4.x: top-level rope_theta, rope_scaling dict (ints where JSON wrote them so)
            {
                "rope_theta": 500000,
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8,
                    "low_freq_factor": 1,
                    "high_freq_factor": 4,
                    "original_max_position_embeddings": 8192,
                },
            },
            LLAMA3_FIELDS | {"rope_theta": 5e5, "rope_original_max_len": 8192},
        ),
        (  # both: transformers 5.x takes rope_scaling and the top-level theta
            {
                "rope_theta": 1e4,
                "rope_scaling": {"type": "linear", "factor": 2.0},
                "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
            },
            {"rope_scaling": "linear", "rope_scaling_factor": 2.0, "rope_theta": 1e4},
        ),
        (  # llama3 without original_max_position_embeddings: max_position_embeddings, as in HF
            {"max_position_embeddings": 512, "rope_parameters": {"rope_type": "llama3", **LLAMA3}},
            LLAMA3_FIELDS | {"rope_theta": 1e4, "rope_original_max_len": 512},
        ),
    ],
)
def test_rope_scaling_from_either_config_form(extra, fields):
    cfg = config_from_hf(BASE | extra)
    assert {key: getattr(cfg, key) for key in fields} == fields
    assert config_from_hf(json.loads(json.dumps(hf_config_from(cfg)))) == cfg
    assert isinstance(cfg.rope_scaling_factor, float)  # TOML writes 8.0, not 8
    assert isinstance(cfg.rope_original_max_len, int)


@pytest.mark.parametrize("rope", ["default", "linear", "llama3"])
def test_exported_config_reads_the_same_in_transformers(rope):
    """Both the 5.x `rope_parameters` and the 4.x `rope_scaling` of an export name the same RoPE."""
    cfg = config_from_hf(BASE | {"max_position_embeddings": 64, "rope_parameters": ROPE[rope]})
    exported = hf_config_from(cfg)
    assert exported["rope_scaling"] == (
        None if rope == "default" else {k: v for k, v in ROPE[rope].items() if k != "rope_theta"}
    )
    assert transformers.LlamaConfig.from_dict(exported).rope_parameters == ROPE[rope]
