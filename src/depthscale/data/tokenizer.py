"""Tokenizers: raw UTF-8 bytes, or any Hugging Face `tokenizers` model (trained here or loaded).

Every tokenizer can `save(dir)` into a run directory and be rebuilt by `load_tokenizer(dir)`, so
generation and evaluation always decode with exactly the tokenizer the model was trained with.

Which token ends a document (EOS) is chosen once, here, in this order (`build_tokenizer`):
`data.eos_token`; the `eos_token` a run's saved tokenizer records; the `eos_token` that
`tokenizer_config.json` / `special_tokens_map.json` beside the tokenizer.json configure (what
transformers, Megatron's `--append-eod`, OLMo and Dolma use: a chat tokenizer ends documents with
`<|im_end|>`, not `<|endoftext|>`); else the first of EOS_NAMES in the vocabulary.
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
    "tokenizer_label",
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
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")
"""Where transformers-style tokenizer directories configure their special tokens."""


class Tokenizer(ABC):
    """Text <-> token ids. `eos_id` ends every document in the training stream; `eos_source`
    says why that token was chosen (printed at start-up)."""

    name: str
    vocab_size: int
    bos_id: int
    eos_id: int
    eos_token: str
    eos_source: str

    @property
    def label(self) -> str:
        """The name, and the fingerprint where it says more than the name (errors compare two)."""
        return tokenizer_label(self.name, self.fingerprint)

    @property
    def eos_summary(self) -> str:
        return f"EOS {self.eos_token!r} (id {self.eos_id}, {self.eos_source})"

    def special_ids(self) -> dict[int, str]:
        """Ids of the special tokens (which no text encodes to), with their text."""
        return {}

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


def tokenizer_label(name: str | None, fingerprint: str) -> str:
    """'byte', or 'NAME hf-0123456789ab': a fingerprint equal to the name is said once."""
    fingerprint = fingerprint[:16]
    return fingerprint if name in (None, fingerprint) else f"{name} {fingerprint}"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes are ids 0..255, then BOS=256 and EOS=257: lossless, no training, no files."""

    name = "byte"
    vocab_size = 258
    bos_id = 256
    eos_id = 257
    eos_token = "<eos>"
    eos_source = "the byte tokenizer's"

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
    """Wraps a `tokenizers.Tokenizer`; EOS is `eos_token` when given (set by the user or
    configured beside the tokenizer.json: `configured_eos`), else found among its tokens by name,
    as is BOS.

    Special-token text inside documents (say a literal '<|endoftext|>') is encoded as plain text:
    specials enter the stream only by id, so a document cannot forge a document boundary.
    """

    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        name: str = "hf",
        eos_token: str | None = None,
        eos_source: str = "",
    ) -> None:
        self.tok = tok
        self.tok.encode_special_tokens = True
        self.name = name
        self._eos_by_name = _find_token(tok, EOS_NAMES)
        if eos_token is None:
            if self._eos_by_name is None:
                raise DataError(
                    f"tokenizer {name!r} has no end-of-sequence token; expected one of "
                    + ", ".join(EOS_NAMES)
                    + " (or set data.eos_token)"
                )
            eos_token = tok.id_to_token(self._eos_by_name)
            eos_source = "by name; no tokenizer_config.json configures one"
        eos = tok.token_to_id(eos_token)
        if eos is None:
            what = (
                f"data.eos_token={eos_token!r}"
                if eos_source == "data.eos_token"
                else f"eos_token {eos_token!r} of {eos_source}"
            )
            raise DataError(
                f"{what} is not a token of tokenizer {name!r}; allowed: a token of its "
                "vocabulary (set data.eos_token to one)"
            )
        bos = _find_token(tok, BOS_NAMES)
        self.eos_id, self.eos_token, self.eos_source = eos, eos_token, eos_source
        self.bos_id = eos if bos is None else bos  # GPT-2 style: one token both starts and ends
        self.vocab_size = max(tok.get_vocab(with_added_tokens=True).values()) + 1
        self._fingerprint: str | None = None

    @classmethod
    def from_file(
        cls, path: str | Path, name: str | None = None, eos: tuple[str, str] | None = None
    ) -> HFTokenizer:
        """The tokenizer.json at `path`; EOS `eos` = (token, where it was set) when given, else
        the one configured beside the file (`configured_eos`), else found by name."""
        path = Path(path)
        if not path.is_file():
            raise DataError(f"tokenizer file {str(path)!r} does not exist")
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception on malformed JSON
            raise DataError(f"{path}: not a valid tokenizer.json ({err})") from None
        eos = eos or configured_eos(path.parent)
        return cls(tok, name or str(path), *(eos or (None, "")))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(_as_ints(ids), skip_special_tokens=True)

    def special_ids(self) -> dict[int, str]:
        return {i: t.content for i, t in self.tok.get_added_tokens_decoder().items() if t.special}

    @property
    def fingerprint(self) -> str:
        """The tokenizer.json's hash, and the EOS where it is not the one found by name (so
        fingerprints from before EOS could be configured still match, and a cache or shards
        made with another EOS do not)."""
        if self._fingerprint is None:
            h = hashlib.sha256(self.tok.to_str().encode())
            if self.eos_id != self._eos_by_name:
                h.update(f"\0eos={self.eos_id}".encode())
            self._fingerprint = "hf-" + h.hexdigest()[:16]
        return self._fingerprint

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.tok.save(str(directory / "tokenizer.json"))
        _write_meta(directory, {"kind": "hf", "name": self.name, "eos_token": self.eos_token})


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


def configured_eos(directory: Path) -> tuple[str, str] | None:
    """(eos_token, the file that sets it) of a transformers-style tokenizer directory, or None.
    transformers' precedence (`PreTrainedTokenizerBase.from_pretrained`): a legacy
    special_tokens_map.json overrides tokenizer_config.json unless the config lists its
    `added_tokens_decoder` (the current format), where the config alone decides."""
    found = {}
    for file in CONFIG_FILES:
        path = directory / file
        if not path.is_file():
            continue
        try:
            found[file] = json.loads(path.read_bytes())
        except ValueError as err:
            raise DataError(f"{path}: not valid JSON ({err})") from None
        if not isinstance(found[file], dict):
            raise DataError(f"{path}: not a JSON object; allowed: the file transformers writes")
    config, legacy_map = found.get(CONFIG_FILES[0], {}), found.get(CONFIG_FILES[1], {})
    order = [CONFIG_FILES[0], CONFIG_FILES[1]]
    if "added_tokens_decoder" not in config:
        order.reverse()
    for file in order:
        value = (config if file == CONFIG_FILES[0] else legacy_map).get("eos_token")
        if isinstance(value, dict):  # an AddedToken: {"content": "<|im_end|>", ...}
            value = value.get("content")
        if value is not None and not isinstance(value, str):
            raise DataError(
                f"{directory / file}: eos_token is {type(value).__name__}; allowed: a string "
                'or {"content": ...}'
            )
        if value:
            return value, str(directory / file)
    return None


def build_tokenizer(cfg: DataConfig, texts_fn: Callable[[], Iterable[str]]) -> Tokenizer:
    """The tokenizer `data.tokenizer` names, with EOS `data.eos_token` where set; 'bpe' is trained
    on `texts_fn()` once, then cached."""
    kind = cfg.tokenizer
    override = (cfg.eos_token, "data.eos_token") if cfg.eos_token else None
    if kind == "byte":  # data.eos_token with it is refused by the config's checks
        return ByteTokenizer()
    if kind == "bpe":
        if is_pretokenized(cfg):
            raise DataError(
                f"data.tokenizer='bpe' cannot be trained on pre-tokenized "
                f"data.path={cfg.path!r}; give the tokenizer.json the .bin was made with"
            )
        path = _bpe_cache_path(cfg)
        if not path.is_file():
            tok = train_bpe(texts_fn(), cfg.bpe_vocab_size)
            with cache_writes(path, "the trained tokenizer"), atomic_path(path) as tmp:
                tmp.write_text(tok.tok.to_str(pretty=True))  # an OSError; save() raises Exception
        return HFTokenizer.from_file(path, name=f"bpe{cfg.bpe_vocab_size}", eos=override)
    path = Path(kind).expanduser()
    if path.is_dir():
        return load_tokenizer(path, eos=override)
    if not path.is_file():
        raise DataError(f"data.tokenizer={kind!r}: no such file; allowed: {KINDS}")
    return HFTokenizer.from_file(path, eos=override)


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


def load_tokenizer(directory: str | Path, eos: tuple[str, str] | None = None) -> Tokenizer:
    """Rebuild the tokenizer that `Tokenizer.save(directory)` wrote (with the EOS it records), or
    read a transformers-style directory's tokenizer.json; `eos` = (token, where it was set)
    overrides either."""
    directory = Path(directory)
    meta_file, json_file = directory / META_FILE, directory / "tokenizer.json"
    if meta_file.is_file():
        meta = _read_meta(meta_file)
    elif json_file.is_file():
        meta = {"kind": "hf"}
    else:
        raise DataError(f"{directory} holds no saved tokenizer ({META_FILE} or tokenizer.json)")
    if meta["kind"] == "byte":
        if eos:
            raise DataError(
                f"{eos[1]}={eos[0]!r} needs a tokenizer with named tokens; {directory} holds the "
                "byte tokenizer, whose EOS is id 257 (allowed: data.eos_token empty)"
            )
        return ByteTokenizer()
    if meta["kind"] == "hf":
        saved = meta.get("eos_token")
        eos = eos or ((saved, str(meta_file)) if isinstance(saved, str) and saved else None)
        return HFTokenizer.from_file(json_file, name=meta.get("name"), eos=eos)
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
