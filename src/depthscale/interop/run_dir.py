"""Reading and writing run directories: `config.toml`, `tokenizer/`, `checkpoints/step_*`.

Generation and conversion start from a run directory, so a converted Hugging Face model is written as
one too (a model-only checkpoint plus its tokenizer) and can be sampled or fine-tuned like any run.
"""

from __future__ import annotations

import contextlib
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from depthscale.config import Config, ModelConfig, load_config, to_toml
from depthscale.data.tokenizer import HFTokenizer, Tokenizer, load_tokenizer
from depthscale.errors import CheckpointError, ConfigError
from depthscale.interop.safetensors_shards import DEFAULT_SHARD_BYTES
from depthscale.model.transformer import Transformer
from depthscale.train.checkpoint import load_model, save_model
from depthscale.train.manifest import newest_verified, verified


def run_config(run: Path) -> Config:
    file = run / "config.toml"
    if not file.is_file():
        raise CheckpointError(f"{run} is not a run directory: config.toml is missing")
    return load_config(file, ["--checkpoint.resume", "none"])


def pick_checkpoint(run: Path, checkpoint: str | None, model: ModelConfig | None = None) -> Path:
    """The given checkpoint, which must verify, or else the newest of the run's that verifies
    (newer ones that fail are named in warnings); `model` is checked against each manifest."""
    if checkpoint:
        return verified(Path(checkpoint), model)
    found = newest_verified(run / "checkpoints", model)
    if found is None:
        raise CheckpointError(f"{run} has no checkpoint under {run / 'checkpoints'}")
    return found


def load_run(run: Path, checkpoint: str | None = None) -> tuple[Transformer, Tokenizer | None]:
    """The model (eval mode, weights of the newest or given checkpoint) and tokenizer of a run
    (None for a converted model that came without one)."""
    cfg = run_config(run)
    model = Transformer(cfg.model)
    load_model(pick_checkpoint(run, checkpoint, cfg.model), model)
    model.eval()
    tokenizer = load_tokenizer(run / "tokenizer") if (run / "tokenizer").is_dir() else None
    return model, tokenizer


@contextlib.contextmanager
def _staged_output(out: Path) -> Iterator[Path]:
    """A temporary sibling of `out` to write a conversion into, renamed onto `out` when the block
    succeeds and removed when it fails. `out` must be new or empty, checked before any work: a
    conversion never overwrites an earlier one, mixes its files with one, or leaves half of itself
    behind."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(
            f"output {out} already exists and is not an empty directory; allowed: a new or "
            "empty directory (conversion never overwrites)"
        )
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex[:12]}.tmp")
    tmp.mkdir()
    try:
        yield tmp
        try:
            tmp.replace(out)  # an empty `out` is replaced; rename is atomic on one file system
        except OSError as err:  # `out` was filled meanwhile
            raise CheckpointError(f"cannot move the conversion into {out}: {err}") from err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _hf_tokenizer(hf_dir: Path, vocab_size: int) -> HFTokenizer | None:
    """The tokenizer.json beside an HF model, if there is one. Refused when it has ids the
    model's embedding lacks: training and generation would index past it."""
    file = hf_dir / "tokenizer.json"
    if not file.is_file():
        return None
    tokenizer = HFTokenizer.from_file(file)
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"{file} has token ids up to {tokenizer.vocab_size - 1}, but the model's vocab_size "
            f"is {vocab_size}; allowed: a tokenizer whose ids are all < vocab_size (the one the "
            "model was trained with)"
        )
    return tokenizer


def hf_to_run(hf_dir: Path, out: Path) -> Path:
    """Import a Hugging Face Llama directory as a depthscale run directory `out` (new or empty):
    a config.toml that trains as it is (data.seq_len fits the model's context; paths absolute),
    the model's tokenizer/ if it came with one, and a model-only checkpoints/step_00000000."""
    from depthscale.interop.hf_llama import load_hf_checkpoint

    with _staged_output(out) as tmp:
        model = load_hf_checkpoint(hf_dir)
        tokenizer = _hf_tokenizer(hf_dir, model.cfg.vocab_size)
        cfg = Config(model=model.cfg)
        cfg.train.run_dir = str(out.resolve())
        cfg.data.seq_len = min(cfg.data.seq_len, cfg.model.max_seq_len)
        if tokenizer is not None:
            cfg.data.tokenizer = str(out.resolve() / "tokenizer")
            tokenizer.save(tmp / "tokenizer")
        (tmp / "config.toml").write_text(to_toml(cfg.validate()))
        target = tmp / "checkpoints" / "step_00000000"
        save_model(target, model, {"step": 0, "tokens_seen": 0, "source": str(hf_dir)})
    return out


def run_to_hf(
    run: Path, out: Path, checkpoint: str | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES
) -> Path:
    """Export a run's model as a Hugging Face directory `out` (new or empty): plain Llama when it
    is one, else remote code (`interop/hf_depthscale.py`); weights sharded past
    `max_shard_bytes` (default 5 GB, as transformers); the run's tokenizer in the files
    `AutoTokenizer` reads and its BOS/EOS ids in config.json and generation_config.json
    (`interop/hf_tokenizer.py`)."""
    from depthscale.interop.hf_llama import save_hf_checkpoint
    from depthscale.interop.hf_tokenizer import save_hf_tokenizer

    with _staged_output(out) as tmp:
        model, tokenizer = load_run(run, checkpoint)
        token_ids = None
        if tokenizer is not None:
            token_ids = save_hf_tokenizer(tokenizer, tmp, model.cfg.max_seq_len)
        save_hf_checkpoint(model, tmp, token_ids, max_shard_bytes)
    return out
