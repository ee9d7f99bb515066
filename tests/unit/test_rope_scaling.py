"""RoPE frequency scaling (linear, llama3): bit-identical to transformers, checked config fields."""

import pytest
import torch

from depthscale.config import load_config
from depthscale.errors import ConfigError
from depthscale.model.layers import RopeScaling, rope_frequencies

transformers = pytest.importorskip("transformers")
rope_utils = pytest.importorskip("transformers.modeling_rope_utils")

# (head_dim, theta, factor, low_freq_factor, high_freq_factor, original_max_len): Llama 3.1 8B,
# Llama 3.2 1B, and small ones whose bands fall between the few frequencies of a tiny head.
LLAMA3_CASES = [
    (128, 500000.0, 8.0, 1.0, 4.0, 8192),
    (64, 500000.0, 32.0, 1.0, 4.0, 8192),
    (16, 10000.0, 3.5, 0.5, 2.5, 32),
    (8, 123.0, 2.0, 1.0, 4.0, 16),
]


def hf_config(head_dim: int, rope: dict) -> "transformers.LlamaConfig":
    return transformers.LlamaConfig(
        hidden_size=2 * head_dim,
        num_attention_heads=2,
        max_position_embeddings=4 * rope.get("original_max_position_embeddings", 64),
        rope_parameters=rope,
    )


@pytest.mark.parametrize(("head_dim", "theta", "factor", "low", "high", "original"), LLAMA3_CASES)
def test_llama3_frequencies_are_bit_identical_to_transformers(
    head_dim, theta, factor, low, high, original
):
    rope = {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }
    expected, attention_factor = rope_utils._compute_llama3_parameters(hf_config(head_dim, rope))
    ours = rope_frequencies(head_dim, theta, RopeScaling("llama3", factor, low, high, original))
    assert attention_factor == 1.0  # HF does not rescale cos/sin for llama3; neither do we
    assert ours.dtype == torch.float32 and torch.equal(ours, expected)


def test_llama3_bands_of_llama_3_1():
    """head_dim 128, theta 5e5, factor 8: 29 frequencies kept, 6 blended, 29 divided by 8."""
    plain = rope_frequencies(128, 500000.0)
    scaled = rope_frequencies(128, 500000.0, RopeScaling("llama3", 8.0, 1.0, 4.0, 8192))
    kept, divided = scaled == plain, scaled == plain / 8.0
    assert (int(kept.sum()), int((~kept & ~divided).sum()), int(divided.sum())) == (29, 6, 29)
    assert kept[:29].all() and divided[-29:].all()  # high frequencies first


@pytest.mark.parametrize(("head_dim", "theta", "factor"), [(64, 10000.0, 2.0), (16, 1e6, 5.5)])
def test_linear_frequencies_are_bit_identical_to_transformers(head_dim, theta, factor):
    rope = {"rope_type": "linear", "rope_theta": theta, "factor": factor}
    expected, _ = rope_utils._compute_linear_scaling_rope_parameters(hf_config(head_dim, rope))
    assert torch.equal(rope_frequencies(head_dim, theta, RopeScaling("linear", factor)), expected)


def test_no_scaling_is_plain_rope():
    """Llama 3 fields are ignored unless rope_scaling selects them."""
    unused = RopeScaling("none", 8.0, 1.0, 4.0, 16)
    assert torch.equal(rope_frequencies(16, 1e4, unused), rope_frequencies(16, 1e4))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--model.rope_scaling", "yarn"], "model.rope_scaling: 'yarn' is not allowed; allowed: "),
        (["--model.rope_scaling_factor", "0.5"], r"model.rope_scaling_factor=0.5 must be finite"),
        (
            ["--model.rope_low_freq_factor", "4", "--model.rope_high_freq_factor", "4"],
            r"model.rope_low_freq_factor=4.0 and model.rope_high_freq_factor=4.0 must satisfy "
            r"0 < low < high",
        ),
        (["--model.rope_low_freq_factor", "0"], r"rope_low_freq_factor=0.0 and"),
        (["--model.rope_original_max_len", "0"], r"model.rope_original_max_len=0 must be > 0"),
        (["--model.rope_theta", "-1"], r"model.rope_theta=-1.0 must be a finite number > 0"),
    ],
)
def test_bad_rope_config_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["--model.rope_scaling", "llama3", *overrides])


def test_scaled_rope_config_loads():
    cfg = load_config(
        None, ["--model.rope_scaling", "linear", "--model.rope_scaling_factor", "2"]
    ).model
    assert (cfg.rope_scaling, cfg.rope_scaling_factor) == ("linear", 2.0)
