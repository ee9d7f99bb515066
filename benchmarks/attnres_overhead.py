"""Cost of Attention Residuals against the standard residual, side by side in one run.

    python benchmarks/attnres_overhead.py [--dim 256 --layers 8 --seq 128 --batch 8 --rounds 10
                                           --repeats 1 --note TEXT]

Prints one JSON object: training-step time (forward, backward, and the trainer's AdamW from
`build_optimizer`) and activation memory of `block` and `full` AttnRes relative to `standard` on the
same data, and the activation memory of the memory-efficient / two-phase read paths relative to
plain autograd (the `reference` read). Activation memory is the bytes autograd saves for backward
(on CUDA also the allocator's peak). Like the trainer, it keeps freed host memory for reuse
(`train.keep_host_memory`), so steps do not page-fault their activations in again.

The variants run interleaved (ratios are robust to drift); with --repeats R the whole timing runs
R times and the JSON keeps every run's ratios (`step_time_ratio_runs`) next to the median run's.
`kernels` says which fused read kernels ran (Triton on CUDA, the C++ CPU kernels, or PyTorch).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import device_info, interleaved_times  # noqa: E402

from depthscale.config import ModelConfig, OptimConfig  # noqa: E402
from depthscale.model.transformer import Transformer, cross_entropy  # noqa: E402
from depthscale.train.host import keep_freed_host_memory  # noqa: E402
from depthscale.train.offload import saved_activation_bytes  # noqa: E402
from depthscale.train.optim import build_optimizer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=8, help="Block AttnRes: number of blocks N")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=1, help="independent timing runs")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--note", default="", help="free text stored in the JSON (e.g. machine load)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    host_memory_kept = keep_freed_host_memory()  # as the trainer does (train.keep_host_memory)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    base = dict(
        vocab_size=args.vocab,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        max_seq_len=args.seq,
        attnres_n_blocks=args.blocks,
    )
    variants = {
        "standard": ModelConfig(**base),
        "block": ModelConfig(**base, residual="block"),
        "full": ModelConfig(**base, residual="full"),
        "block_efficient": ModelConfig(**base, residual="block", attnres_read="efficient"),
        "block_reference": ModelConfig(**base, residual="block", attnres_read="reference"),
        "full_reference": ModelConfig(**base, residual="full", attnres_read="reference"),
    }
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    torch.manual_seed(0)
    reference = Transformer(variants["standard"]).to(device)
    models, optims, steps, memory = {}, {}, {}, {}
    for name, cfg in variants.items():
        model = Transformer(cfg).to(device)
        model.load_state_dict(reference.state_dict(), strict=False)  # identical shared weights
        models[name] = model
        optims[name] = build_optimizer(model, OptimConfig(lr=1e-4))  # the trainer's AdamW

        def step(model=model, opt=optims[name]) -> None:
            cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        steps[name] = step
        memory[name] = saved_activation_bytes(
            lambda model=model: cross_entropy(model(x), y), list(model.parameters())
        )
    timed = {k: steps[k] for k in ("standard", "block", "full")}
    runs = [interleaved_times(timed, args.rounds) for _ in range(max(1, args.repeats))]

    def ratios(times: dict[str, float]) -> dict[str, float]:
        return {
            "block/standard": times["block"] / times["standard"],
            "full/standard": times["full"] / times["standard"],
        }

    times = sorted(runs, key=lambda t: ratios(t)["block/standard"])[len(runs) // 2]
    result = {
        "benchmark": "attnres_overhead",
        **device_info(),
        "kernels": _kernels(device),
        "optimizer": "build_optimizer (AdamW, fused for plain CPU/CUDA parameters)",
        "host_memory_kept": host_memory_kept,
        "config": {
            k: v for k, v in vars(args).items() if k not in ("rounds", "repeats", "threads", "note")
        },
        "step_time_s": times,
        "step_time_ratio": ratios(times),
        "step_time_ratio_runs": [ratios(t) for t in runs],
        "saved_activation_bytes": memory,
        "activation_memory_ratio": {
            "block/standard": memory["block"] / memory["standard"],
            "full/standard": memory["full"] / memory["standard"],
            "block two_phase/reference": memory["block"] / memory["block_reference"],
            "block efficient/reference": memory["block_efficient"] / memory["block_reference"],
            "full two_phase/reference": memory["full"] / memory["full_reference"],
        },
        "goal": "block/standard step time <= 1.05 (paper: negligible overhead without PP)",
    }
    if args.note:
        result["note"] = args.note
    print(json.dumps(result, indent=1))


def _kernels(device: torch.device) -> str:
    """Which implementation the AttnRes reads used (model/attnres_ops.py dispatch)."""
    from depthscale import kernels
    from depthscale.kernels import attnres_cpu

    if device.type == "cuda":
        return "triton" if kernels.load_attnres_triton() is not None else "pytorch"
    if attnres_cpu.load() is None:
        return "pytorch (CPU kernels disabled or not built)"
    return "cpu (C++ kernels, depthscale/kernels/attnres_cpu.cpp)"


if __name__ == "__main__":
    main()
