"""A run's tokenizer in the layout Hugging Face loads with `AutoTokenizer.from_pretrained(dir)`.

An exported model is only usable with the tokenizer it was trained with, so `convert ds-to-hf`
writes it beside the weights: `tokenizer.json` (the `tokenizers` model itself),
`tokenizer_config.json` (which class to build, BOS/EOS, context length) and
`special_tokens_map.json`, and the BOS/EOS ids go into config.json and generation_config.json so
`generate()` stops where training put document ends. Training puts EOS before every document
(`depthscale generate` starts prompts with it too), so a tokenizer of ours encodes a text with that
EOS in front (`add_special_tokens=True`, transformers' default): the exported model then continues a
prompt as depthscale does. A tokenizer imported with a model keeps its own post-processor.

A trained or loaded tokenizer is already a `tokenizers` model and is written as it is. The byte
tokenizer is not one: it is written as the byte-level BPE with no merges that encodes exactly as
it does (byte b is id b, BOS 256, EOS 257), through GPT-2's byte-to-character table, which is
what the ByteLevel pre-tokenizer and decoder use.
"""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from depthscale.data.tokenizer import BPE_BOS, BPE_EOS, ByteTokenizer, HFTokenizer, Tokenizer

__all__ = ["save_hf_tokenizer"]


def save_hf_tokenizer(tokenizer: Tokenizer, out: Path, max_len: int) -> dict[str, int]:
    """Write the three tokenizer files into `out`; returns the special token ids that config.json
    and generation_config.json carry ({"bos_token_id": ..., "eos_token_id": ...})."""
    tok = _as_tokenizers(tokenizer)
    bos, eos = tok.id_to_token(tokenizer.bos_id), tok.id_to_token(tokenizer.eos_id)
    if tok.post_processor is None:  # ours: a text starts as training started every document
        tok.post_processor = processors.TemplateProcessing(
            single=f"{eos} $A", pair=f"{eos} $A {eos} $B", special_tokens=[(eos, tokenizer.eos_id)]
        )
    tok.save(str(out / "tokenizer.json"))
    special = {"bos_token": bos, "eos_token": eos}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
        **special,
    }
    _write_json(out / "tokenizer_config.json", config)
    _write_json(out / "special_tokens_map.json", special)
    return {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}


def _as_tokenizers(tokenizer: Tokenizer) -> tokenizers.Tokenizer:
    """A `tokenizers` copy of the run's tokenizer (the export changes its post-processor)."""
    if isinstance(tokenizer, HFTokenizer):
        return tokenizers.Tokenizer.from_str(tokenizer.tok.to_str())
    if isinstance(tokenizer, ByteTokenizer):
        return _byte_level()
    raise TypeError(f"no Hugging Face form for {tokenizer!r}")


def _byte_level() -> tokenizers.Tokenizer:
    """ByteTokenizer as a `tokenizers` model: byte b → id b, then BOS and EOS."""
    chars = _bytes_to_unicode()
    tok = tokenizers.Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BPE_BOS, BPE_EOS])  # ids 256 and 257, as ByteTokenizer's
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: printable bytes stand for themselves, the others for characters from 256 up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in table]
    table |= {b: chr(256 + n) for n, b in enumerate(others)}
    return table


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
