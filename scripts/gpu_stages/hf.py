"""Stage hf: depthscale against Hugging Face `LlamaForCausalLM` with the same weights
(`depthscale.interop.hf_llama` copies them), on the 4-layer llama-1b slice (standard residual: HF
has no AttnRes).

- logits_fp32: the same tokens through both, fp32 with TF32 off: they compute one function, so
  only the order of fp32 sums differs (bound 1e-4 relative);
- logits_bf16: the same under bf16 autocast (bound 2e-2: bf16 rounding through 4 layers);
- train_step: tokens/s of one training step each (bf16 autocast forward, fp32 cross-entropy,
  backward, AdamW), in alternating rounds, and the first step's losses.

Skipped, not failed, where transformers is not installed: the GPU image may lack it.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from gpu_stages.common import LLAMA_1B, Context, OutOfBounds, rel_err, sig

REAL = {"batch": 2, "seq": 2048, "warmup": 3, "steps": 5, "rounds": 3}
DRY = {"batch": 2, "seq": 32, "warmup": 1, "steps": 1, "rounds": 2}
DRY_MODEL = ["--model.dim", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2",
             "--model.ffn_dim", "128", "--model.n_layers", "2", "--model.vocab_size", "256"]  # fmt: skip
BOUNDS = {"logits_fp32": 1e-4, "logits_bf16": 2e-2}


def run(ctx: Context) -> None:
    try:
        import transformers  # noqa: F401
    except ImportError as err:
        ctx.emit("transformers", status="skipped", error=f"transformers missing ({err})")
        return
    shapes = DRY if ctx.dry_run else REAL
    built: dict[str, Any] = {}

    def models() -> dict[str, Any]:
        values, built["models"] = build(ctx)
        return values

    ctx.measure("models", models)
    if "models" not in built:
        return
    ds, hf = built["models"]
    gen = torch.Generator(ctx.device).manual_seed(0)
    vocab = ds.cfg.vocab_size
    tokens = torch.randint(0, vocab, (shapes["batch"], shapes["seq"] + 1), generator=gen,
                           device=ctx.device)  # fmt: skip
    ctx.measure("logits_fp32", lambda: logits(ctx, ds, hf, tokens[:, :-1], None))
    ctx.measure("logits_bf16", lambda: logits(ctx, ds, hf, tokens[:, :-1], torch.bfloat16))
    ctx.measure("train_step", lambda: train_steps(ctx, shapes, ds, hf, tokens))


def build(ctx: Context) -> tuple[dict[str, Any], tuple]:
    """The two models, the same weights in each; and what they are."""
    import transformers

    from depthscale.config import load_config
    from depthscale.interop.hf_llama import hf_config_from, state_dict_to_hf
    from depthscale.model.transformer import Transformer

    overrides = ["--model.n_layers", "4", "--model.residual", "standard"]
    overrides += ["--model.vocab_size", "32768"] + (DRY_MODEL if ctx.dry_run else [])
    cfg = load_config(LLAMA_1B, overrides).model
    torch.manual_seed(0)
    ds = Transformer(cfg).to(ctx.device)
    config = transformers.LlamaConfig.from_dict(hf_config_from(cfg))
    config._attn_implementation = "sdpa"
    hf = transformers.LlamaForCausalLM(config).to(ctx.device)
    result = hf.load_state_dict(state_dict_to_hf(ds.state_dict(), cfg), strict=False)
    missing = set(result.missing_keys) - ({"lm_head.weight"} if cfg.tie_embeddings else set())
    if missing or result.unexpected_keys:
        raise RuntimeError(f"weight copy into HF failed: {result}")
    shape = {"dim": cfg.dim, "layers": cfg.n_layers, "heads": cfg.n_heads,
             "kv_heads": cfg.kv_heads, "vocab": cfg.vocab_size}  # fmt: skip
    values = {
        "transformers": transformers.__version__,
        "params_m": round(sum(p.numel() for p in ds.parameters()) / 1e6, 1),
        "config": shape,
    }
    return values, (ds, hf)


def logits(ctx: Context, ds, hf, x: torch.Tensor, dtype: torch.dtype | None) -> dict[str, Any]:
    name = "logits_bf16" if dtype else "logits_fp32"
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.no_grad(), torch.autocast(ctx.device.type, torch.bfloat16, enabled=bool(dtype)):
            a = ds(x).float()
            b = hf(input_ids=x, use_cache=False).logits.float()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    values = {
        "rel_err": sig(rel_err(a, b), 3),
        "max_abs_diff": sig((a - b).abs().max().item(), 3),
        "logit_std": sig(b.std().item(), 3),
    }
    if not values["rel_err"] <= BOUNDS[name]:
        raise OutOfBounds(f"logits differ by {values['rel_err']:.2e} > {BOUNDS[name]:.0e}", values)
    return values


def _step(ctx: Context, forward, model, x, y):
    from depthscale.model.transformer import cross_entropy

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)

    def step() -> torch.Tensor:
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16):
            out = forward(x)
        loss = cross_entropy(out.float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def train_steps(ctx: Context, s: dict, ds, hf, tokens: torch.Tensor) -> dict[str, Any]:
    x, y = tokens[:, :-1], tokens[:, 1:]
    steps = {
        "depthscale": _step(ctx, ds, ds, x, y),
        "hf": _step(ctx, lambda t: hf(input_ids=t, use_cache=False).logits, hf, x, y),
    }
    first = {name: step().item() for name, step in steps.items()}  # same weights and batch
    for _ in range(s["warmup"] - 1):
        for step in steps.values():
            step()
    rates: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(s["rounds"]):  # alternating, so drift in clocks or load hits both alike
        for name, step in steps.items():
            ctx.sync()
            t0 = time.perf_counter()
            for _ in range(s["steps"]):
                step()
            ctx.sync()
            rates[name].append(s["steps"] * x.numel() / (time.perf_counter() - t0))
    tps = {name: statistics.median(r) for name, r in rates.items()}
    return {
        "tokens_per_s": {k: sig(v) for k, v in tps.items()},
        "depthscale_over_hf": sig(tps["depthscale"] / tps["hf"], 3),
        "first_step_loss": {k: sig(v, 6) for k, v in first.items()},
        "first_step_loss_abs_diff": sig(abs(first["depthscale"] - first["hf"]), 3),
    }
