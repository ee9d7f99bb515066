"""Tokenizers: raw UTF-8 bytes, or any Hugging Face `tokenizers` model (trained here or loaded).

Every tokenizer can `save(dir)` into a run directory and be rebuilt by `load_tokenizer(dir)`, so
generation and evaluation always decode with exactly the tokenizer the model was trained with.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import tokenizers

from depthscale.config import DataConfig
from depthscale.data.cache import atomic_path, cache_key, cache_root, cache_writes
from depthscale.data.sources import corpus_identity, is_pretokenized
from depthscale.errors import DataError

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "build_tokenizer",
    "load_tokenizer",
    "train_bpe",
]

META_FILE = "tokenizer_meta.json"
_META_FORM = 'allowed: {"kind": "byte"} or {"kind": "hf"} beside a tokenizer.json'
BPE_BOS, BPE_EOS = "<|bos|>", "<|eos|>"
EOS_NAMES = (
    BPE_EOS,
    "<|endoftext|>",
    "<|end_of_text|>",
    "</s>",
    "<eos>",
    "<|eot_id|>",
    "<|im_end|>",
)
BOS_NAMES = (BPE_BOS, "<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
KINDS = "'byte', 'bpe', or a path to a tokenizer.json (or a directory holding one)"


class Tokenizer(ABC):
    """Text <-> token ids. `eos_id` ends every document in the training stream."""

    name: str
    vocab_size: int
    bos_id: int
    eos_id: int

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without any special tokens."""

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; special and out-of-vocabulary ids are skipped."""

    @property
    @abstractmethod
    def fingerprint(self) -> str:
        """Identifies the exact token mapping: part of the tokenized-corpus cache key."""

    @abstractmethod
    def save(self, directory: str | Path) -> None:
        """Write what `load_tokenizer(directory)` needs to rebuild this tokenizer."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes are ids 0..255, then BOS=256 and EOS=257: lossless, no training, no files."""

    name = "byte"
    vocab_size = 258
    bos_id = 256
    eos_id = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", errors="replace"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in _as_ints(ids) if 0 <= i < 256).decode("utf-8", errors="replace")

    @property
    def fingerprint(self) -> str:
        return "byte"

    def save(self, directory: str | Path) -> None:
        _write_meta(Path(directory), {"kind": "byte", "name": self.name})


class HFTokenizer(Tokenizer):
    """Wraps a `tokenizers.Tokenizer`; BOS/EOS are found among its special tokens by name.

    Special-token text inside documents (say a literal '<|endoftext|>') is encoded as plain text:
    specials enter the stream only by id, so a document cannot forge a document boundary.
    """

    def __init__(self, tok: tokenizers.Tokenizer, name: str = "hf") -> None:
        self.tok = tok
        self.tok.encode_special_tokens = True
        self.name = name
        eos = _find_token(tok, EOS_NAMES)
        if eos is None:
            raise DataError(
                f"tokenizer {name!r} has no end-of-sequence token; expected one of "
                + ", ".join(EOS_NAMES)
            )
        bos = _find_token(tok, BOS_NAMES)
        self.eos_id = eos
        self.bos_id = eos if bos is None else bos  # GPT-2 style: one token both starts and ends
        self.vocab_size = max(tok.get_vocab(with_added_tokens=True).values()) + 1

    @classmethod
    def from_file(cls, path: str | Path, name: str | None = None) -> HFTokenizer:
        path = Path(path)
        if not path.is_file():
            raise DataError(f"tokenizer file {str(path)!r} does not exist")
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception on malformed JSON
            raise DataError(f"{path}: not a valid tokenizer.json ({err})") from None
        return cls(tok, name or str(path))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(_as_ints(ids), skip_special_tokens=True)

    @property
    def fingerprint(self) -> str:
        return "hf-" + hashlib.sha256(self.tok.to_str().encode()).hexdigest()[:16]

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.tok.save(str(directory / "tokenizer.json"))
        _write_meta(directory, {"kind": "hf", "name": self.name})


def train_bpe(texts: Iterable[str], vocab_size: int) -> HFTokenizer:
    """Byte-level BPE (GPT-2 style): any text encodes, and decode(encode(x)) == x."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 258:
        raise DataError(
            f"data.bpe_vocab_size={vocab_size} is too small; allowed: >= 258 "
            "(256 byte tokens + BOS + EOS)"
        )
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BPE_BOS, BPE_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(tok, name=f"bpe{vocab_size}")


def build_tokenizer(cfg: DataConfig, texts_fn: Callable[[], Iterable[str]]) -> Tokenizer:
    """The tokenizer `data.tokenizer` names; 'bpe' is trained on `texts_fn()` once, then cached."""
    kind = cfg.tokenizer
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        if is_pretokenized(cfg):
            raise DataError(
                f"data.tokenizer='bpe' cannot be trained on pre-tokenized "
                f"data.path={cfg.path!r}; give the tokenizer.json the .bin was made with"
            )
        path = _bpe_cache_path(cfg)
        if path.is_file():
            return HFTokenizer.from_file(path, name=f"bpe{cfg.bpe_vocab_size}")
        tok = train_bpe(texts_fn(), cfg.bpe_vocab_size)
        with cache_writes(path, "the trained tokenizer"), atomic_path(path) as tmp:
            tmp.write_text(tok.tok.to_str(pretty=True))  # an OSError, where save() raises Exception
        return tok
    path = Path(kind).expanduser()
    if path.is_dir():
        return load_tokenizer(path)
    if not path.is_file():
        raise DataError(f"data.tokenizer={kind!r}: no such file; allowed: {KINDS}")
    return HFTokenizer.from_file(path)


def planned_vocab_size(cfg: DataConfig) -> tuple[int, str | None]:
    """The vocabulary a run of `cfg` will have, found without tokenizing or training anything
    (`depthscale plan`), and a note when it is only a bound: a 'bpe' tokenizer not trained yet
    has at most data.bpe_vocab_size tokens (the trainer stops there), which is what is planned."""
    if cfg.tokenizer == "bpe":
        try:
            path = None if is_pretokenized(cfg) else _bpe_cache_path(cfg)
        except DataError:  # the corpus is not on this machine: planning needs no corpus
            path = None
        if path is not None and path.is_file():
            return HFTokenizer.from_file(path).vocab_size, None
        return cfg.bpe_vocab_size, (
            f"data.tokenizer='bpe' is not trained yet; planned with data.bpe_vocab_size="
            f"{cfg.bpe_vocab_size}, the most it will have"
        )
    return build_tokenizer(cfg, lambda: ()).vocab_size, None  # 'byte' or a file: nothing trained


def _bpe_cache_path(cfg: DataConfig) -> Path:
    """Where the BPE tokenizer trained on this corpus with this vocabulary size is cached."""
    key = cache_key("bpe", corpus_identity(cfg), cfg.bpe_vocab_size)
    return cache_root(cfg) / "tokenizers" / f"bpe{cfg.bpe_vocab_size}-{key}.json"


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """Rebuild the tokenizer that `Tokenizer.save(directory)` wrote."""
    directory = Path(directory)
    meta_file, json_file = directory / META_FILE, directory / "tokenizer.json"
    if meta_file.is_file():
        meta = _read_meta(meta_file)
    elif json_file.is_file():
        meta = {"kind": "hf"}
    else:
        raise DataError(f"{directory} holds no saved tokenizer ({META_FILE} or tokenizer.json)")
    if meta["kind"] == "byte":
        return ByteTokenizer()
    if meta["kind"] == "hf":
        return HFTokenizer.from_file(json_file, name=meta.get("name"))
    raise DataError(f"{meta_file}: unknown tokenizer kind {meta['kind']!r}; allowed: 'byte', 'hf'")


def _read_meta(meta_file: Path) -> dict:
    """What `_write_meta` wrote; a damaged file is named rather than read as a traceback."""
    try:
        meta = json.loads(meta_file.read_bytes())
    except ValueError as err:  # also UnicodeDecodeError: bytes that are not text
        raise DataError(f"{meta_file}: not valid JSON ({err}); {_META_FORM}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("kind"), str):
        raise DataError(f"{meta_file}: no tokenizer kind in it; {_META_FORM}")
    return meta


def _find_token(tok: tokenizers.Tokenizer, names: Sequence[str]) -> int | None:
    for name in names:
        token_id = tok.token_to_id(name)
        if token_id is not None:
            return token_id
    return None


def _as_ints(ids: Iterable[int]) -> list[int]:
    """Accept lists, numpy arrays and tensors alike."""
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    return [int(i) for i in ids]


def _write_meta(directory: Path, meta: dict[str, str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
