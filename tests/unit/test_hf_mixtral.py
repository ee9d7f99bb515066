"""HF Mixtral <-> depthscale MoE models (`interop/hf_moe.py`): the same logits both ways, a run
directory's MoE model exported as Mixtral, what Mixtral cannot express refused by name."""

import copy
import json

import pytest
import torch
from test_hf_interop import error, random_weights, reference_and_bound

from depthscale.config import ModelConfig
from depthscale.errors import ConfigError
from depthscale.interop.hf_llama import config_from_hf, load_hf_checkpoint, save_hf_checkpoint
from depthscale.model.transformer import Transformer

transformers = pytest.importorskip("transformers")


def tiny_mixtral(seed: int = 0) -> "transformers.MixtralForCausalLM":
    config = transformers.MixtralConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=24, vocab_size=96, max_position_embeddings=64, num_local_experts=4,
        num_experts_per_tok=2, rms_norm_eps=1e-5, tie_word_embeddings=False,
        attn_implementation="sdpa", experts_implementation="eager",  # eager: float64 runs too
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(config).float().eval()
    random_weights(model, seed)
    return model


def _no_near_tie(hf, tokens: torch.Tensor) -> None:
    """The fixture's routing is decided by a margin fp32 cannot flip: every token's k-th and
    (k+1)-th router probabilities differ by more than 1e-4, ~1000× the fp32 rounding of a score
    computed from 32-wide dot products (2·32·2^-24 relative)."""
    captured = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda m, i, o: captured.append(o))
        for layer in hf.model.layers
    ]
    with torch.no_grad():
        hf(tokens)
    for h in hooks:
        h.remove()
    for logits in captured:
        top = (logits[0] if isinstance(logits, tuple) else logits).float().softmax(-1)
        top = top.sort(-1, descending=True).values
        assert (top[..., 1] - top[..., 2]).min() > 1e-4, "the fixture has a near tie"


def test_mixtral_imports_and_exports_with_its_logits(tmp_path):
    hf = tiny_mixtral(5)  # weights and tokens drawn so that no routing is a near tie
    hf.save_pretrained(tmp_path / "hf")
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(3))
    _no_near_tie(hf, tokens)
    reference, bound = reference_and_bound(hf, tokens)
    model = load_hf_checkpoint(tmp_path / "hf").eval()
    cfg = model.cfg
    assert (cfg.moe_experts, cfg.moe_top_k, cfg.moe_ffn_dim, cfg.moe_gate) == (4, 2, 24, "softmax")
    with torch.no_grad():
        assert error(model(tokens), reference) <= bound
        # the experts matter: swapping two of one layer's experts moves the logits far out
        swapped = copy.deepcopy(model)
        w = swapped.layers["0"].feed_forward.experts.w_up
        w.data[[0, 1]] = w.data[[1, 0]]
        assert error(swapped(tokens), reference) > 1e3 * bound
    save_hf_checkpoint(model, tmp_path / "back")
    again = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "back").float().eval()
    with torch.no_grad():
        logits = again(input_ids=tokens).logits
    assert error(logits, reference) <= bound


def test_what_mixtral_cannot_express_exports_as_remote_code(tmp_path):
    """Mixtral refuses, by name, what it does not compute; such a model (and any AttnRes MoE
    model) exports as depthscale's remote-code model instead (its logits: test_hf_remote.py)."""
    from depthscale.interop import hf_moe
    from depthscale.interop.hf_depthscale import MODEL_TYPE

    base = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, moe_experts=4, moe_top_k=2)
    for extra, message in [
        ({"moe_gate": "sigmoid"}, "moe_gate='sigmoid'"),
        ({"moe_shared_experts": 1}, "moe_shared_experts=1"),
        ({"moe_balance": "bias"}, "moe_balance='bias'"),
        ({"moe_first_dense": 1}, "moe_first_dense=1"),
    ]:
        cfg = ModelConfig(**base, **extra)
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            hf_moe.check_exportable(cfg)
        save_hf_checkpoint(Transformer(cfg), tmp_path / message)
        config = json.loads((tmp_path / message / "config.json").read_text())
        assert config["model_type"] == MODEL_TYPE and config["moe_experts"] == 4
    with pytest.raises(ConfigError, match="sliding_window=4096"):
        config_from_hf({"model_type": "mixtral", "sliding_window": 4096})
