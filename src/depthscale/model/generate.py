"""Autoregressive sampling with a KV cache.

The depth state is per token, so Attention Residuals need nothing special here: each new token builds
its own depth sources through the layers, and only attention looks back (through the cache).
"""

from __future__ import annotations

import torch
from torch import Tensor

from depthscale.model.transformer import Transformer


@torch.no_grad()
def generate(
    model: Transformer,
    prompt: Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Extend prompt [B, T] by up to max_new_tokens tokens; temperature 0 is greedy decoding."""
    B, T = prompt.shape
    total = T + max_new_tokens
    if total > model.cfg.max_seq_len:
        raise ValueError(
            f"prompt ({T}) + max_new_tokens ({max_new_tokens}) exceeds "
            f"model.max_seq_len={model.cfg.max_seq_len}"
        )
    caches = model.make_caches(B, total)
    logits = model(prompt, caches=caches, start=0)[:, -1]
    out = [prompt]
    finished = torch.zeros(B, dtype=torch.bool, device=prompt.device)
    for pos in range(T, total):
        token = _sample(logits, temperature, top_k, generator)
        if eos_id is not None:
            token = torch.where(finished, torch.full_like(token, eos_id), token)
            finished |= token == eos_id
        out.append(token[:, None])
        if eos_id is not None and bool(finished.all()):
            break
        logits = model(token[:, None], caches=caches, start=pos)[:, -1]
    return torch.cat(out, dim=1)


def _sample(
    logits: Tensor, temperature: float, top_k: int, generator: torch.Generator | None
) -> Tensor:
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
