"""Reading and writing run directories: `config.toml`, `tokenizer/`, `checkpoints/step_*`.

Generation and conversion start from a run directory, so a converted Hugging Face model is written as
one too (a model-only checkpoint plus its tokenizer) and can be sampled or fine-tuned like any run.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from depthscale.config import Config, load_config, to_toml
from depthscale.data.tokenizer import Tokenizer, load_tokenizer
from depthscale.errors import CheckpointError
from depthscale.model.transformer import Transformer
from depthscale.train.checkpoint import list_checkpoints, load_model, save_model


def run_config(run: Path) -> Config:
    file = run / "config.toml"
    if not file.is_file():
        raise CheckpointError(f"{run} is not a run directory: config.toml is missing")
    return load_config(file, ["--checkpoint.resume", "none"])


def pick_checkpoint(run: Path, checkpoint: str | None) -> Path:
    if checkpoint:
        return Path(checkpoint)
    found = list_checkpoints(run / "checkpoints")
    if not found:
        raise CheckpointError(f"{run} has no complete checkpoint under {run / 'checkpoints'}")
    return found[-1]


def load_run(run: Path, checkpoint: str | None = None) -> tuple[Transformer, Tokenizer | None]:
    """The model (eval mode, weights of the newest or given checkpoint) and tokenizer of a run
    (None for a converted model that came without one)."""
    cfg = run_config(run)
    model = Transformer(cfg.model)
    load_model(pick_checkpoint(run, checkpoint), model)
    model.eval()
    tokenizer = load_tokenizer(run / "tokenizer") if (run / "tokenizer").is_dir() else None
    return model, tokenizer


def hf_to_run(hf_dir: Path, out: Path) -> Path:
    """Import a Hugging Face Llama directory as a depthscale run directory."""
    from depthscale.interop.hf_llama import load_hf_checkpoint

    if list_checkpoints(out / "checkpoints"):
        raise CheckpointError(f"{out} already holds checkpoints; choose an empty output directory")
    model = load_hf_checkpoint(hf_dir)
    cfg = Config(model=model.cfg)
    cfg.train.run_dir = str(out)
    tokenizer_json = hf_dir / "tokenizer.json"
    if tokenizer_json.is_file():
        cfg.data.tokenizer = str(tokenizer_json)
        (out / "tokenizer").mkdir(parents=True, exist_ok=True)
        from depthscale.data.tokenizer import HFTokenizer

        HFTokenizer.from_file(tokenizer_json).save(out / "tokenizer")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.toml").write_text(to_toml(cfg))
    target = out / "checkpoints" / "step_00000000"
    save_model(target, model, {"step": 0, "tokens_seen": 0, "source": str(hf_dir)})
    return out


def run_to_hf(run: Path, out: Path, checkpoint: str | None = None) -> Path:
    """Export a run's model (standard residual only) as a Hugging Face Llama directory."""
    from depthscale.interop.hf_llama import save_hf_checkpoint

    model, _ = load_run(run, checkpoint)
    save_hf_checkpoint(model, out)
    tokenizer_json = run / "tokenizer" / "tokenizer.json"
    if tokenizer_json.is_file():
        shutil.copy(tokenizer_json, out / "tokenizer.json")
    return out
