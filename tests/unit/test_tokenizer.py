import json

import pytest
import tokenizers

from depthscale.config import DataConfig
from depthscale.data.tokenizer import (
    META_FILE,
    ByteTokenizer,
    HFTokenizer,
    build_tokenizer,
    load_tokenizer,
    train_bpe,
)
from depthscale.errors import DataError

TEXTS = [
    "",
    "hello world",
    "héllo wörld",
    "emoji 🙂👍🏽 and 日本語",
    "tabs\tand\r\nnewlines\n\n",
    "  leading and trailing spaces  ",
    "\x00 control \x7f",
    "def f(x):\n    return x ** 2\n",
]
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.\n",
    "naïve café — déjà vu 🙂\n",
    "for i in range(10):\n    print(i)\n",
] * 20


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DEPTHSCALE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def bpe() -> HFTokenizer:
    return train_bpe(CORPUS, 300)


@pytest.mark.parametrize("text", TEXTS)
def test_byte_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode([tok.bos_id, *ids, tok.eos_id]) == text


def test_byte_ids_and_invalid_utf8():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (258, 256, 257)
    assert tok.decode([0xFF, ord("a")]) == "\ufffda"
    assert (
        tok.decode([ord("a"), 300]) == "a"
    )  # ids past the vocabulary (padded embedding rows) are skipped


@pytest.mark.parametrize("text", TEXTS + ["unseen: Ωμέγα ∑ 🚀", "literal <|eos|> in text"])
def test_bpe_round_trip(bpe, text):
    assert bpe.decode(bpe.encode(text)) == text


def test_bpe_specials_and_compression(bpe):
    assert bpe.vocab_size == 300
    assert {bpe.bos_id, bpe.eos_id} == {
        bpe.tok.token_to_id("<|bos|>"),
        bpe.tok.token_to_id("<|eos|>"),
    }
    assert bpe.eos_id not in bpe.encode("a <|eos|> b")  # specials enter the stream only by id
    text = CORPUS[0]
    assert len(bpe.encode(text)) < len(text.encode())
    assert bpe.decode([bpe.bos_id, *bpe.encode(text), bpe.eos_id]) == text


def test_bpe_vocab_too_small():
    with pytest.raises(DataError, match="bpe_vocab_size=100"):
        train_bpe(CORPUS, 100)


def test_bpe_is_cached(tmp_path, cache):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(CORPUS))
    cfg = DataConfig(path=str(corpus), tokenizer="bpe", bpe_vocab_size=300)
    calls = []

    def texts():
        calls.append(1)
        return CORPUS

    first = build_tokenizer(cfg, texts)
    cached = list((cache / "tokenizers").glob("bpe300-*.json"))
    assert len(calls) == 1 and len(cached) == 1
    mtime = cached[0].stat().st_mtime_ns
    second = build_tokenizer(cfg, texts)
    assert len(calls) == 1 and cached[0].stat().st_mtime_ns == mtime
    assert second.fingerprint == first.fingerprint
    assert second.encode(CORPUS[2]) == first.encode(CORPUS[2])

    cfg.bpe_vocab_size = 290  # a different key: trained again
    build_tokenizer(cfg, texts)
    assert len(calls) == 2


def test_tokenizer_json_path(tmp_path, bpe):
    path = tmp_path / "my-tokenizer.json"
    bpe.tok.save(str(path))
    tok = build_tokenizer(DataConfig(tokenizer=str(path)), lambda: pytest.fail("no training"))
    assert isinstance(tok, HFTokenizer)
    assert (tok.eos_id, tok.vocab_size) == (bpe.eos_id, bpe.vocab_size)
    assert tok.encode(CORPUS[1]) == bpe.encode(CORPUS[1])


def test_tokenizer_path_missing(tmp_path):
    missing = str(tmp_path / "nope.json")
    with pytest.raises(DataError, match="nope.json.*allowed: 'byte', 'bpe'"):
        build_tokenizer(DataConfig(tokenizer=missing), lambda: [])


def test_hf_tokenizer_special_detection():
    vocab = {"a": 0, "b": 1}
    plain = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="a"))
    with pytest.raises(DataError, match="no end-of-sequence token"):
        HFTokenizer(plain)
    gpt2_like = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({**vocab, "<|endoftext|>": 2}, unk_token="a")
    )
    tok = HFTokenizer(gpt2_like)
    assert tok.eos_id == tok.bos_id == 2  # no BOS: EOS doubles as the document separator


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_save_and_load(tmp_path, bpe, kind):
    tok = ByteTokenizer() if kind == "byte" else bpe
    tok.save(tmp_path / "run" / "tokenizer")
    meta = json.loads((tmp_path / "run" / "tokenizer" / META_FILE).read_text())
    assert meta["kind"] == ("byte" if kind == "byte" else "hf")
    loaded = load_tokenizer(tmp_path / "run" / "tokenizer")
    assert type(loaded) is type(tok)
    assert (loaded.vocab_size, loaded.bos_id, loaded.eos_id, loaded.name) == (
        tok.vocab_size,
        tok.bos_id,
        tok.eos_id,
        tok.name,
    )
    assert loaded.fingerprint == tok.fingerprint
    assert loaded.encode(TEXTS[3]) == tok.encode(TEXTS[3])
    # a saved directory is also accepted as data.tokenizer
    again = build_tokenizer(DataConfig(tokenizer=str(tmp_path / "run" / "tokenizer")), lambda: [])
    assert again.fingerprint == tok.fingerprint


def test_load_tokenizer_empty_dir(tmp_path):
    with pytest.raises(DataError, match="no saved tokenizer"):
        load_tokenizer(tmp_path)
