"""Training-step throughput of depthscale against Hugging Face `LlamaForCausalLM`, side by side.

Run:  python benchmarks/train_throughput.py [--dim 128 --layers 4 --heads 4 --seq 128 --batch 8
      --vocab 512 --steps 10 --rounds 5 --warmup 3 --dtype float32 --threads N --device auto]

Both models get the same config and the same weights (depthscale's, copied into HF with
`depthscale.interop.hf_llama`), HF using its sdpa attention, and both run the same step: forward,
fp32 cross-entropy, backward, AdamW step, zero_grad. After `--warmup` untimed steps each, rounds
alternate A then B (`--steps` timed steps per model per round) so drift in machine load hits both
alike; tokens/s is the median over rounds.

Prints one JSON object: device, versions, config, tokens/s of each, `ratio_depthscale_over_hf`
(ratio of the medians), `ratio_median_of_rounds` (median of per-round ratios, more robust when
another process shares the cores), and the loss of each model's first step, which should agree
closely because both compute the same function on the same batch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from depthscale.config import ModelConfig
from depthscale.interop.hf_llama import hf_config_from, state_dict_to_hf
from depthscale.model.transformer import Transformer, cross_entropy


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=0, help="0: same as --heads")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10, help="timed steps per model per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per model (at least 1)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0: torch default")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def build_hf(model: Transformer, device: torch.device) -> nn.Module:
    """HF Llama with sdpa attention computing the same function as `model` (same weights)."""
    import transformers

    config = transformers.LlamaConfig.from_dict(hf_config_from(model.cfg))
    config._attn_implementation = "sdpa"
    hf = transformers.LlamaForCausalLM(config).to(device)
    result = hf.load_state_dict(state_dict_to_hf(model.state_dict(), model.cfg), strict=False)
    allowed_missing = {"lm_head.weight"} if model.cfg.tie_embeddings else set()
    if set(result.missing_keys) - allowed_missing or result.unexpected_keys:
        raise RuntimeError(f"weight copy into HF failed: {result}")
    if model.cfg.tie_embeddings and hf.lm_head.weight is not hf.model.embed_tokens.weight:
        raise RuntimeError("HF lm_head is not tied to its embedding")
    return hf


def train_step(
    forward: Callable[[Tensor], Tensor],
    params: list[nn.Parameter],
    x: Tensor,
    y: Tensor,
    dtype: torch.dtype,
) -> Callable[[], Tensor]:
    """One optimizer step: forward (autocast when bf16), fp32 cross-entropy, backward, AdamW."""
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    amp = (
        torch.autocast(x.device.type, dtype=dtype)
        if dtype != torch.float32
        else contextlib.nullcontext()
    )

    def step() -> Tensor:
        with amp:
            logits = forward(x)
        loss = cross_entropy(logits, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def timed(step: Callable[[], Tensor], steps: int, device: torch.device) -> float:
    """Seconds for `steps` steps, synchronizing the device at both ends."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)

    torch.manual_seed(args.seed)
    cfg = ModelConfig(
        vocab_size=args.vocab,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        max_seq_len=args.seq,
    )
    ds = Transformer(cfg).to(device)
    hf = build_hf(ds, device)
    ds.train()
    hf.train()
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]

    steps = {
        "depthscale": train_step(ds, list(ds.parameters()), x, y, dtype),
        "hf": train_step(
            lambda t: hf(input_ids=t, use_cache=False).logits, list(hf.parameters()), x, y, dtype
        ),
    }
    first_loss = {}
    for name, step in steps.items():
        first_loss[name] = step().item()  # identical weights and batch: losses should agree
        for _ in range(max(0, args.warmup - 1)):
            step()

    tokens_per_round = args.batch * args.seq * args.steps
    rounds: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            rounds[name].append(tokens_per_round / timed(step, args.steps, device))
    tps = {name: statistics.median(values) for name, values in rounds.items()}

    import transformers

    device_name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    )
    report = {
        "device": device_name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "config": {
            "dim": cfg.dim,
            "layers": cfg.n_layers,
            "heads": cfg.n_heads,
            "kv_heads": cfg.kv_heads,
            "ffn_dim": cfg.hidden_dim,
            "vocab": cfg.vocab_size,
            "seq": args.seq,
            "batch": args.batch,
            "tie_embeddings": cfg.tie_embeddings,
            "params": ds.num_params(),
        },
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "tokens_per_s": {name: round(v, 1) for name, v in tps.items()},
        "tokens_per_s_rounds": {name: [round(v, 1) for v in vs] for name, vs in rounds.items()},
        "ratio_depthscale_over_hf": round(tps["depthscale"] / tps["hf"], 4),
        "ratio_median_of_rounds": round(
            statistics.median(a / b for a, b in zip(rounds["depthscale"], rounds["hf"])), 4
        ),
        "first_step_loss": {
            **first_loss,
            "abs_diff": abs(first_loss["depthscale"] - first_loss["hf"]),
        },
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
