"""What each recompute mode keeps for backward, and what it costs, side by side in one run.

    python benchmarks/recompute.py [--dim 512 --layers 4 --seq 512 --batch 2 --dtype float32
                                    --rounds 5 --out benchmarks/results/recompute_cpu.json]

For the standard residual and Block AttnRes, and each `train.recompute` mode (none, selective,
sublayer, full), one model (same weights) runs a forward pass and keeps the loss:

- `kept_mb`: bytes the forward left allocated (`train.offload.retained_bytes`: the profiler's memory
  events, so recompute caches and checkpoint inputs count too), minus the logits and loss — what
  backward will need. `kept_vs_none` is its ratio to `none`.
- `step_vs_none`: forward + backward time over `none`'s, median of `--rounds` interleaved rounds
  (a ratio: absolute CPU times mean little; the extra work is the recomputation).
- `exact`: loss and every gradient bitwise equal to `none`'s.

Prints one JSON object; `--out` also writes it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import device_info, interleaved_times  # noqa: E402

from depthscale.config import ModelConfig  # noqa: E402
from depthscale.model.recompute import MODES  # noqa: E402
from depthscale.model.transformer import Transformer, cross_entropy  # noqa: E402
from depthscale.train.offload import retained_bytes  # noqa: E402


def _model(args, residual: str, mode: str) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=args.vocab,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.dim // 64,
        max_seq_len=args.seq,
        residual=residual,
        attnres_n_blocks=max(1, args.layers // 2),
    )
    model = Transformer(cfg)
    model.set_recompute(mode)
    return model


def _autocast(dtype: str):
    return torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bfloat16")


def _measure(args, residual: str) -> dict:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    models = {mode: _model(args, residual, mode) for mode in MODES}
    rows, grads = {}, {}
    for mode, model in models.items():
        kept: list[torch.Tensor] = []

        def forward(model=model, kept=kept) -> None:
            with _autocast(args.dtype):
                logits = model(tokens)
            kept.append(cross_entropy(logits, tokens))
            kept.append(logits)

        held = retained_bytes(forward)
        loss, logits = kept
        out_bytes = logits.untyped_storage().nbytes() + loss.untyped_storage().nbytes()
        del logits
        loss.backward()
        grads[mode] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
        rows[mode] = {"kept_mb": round((held - out_bytes) / 2**20, 2)}

    def step(model) -> None:
        with _autocast(args.dtype):
            loss = cross_entropy(model(tokens), tokens)
        loss.backward()
        model.zero_grad(set_to_none=True)

    times = interleaved_times(
        {m: (lambda model=model: step(model)) for m, model in models.items()}, args.rounds, 1
    )
    base_loss, base_grads = grads["none"]
    for mode, row in rows.items():
        loss, gr = grads[mode]
        row["kept_vs_none"] = round(row["kept_mb"] / rows["none"]["kept_mb"], 3)
        row["step_vs_none"] = round(times[mode] / times["none"], 3)
        row["exact"] = bool(torch.equal(loss, base_loss)) and all(
            torch.equal(gr[n], g) for n, g in base_grads.items()
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    result = {
        "benchmark": "recompute",
        **device_info(),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "kept": "bytes the forward left allocated minus logits and loss (profiler memory events)",
        "modes": {r: _measure(args, r) for r in ("standard", "block")},
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
