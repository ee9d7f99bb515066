"""Token files written by the peers' own writers (datatrove's `DocumentTokenizer`, megatron-core's
`IndexedDatasetBuilder` in the slow case) or byte for byte as theirs lay them out (tests/
peer_writers.py: Megatron, Dolma, OLMo-core), read as the peer reads them, document for document:
with a chat tokenizer whose configured EOS is `<|im_end|>`, not `<|endoftext|>` (issue #50), as
directories of parts, and at the wrong width (refused, naming the right one)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from depthscale.config import ConfigError, DataConfig, load_config
from depthscale.data.loader import tokenize_corpus
from depthscale.data.shards import tokenize_to_shards
from depthscale.data.sources import corpus_files, token_format
from depthscale.data.tokenizer import ByteTokenizer, build_tokenizer, load_tokenizer
from depthscale.errors import DataError
from peer_writers import (
    ENDOFTEXT,
    IM_END,
    IM_START,
    A,
    B,
    chat_tokenizer,
    olmo_documents,
    write_dolma,
    write_megatron,
    write_olmo,
)


def _cfg(path: Path, tmp_path: Path, tokenizer: Path | str, **kw) -> DataConfig:
    return DataConfig(
        path=str(path), tokenizer=str(tokenizer), cache_dir=str(tmp_path / "cache"), **kw
    )


def _read(cfg: DataConfig) -> list[int]:
    return np.asarray(tokenize_corpus(cfg, build_tokenizer(cfg, lambda: ()))).tolist()


# --------------------------------------------------------------------- which EOS


def test_the_configured_eos_wins_and_data_eos_token_overrides_it(tmp_path):
    chat = chat_tokenizer(tmp_path / "chat")
    for named in (chat, chat / "tokenizer.json"):  # the directory, or the file inside it
        tok = build_tokenizer(DataConfig(tokenizer=str(named)), lambda: ())
        assert (tok.eos_id, tok.eos_token) == (IM_END, "<|im_end|>")
        assert tok.eos_summary == f"EOS '<|im_end|>' (id 2, {chat / 'tokenizer_config.json'})"
    plain = chat_tokenizer(tmp_path / "plain", config={})  # nothing configured: found by name
    by_name = build_tokenizer(DataConfig(tokenizer=str(plain)), lambda: ())
    assert by_name.eos_id == ENDOFTEXT and "by name" in by_name.eos_summary
    assert by_name.fingerprint != tok.fingerprint  # a cache of the other EOS is not reused
    dict_form = chat_tokenizer(tmp_path / "dict", {"eos_token": {"content": "<|im_end|>"}})
    assert build_tokenizer(DataConfig(tokenizer=str(dict_form)), lambda: ()).eos_id == IM_END
    legacy = chat_tokenizer(tmp_path / "legacy", {"eos_token": "<|endoftext|>"})
    (legacy / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    assert build_tokenizer(DataConfig(tokenizer=str(legacy)), lambda: ()).eos_id == IM_END
    chosen = build_tokenizer(DataConfig(tokenizer=str(chat), eos_token="<|endoftext|>"), lambda: ())
    assert (chosen.eos_id, chosen.eos_source) == (ENDOFTEXT, "data.eos_token")
    chosen.save(tmp_path / "run")  # a run's saved tokenizer keeps the EOS it trained with
    assert load_tokenizer(tmp_path / "run").eos_id == ENDOFTEXT
    with pytest.raises(DataError, match=r"^data.eos_token='<\|eot\|>' is not a token of"):
        build_tokenizer(DataConfig(tokenizer=str(chat), eos_token="<|eot|>"), lambda: ())


def test_data_eos_token_with_the_byte_tokenizer_is_a_config_error(tmp_path):
    (tmp_path / "c.toml").write_text("")
    with pytest.raises(ConfigError, match=r"^data.eos_token='<\|im_end\|>' needs a tokenizer with"):
        load_config(tmp_path / "c.toml", ["--data.eos_token", "<|im_end|>"])
    ByteTokenizer().save(tmp_path / "run")  # a run's saved byte tokenizer, named as a directory
    with pytest.raises(DataError, match=r"^data.eos_token='<\|im_end\|>' needs a tokenizer with"):
        build_tokenizer(DataConfig(tokenizer=str(tmp_path / "run"), eos_token="<|im_end|>"), list)


def test_a_text_cache_made_with_another_eos_is_not_reused(tmp_path):
    (tmp_path / "c.txt").write_text("a b a")
    chat = chat_tokenizer(tmp_path / "chat")
    assert _read(_cfg(tmp_path / "c.txt", tmp_path, chat)) == [A, B, A, IM_END]
    other = _cfg(tmp_path / "c.txt", tmp_path, chat, eos_token="<|endoftext|>")
    assert _read(other) == [A, B, A, ENDOFTEXT]


def test_a_megatron_file_of_a_chat_tokenizer_reads_as_megatron_wrote_it(tmp_path):
    """Issue #50's reproduction: `--append-eod` with the configured EOS writes [3,4,2], [4,2];
    read with EOS <|endoftext|> it became [3,4,2,0,4,2,0]."""
    chat = chat_tokenizer(tmp_path / "chat")
    write_megatron(tmp_path / "m", [[[A, B, IM_END]], [[B, IM_END]]], np.int32)
    assert _read(_cfg(tmp_path / "m.bin", tmp_path, chat)) == [A, B, IM_END, B, IM_END]


def test_documents_ending_in_another_special_token_are_named(tmp_path):
    plain = chat_tokenizer(tmp_path / "plain", config={})  # EOS <|endoftext|>, by name
    write_megatron(tmp_path / "m", [[[A, B, IM_END]], [[B, IM_END]]], np.uint16)
    with pytest.raises(DataError) as err:
        _read(_cfg(tmp_path / "m.bin", tmp_path, plain))
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{tmp_path / 'm.bin'}: its documents end")
    assert "'<|im_end|>' (id 2)" in message and "data.eos_token = '<|im_end|>'" in message
    chosen = _cfg(tmp_path / "m.bin", tmp_path, plain, eos_token="<|im_end|>")
    assert _read(chosen) == [A, B, IM_END, B, IM_END]
    both = _cfg(tmp_path / "m.bin", tmp_path, plain, eos_token="<|endoftext|>")
    assert _read(both) == [A, B, IM_END, ENDOFTEXT, B, IM_END, ENDOFTEXT]  # asked for
    write_olmo(tmp_path / "o.npy", [[A, IM_END], [B, B, IM_END]], np.uint16, IM_END)
    (tmp_path / "o.csv.gz").unlink()  # no index: the stream's last token, and no EOS in it
    with pytest.raises(DataError, match="o.npy: its documents end in '<|im_end|>'"):
        _read(_cfg(tmp_path / "o.npy", tmp_path, plain, bin_dtype="uint16"))


def test_start_up_names_the_eos_and_where_it_came_from(tmp_path, capsys, monkeypatch):
    from types import SimpleNamespace

    from depthscale.config import Config
    from depthscale.train.setup import build_data_once_per_node

    monkeypatch.delenv("RANK", raising=False)
    chat = chat_tokenizer(tmp_path / "chat")
    write_megatron(tmp_path / "m", [[[A, B, A, B, IM_END]] for _ in range(40)], np.uint16)
    cfg = Config()
    cfg.data = _cfg(tmp_path / "m.bin", tmp_path, chat, seq_len=8, val_fraction=0)
    cfg.train.batch_size = 2
    build_data_once_per_node(cfg, SimpleNamespace(rank=0, local_rank=0), 1)
    out = capsys.readouterr().out
    assert f"EOS '<|im_end|>' (id 2, {chat / 'tokenizer_config.json'})" in out


# --------------------------------------------------------------------- datatrove


def _datatrove(folder: Path, tokenizer: Path, texts: list[str], **kw) -> Path:
    """datatrove's own DocumentTokenizer (datatrove/pipeline/tokens/tokenizer.py) writes
    `00000_unshuffled.ds` with its .ds.index and .ds.metadata."""
    from datatrove.data import Document
    from datatrove.pipeline.tokens.tokenizer import DocumentTokenizer

    step = DocumentTokenizer(str(folder), str(tokenizer), shuffle_documents=False, **kw)
    step.run(iter([Document(text=t, id=str(n)) for n, t in enumerate(texts)]))
    return folder / "00000_unshuffled.ds"


def _datatrove_reading(path: Path) -> tuple[list[int], list[int]]:
    """datatrove's reading: the token size its .metadata records (merger.py), the document ends
    of .ds.index (`load_doc_ends`), the ids at that width (utils/dataset.py)."""
    from datatrove.pipeline.tokens.merger import load_doc_ends

    size = int(Path(f"{path}.metadata").read_text().splitlines()[0].rsplit("|", 1)[1])
    with open(f"{path}.index", "rb") as f:
        ends = load_doc_ends(f).tolist()
    tokens = np.fromfile(path, dtype=np.uint16 if size == 2 else np.uint32).tolist()
    return tokens, ends


def test_datatrove_files_read_as_datatrove_reads_them(tmp_path):
    chat = chat_tokenizer(tmp_path / "chat")
    texts = ["a b", "b", "a a b"]
    ds = _datatrove(tmp_path / "eos", chat / "tokenizer.json", texts, eos_token="<|im_end|>")
    tokens, ends = _datatrove_reading(ds)
    assert ends == [3, 5, 9] and tokens[-1] == IM_END
    cfg = _cfg(ds, tmp_path, chat)
    assert token_format(cfg) == "datatrove"
    assert _read(cfg) == tokens  # EOS already ends each document: the file itself
    bare = _datatrove(tmp_path / "bare", chat / "tokenizer.json", texts)  # no eos_token
    tokens, ends = _datatrove_reading(bare)
    docs = [tokens[a:b] for a, b in zip([0, *ends], ends)]
    assert _read(_cfg(bare, tmp_path, chat)) == [t for d in docs for t in (*d, IM_END)]


def test_a_datatrove_index_that_does_not_fit_is_named(tmp_path):
    chat = chat_tokenizer(tmp_path / "chat")
    ds = _datatrove(tmp_path / "d", chat / "tokenizer.json", ["a b", "b"], eos_token="<|im_end|>")
    index = Path(f"{ds}.index")
    cases = [
        ([3, 4], r"10 bytes for the 4 tokens 00000_unshuffled.ds.index lists"),  # truncated
        ([4, 3, 5], r"00000_unshuffled.ds.index does not fit it"),  # ends must rise
    ]
    for ends, message in cases:
        index.write_bytes(np.asarray(ends, "<u8").tobytes())
        with pytest.raises(DataError, match=rf"^{ds}: .*{message}"):
            _read(_cfg(ds, tmp_path, chat))
    index.write_bytes(np.asarray([3, 5], "<u8").tobytes() + b"\x01")
    with pytest.raises(DataError, match="not a whole number of uint64 document ends"):
        _read(_cfg(ds, tmp_path, chat))


# --------------------------------------------------------------------- OLMo / Dolma


def _documents(n: int, rng, eos: int, high: int = 258) -> list[list[int]]:
    return [[*rng.integers(1, high - 2, rng.integers(3, 40)).tolist(), eos] for _ in range(n)]


def test_olmo_and_dolma_arrays_read_as_olmo_reads_them(tmp_path):
    rng, eos = np.random.default_rng(0), ByteTokenizer.eos_id
    docs = _documents(20, rng, eos)
    write_olmo(tmp_path / "olmo.npy", docs, np.uint32, eos)
    write_dolma(tmp_path / "dolma.npy", docs, np.uint16)
    assert olmo_documents(tmp_path / "olmo.npy", np.uint32) == docs
    assert olmo_documents(tmp_path / "dolma.npy", np.uint16) == docs
    flat = [t for d in docs for t in d]
    for name in ("olmo.npy", "dolma.npy"):  # the width from the .csv.gz: no data.bin_dtype
        assert _read(_cfg(tmp_path / name, tmp_path, "byte")) == flat


def test_a_raw_array_at_the_wrong_width_is_refused_naming_the_right_one(tmp_path):
    """Issue #50: a Dolma uint32 array read as uint16 trained on every second token 0."""
    rng, eos = np.random.default_rng(1), ByteTokenizer.eos_id
    docs = _documents(20, rng, eos)
    write_olmo(tmp_path / "wide.npy", docs, np.uint32, eos)
    cases = [("uint16", "index", "so uint32 tokens, not data.bin_dtype='uint16'")]
    write_dolma(tmp_path / "narrow.npy", docs, np.uint16)
    cases.append(("uint32", "narrow", "so uint16 tokens, not data.bin_dtype='uint32'"))
    for dtype, name, message in cases:
        path = tmp_path / ("wide.npy" if name == "index" else "narrow.npy")
        with pytest.raises(DataError, match=rf"^{path} holds \d+ tokens by .*{message}"):
            _read(_cfg(path, tmp_path, "byte", bin_dtype=dtype))
    for name in ("wide", "narrow"):  # without the index, the ids are the evidence
        (tmp_path / f"{name}.csv.gz").unlink()
    with pytest.raises(
        DataError, match=r"wide.npy read as uint16 has every second token 0 .*uint32"
    ):
        _read(_cfg(tmp_path / "wide.npy", tmp_path, "byte", bin_dtype="uint16"))
    with pytest.raises(DataError, match=r"narrow.npy read as uint32 holds ids up to .*uint16"):
        _read(_cfg(tmp_path / "narrow.npy", tmp_path, "byte", bin_dtype="uint32"))


# --------------------------------------------------------------------- directories of parts


def test_a_directory_of_token_files_is_one_source_in_name_order(tmp_path):
    chat = chat_tokenizer(tmp_path / "chat")
    parts = tmp_path / "parts"
    parts.mkdir()
    write_dolma(parts / "part-0-00000.npy", [[A, B, IM_END], [B, IM_END]], np.uint16)
    write_megatron(parts / "part-1", [[[A, A], [B, IM_END]], [[B]]], np.int32)
    _datatrove(parts, chat / "tokenizer.json", ["b a"], eos_token="<|im_end|>",
               save_filename="part-2")  # fmt: skip
    np.save(parts / "part-3.npy", np.array([IM_START, A, IM_END], np.uint16))
    cfg = _cfg(parts, tmp_path, chat)
    assert token_format(cfg) == "parts"
    assert [f.name for f in corpus_files(cfg)] == [
        "part-0-00000.npy",
        "part-1.bin",
        "part-2_00000_unshuffled.ds",
        "part-3.npy",
    ]
    assert _read(cfg) == [
        *[A, B, IM_END, B, IM_END],
        *[A, A, B, IM_END, B, IM_END],  # Megatron: EOS added to the document without one
        *[B, A, IM_END],
        *[IM_START, A, IM_END],
    ]
    (parts / "notes.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(DataError, match=r"mixes text files \(notes.jsonl\) and token files"):
        corpus_files(cfg)


def test_a_shard_directory_without_its_manifest_says_so(tmp_path):
    (tmp_path / "in.txt").write_text("some text")
    out = tmp_path / "shards"
    tokenize_to_shards([tmp_path / "in.txt"], ByteTokenizer(), out)
    (out / "manifest.json").unlink()
    with pytest.raises(DataError, match=r"manifest missing: rerun `depthscale tokenize`"):
        _read(_cfg(out, tmp_path, "byte"))


def test_a_tokenizer_mismatch_names_each_tokenizer_once(tmp_path):
    (tmp_path / "in.txt").write_text("a b")
    out = tmp_path / "shards"
    tokenize_to_shards([tmp_path / "in.txt"], ByteTokenizer(), out)
    chat = chat_tokenizer(tmp_path / "chat")
    with pytest.raises(DataError, match="another tokenizer") as err:
        _read(_cfg(out, tmp_path, chat))
    assert "(byte)" in str(err.value) and "byte byte" not in str(err.value)


# --------------------------------------------------------------------- megatron-core itself


@pytest.mark.slow
def test_megatron_cores_own_builder_and_reader_agree_with_depthscale(tmp_path):
    """megatron-core's IndexedDatasetBuilder writes (importing megatron.core takes ~10 s) and its
    IndexedDataset reads: the documents depthscale reads are those, the EOS the configured one."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    chat = chat_tokenizer(tmp_path / "chat")
    tok = build_tokenizer(DataConfig(tokenizer=str(chat)), lambda: ())
    docs = [[tok.encode("a b a") + [tok.eos_id]], [tok.encode("b"), [tok.eos_id]]]
    prefix = str(tmp_path / "m")
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for doc in docs:
        builder.add_document(torch.tensor([t for s in doc for t in s]), [len(s) for s in doc])
    builder.finalize(f"{prefix}.idx")
    dataset = IndexedDataset(prefix)
    bounds = dataset.document_indices
    theirs = [
        [t for s in range(bounds[d], bounds[d + 1]) for t in dataset[s].tolist()]
        for d in range(len(bounds) - 1)
    ]
    assert theirs == [[A, B, A, IM_END], [B, IM_END]]
    assert _read(_cfg(Path(f"{prefix}.bin"), tmp_path, chat)) == [t for d in theirs for t in d]
