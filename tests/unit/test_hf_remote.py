"""Remote-code Hugging Face export of every architecture Llama lacks (AttnRes block and full,
parallel blocks, sliding windows, with tied embeddings, GQA and RoPE scaling, an AttnRes MoE): transformers loads
each directory with `trust_remote_code=True` in a fresh process that cannot import depthscale, and
its logits (plain, and of a left-padded batch) and greedy generations equal depthscale's."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from depthscale.config import ModelConfig
from depthscale.errors import ConfigError
from depthscale.interop.hf_depthscale import MODEL_TYPE
from depthscale.interop.hf_llama import hf_config_from, load_hf_checkpoint, save_hf_checkpoint
from depthscale.interop.safetensors_shards import parse_size
from depthscale.model.generate import generate
from depthscale.model.transformer import Transformer
from tolerances import fp32_model_bound

pytest.importorskip("transformers")

ARCHITECTURES = {
    "block": {"residual": "block", "attnres_n_blocks": 2},
    "full, key-norm gain": {"residual": "full", "attnres_key_norm_gain": True},
    "parallel block, block AttnRes": {
        "parallel_block": True,
        "residual": "block",
        "attnres_n_blocks": 2,
    },
    "parallel block": {"parallel_block": True},
    "sliding window": {"sliding_window": 4},
    "block, window, tied, GQA, llama3 RoPE": {
        **{"residual": "block", "attnres_n_blocks": 3, "sliding_window": 6},
        **{"tie_embeddings": True, "n_kv_heads": 2, "rope_scaling": "llama3"},
        **{"rope_scaling_factor": 8.0, "rope_original_max_len": 16},
    },
    "block, sharded": {"residual": "block", "attnres_n_blocks": 2},
    "block AttnRes MoE: sigmoid, shared, bias, first dense": {
        **{"residual": "block", "attnres_n_blocks": 2, "moe_experts": 4, "moe_top_k": 2},
        **{"moe_ffn_dim": 24, "moe_shared_experts": 1, "moe_gate": "sigmoid"},
        **{"moe_balance": "bias", "moe_first_dense": 1},
    },
}
SHARD_BYTES = {"block, sharded": 20_000}
"""Exports written in shards of at most this many bytes (an index maps tensors to files)."""
VOCAB, PAD, PROMPT, NEW = 64, 4, 6, 10

# What the fresh process does with each export: depthscale is made unimportable first, so the
# modeling file must stand alone.
LOADER = """
import json, sys, torch
sys.modules["depthscale"] = None
from transformers import AutoModelForCausalLM
root = sys.argv[1]
cases = json.load(open(root + "/cases.json"))
out = {}
for name in cases:
    model = AutoModelForCausalLM.from_pretrained(root + "/" + name, trust_remote_code=True).eval()
    inputs = torch.load(root + "/inputs.pt")
    with torch.no_grad():
        plain = model(inputs["tokens"], use_cache=False).logits
        padded = model(inputs["padded"], attention_mask=inputs["mask"], use_cache=False).logits
    greedy = model.generate(inputs["prompt"], max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    batch = model.generate(
        inputs["batch"], attention_mask=inputs["batch_mask"], max_new_tokens=NEW,
        do_sample=False, pad_token_id=0,
    )
    out[name] = {"plain": plain, "padded": padded, "greedy": greedy, "batch": batch,
                 "class": type(model).__name__}
torch.save(out, root + "/out.pt")
""".replace("NEW", str(NEW))


def _model(arch: dict, seed: int) -> Transformer:
    """Random weights large enough that greedy decoding has clear margins, depth softmaxes that
    are far from uniform, and norm gains that are not all one."""
    torch.manual_seed(seed)
    cfg = ModelConfig(dim=32, n_layers=3, n_heads=4, vocab_size=VOCAB, max_seq_len=64, **arch)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("pseudo_query"):
                p.normal_(0.0, 1.0)
            elif p.ndim == 1:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.3)
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):  # the balancing bias decides routing: it must travel
                b.normal_(0.0, 0.2)
    return model


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Every architecture exported, then loaded and run by transformers in one fresh process."""
    root = tmp_path_factory.mktemp("remote")
    models = {name: _model(arch, seed) for seed, (name, arch) in enumerate(ARCHITECTURES.items())}
    for name, model in models.items():
        shards = {"max_shard_bytes": SHARD_BYTES[name]} if name in SHARD_BYTES else {}
        save_hf_checkpoint(model, root / name, {"bos_token_id": 1, "eos_token_id": 2}, **shards)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, VOCAB, (2, 16), generator=g)
    padded, mask = tokens.clone(), torch.ones_like(tokens)
    padded[0, :PAD], mask[0, :PAD] = 0, 0  # row 0: four pads on the left, then 12 tokens
    prompt = tokens[:1, :PROMPT]
    # two prompts of 6 and 10 tokens, the shorter padded on the left
    batch = torch.cat(
        [
            torch.cat([torch.zeros(1, PAD, dtype=tokens.dtype), prompt], 1),
            tokens[1:, : PAD + PROMPT],
        ]
    )
    batch_mask = (torch.arange(PAD + PROMPT) >= torch.tensor([[PAD], [0]])).long()
    inputs = {"tokens": tokens, "padded": padded, "mask": mask, "prompt": prompt}
    torch.save(inputs | {"batch": batch, "batch_mask": batch_mask}, root / "inputs.pt")
    (root / "cases.json").write_text(json.dumps(list(models)))
    env = dict(os.environ, HF_HOME=str(root / "hf_home"), HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-c", LOADER, str(root)], env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return models, torch.load(root / "out.pt"), root


def _reference_and_bound(model: Transformer, tokens: torch.Tensor) -> tuple[torch.Tensor, float]:
    """depthscale's float64 logits, and twice its own fp32 error against them: another fp32
    evaluation order of the same computation errs no worse in kind (tests/unit/test_hf_interop.py
    derives its bound the same way)."""
    with torch.no_grad():
        reference = copy.deepcopy(model).double()(tokens)
        bound = 2 * (model(tokens).double() - reference).abs().max().item()
    if model.cfg.moe_experts:
        # the experts' grouped GEMM here and the modeling file's per-expert loop add in orders
        # further apart than two evaluations of the dense layers: the forward's derived fp32
        # bound (tests/tolerances.py) instead, relative to the logits — a routing that differed
        # would move a token's logits by orders of magnitude more
        derived = fp32_model_bound(model.cfg, tokens.shape[1], tokens.shape[0], backward=False)
        bound = max(bound, derived * reference.abs().max().item())
    return reference, bound


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_transformers_computes_depthscales_logits(exported, name):
    models, out, _ = exported
    model, result = models[name], out[name]
    assert result["class"] == "DepthscaleForCausalLM"
    tokens = torch.load(exported[2] / "inputs.pt")["tokens"]
    reference, bound = _reference_and_bound(model, tokens)
    assert (result["plain"].double() - reference).abs().max().item() <= bound
    # the padded row's real tokens, with positions counted from its first real token, are the
    # same 12 tokens run alone
    alone, bound = _reference_and_bound(model, tokens[:1, PAD:])
    assert (result["padded"][:1, PAD:].double() - alone).abs().max().item() <= bound
    assert (result["padded"][1:].double() - reference[1:]).abs().max().item() <= 2 * bound + 1e-6


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_greedy_generation_is_token_for_token_depthscales(exported, name):
    models, out, root = exported
    model, result = models[name], out[name]
    inputs = torch.load(root / "inputs.pt")
    with torch.no_grad():
        ours = generate(model, inputs["prompt"], NEW, temperature=0)
    assert torch.equal(result["greedy"], ours)
    # a left-padded batch: each prompt continues as it does alone
    for row, mask, got in zip(inputs["batch"], inputs["batch_mask"], result["batch"], strict=True):
        prompt = row[mask.bool()][None]
        with torch.no_grad():
            alone = generate(model, prompt, NEW, temperature=0)[0, prompt.shape[1] :]
        assert torch.equal(got[-NEW:], alone)


def test_the_export_reads_back_exactly_and_plain_llama_stays_plain(exported, tmp_path):
    models, _, root = exported
    tokens = torch.load(root / "inputs.pt")["tokens"]
    for name, model in models.items():
        config = json.loads((root / name / "config.json").read_text())
        assert config["model_type"] == MODEL_TYPE and "auto_map" in config
        assert (root / name / "modeling_depthscale.py").is_file()
        index = root / name / "model.safetensors.index.json"
        assert index.is_file() is (name in SHARD_BYTES)
        if name in SHARD_BYTES:
            files = set(json.loads(index.read_text())["weight_map"].values())
            assert len(files) > 3 and all(
                (root / name / f).stat().st_size < 2 * 20_000 for f in files
            )
        back = load_hf_checkpoint(root / name).eval()
        assert back.cfg == model.cfg
        assert (back.output.weight is back.tok_embeddings.weight) is model.cfg.tie_embeddings
        with torch.no_grad():
            assert torch.equal(back(tokens), model(tokens))
    plain = Transformer(
        ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=VOCAB, tie_embeddings=False)
    )
    save_hf_checkpoint(plain, tmp_path / "llama")
    config = json.loads((tmp_path / "llama" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "auto_map" not in config
    assert not (tmp_path / "llama" / "modeling_depthscale.py").exists()
    assert "lm_head.weight" in load_file(tmp_path / "llama" / "model.safetensors")
    save_hf_checkpoint(plain, tmp_path / "sharded", max_shard_bytes=10_000)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    from transformers import LlamaForCausalLM

    whole = LlamaForCausalLM.from_pretrained(tmp_path / "llama").eval()
    sharded = LlamaForCausalLM.from_pretrained(tmp_path / "sharded").eval()
    with torch.no_grad():
        assert torch.equal(whole(tokens).logits, sharded(tokens).logits)
        assert torch.equal(load_hf_checkpoint(tmp_path / "sharded")(tokens), plain(tokens))


@pytest.mark.parametrize(
    "text, size", [("5GB", 5 * 10**9), ("500MB", 5 * 10**8), ("2GiB", 2 * 2**30), ("1234", 1234)]
)
def test_shard_sizes_read_as_transformers_writes_them(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["0", "-1GB", "5XB", "GB", "0.1B"])
def test_a_shard_size_that_is_no_size_is_named(text):
    with pytest.raises(
        ConfigError, match=r"--max-shard-size .* is not a size; allowed: a positive"
    ):
        parse_size(text)


def test_the_modeling_file_imports_no_depthscale():
    """It travels alone into every export; the loader above runs it with depthscale unimportable,
    and this names the rule where a reader of the file looks."""
    source = (
        Path(__file__).parents[2] / "src/depthscale/interop/hf_remote/modeling_depthscale.py"
    ).read_text()
    assert "import depthscale" not in source and "from depthscale" not in source
    with pytest.raises(ConfigError, match="has no Hugging Face Llama counterpart"):
        hf_config_from(ModelConfig(vocab_size=VOCAB, residual="block"))


def test_an_exported_tokenizer_starts_a_text_as_training_started_documents(tmp_path):
    """Training puts EOS before every document and `depthscale generate` starts prompts with it:
    before, the exported tokenizer encoded a prompt without it, so transformers' greedy
    continuation of a trained run differed from depthscale's. A tokenizer brought in with an
    imported model keeps its own post-processor."""
    from tokenizers import Tokenizer, models, processors
    from transformers import AutoTokenizer

    from depthscale.data.tokenizer import ByteTokenizer, HFTokenizer
    from depthscale.interop.hf_tokenizer import save_hf_tokenizer

    byte = ByteTokenizer()
    save_hf_tokenizer(byte, tmp_path, 64)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert hf("def main(")["input_ids"] == [byte.eos_id, *byte.encode("def main(")]
    assert hf.decode(hf("def main(")["input_ids"], skip_special_tokens=True) == "def main("

    vocab = {"<s>": 0, "</s>": 1, "a": 2}
    imported = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    imported.add_special_tokens(["<s>", "</s>"])
    imported.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 0)]
    )
    (tmp_path / "imported").mkdir()
    save_hf_tokenizer(HFTokenizer(imported), tmp_path / "imported", 64)
    assert AutoTokenizer.from_pretrained(tmp_path / "imported")("a")["input_ids"] == [0, 2]
