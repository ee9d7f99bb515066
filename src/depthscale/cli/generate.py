"""`depthscale generate`: sample text from a trained run with KV-cache decoding, the prompt and
the tokens asked for checked against the model's context first."""

from __future__ import annotations

import argparse
from pathlib import Path

from depthscale.errors import CheckpointError, ConfigError


def run(args: argparse.Namespace) -> int:
    import torch

    from depthscale.interop.run_dir import load_run
    from depthscale.model.generate import generate

    model, tokenizer = load_run(Path(args.run), args.checkpoint)
    if tokenizer is None:
        raise CheckpointError(f"{args.run} has no tokenizer/ directory; generation needs one")
    ids = [
        tokenizer.eos_id,
        *tokenizer.encode(args.prompt),
    ]  # training puts EOS before every document
    limit = model.cfg.max_seq_len
    if args.max_new_tokens >= limit:
        raise ConfigError(
            f"--max-new-tokens {args.max_new_tokens} exceeds the model's context of {limit} "
            f"tokens (model.max_seq_len), which also holds the prompt ({len(ids)} tokens); "
            f"allowed: at most {limit - len(ids)}"
        )
    if len(ids) + args.max_new_tokens > limit:
        raise ConfigError(
            f"the prompt is {len(ids)} tokens and --max-new-tokens is {args.max_new_tokens}: "
            f"together more than the model's max_seq_len={limit}; allowed: a prompt of at most "
            f"{limit - args.max_new_tokens} tokens, or a smaller --max-new-tokens"
        )
    prompt = torch.tensor([ids], dtype=torch.long)
    gen = torch.Generator().manual_seed(args.seed)
    out = generate(
        model,
        prompt,
        args.max_new_tokens,
        args.temperature,
        args.top_k,
        eos_id=tokenizer.eos_id,
        generator=gen,
    )
    print(tokenizer.decode(out[0, 1:].tolist()))
    return 0
