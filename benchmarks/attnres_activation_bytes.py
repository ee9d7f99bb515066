"""Activation bytes the two-phase AttnRes reads keep for backward in a bf16 model, before and after
phase-1 outputs moved from fp32 to the compute dtype (issue #15 item 9).

    python benchmarks/attnres_activation_bytes.py [--dim 256 --layers 4 --seq 128 --batch 4
                                                   --block-size 4 --note TEXT]

Prints one JSON object. Bytes are those autograd saves for backward (`saved_activation_bytes`:
distinct storages, parameters excluded), measured in one run for both variants:

- `after`: the library as it is.
- `before`: phase-1 outputs kept in fp32, as the base revision did: the outputs are upcast to
  fp32 before the merges use them (the fused merges take an fp32 phase-1 output, as before), and
  the first sublayer of a block casts its fp32 output to the blocks' dtype, as the base revision's
  `AttnResidual._two_phase_read` did. Same bytes as the base revision, slightly different values
  (the fp32 copy is of an already rounded output).

`model`: a Block AttnRes Transformer under bf16 autocast (the whole depth state is bf16) minus the
same model with the standard residual: the AttnRes bytes, per sublayer and in units of one bf16
[B, T, d] activation. `ops`: one block's reads alone — phase 1 for its S queries over m bf16
sources, then S − 1 merges with a bf16 partial sum — excluding the sources and the partial sum
(alive anyway): per merge, what the merge itself keeps. `kernel_paths`: the read paths that ran.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import device_info  # noqa: E402

from depthscale.config import ModelConfig  # noqa: E402
from depthscale.model import attnres_ops, residual  # noqa: E402
from depthscale.model.attnres_ops import (  # noqa: E402
    inter_block_read_chained,
    merge_partial_chained,
)
from depthscale.model.transformer import Transformer, cross_entropy  # noqa: E402
from depthscale.train.offload import saved_activation_bytes  # noqa: E402

EPS = 1e-6


def _two_phase_read_fp32_outs(self, state):
    """`AttnResidual._two_phase_read` of the base revision, whose phase-1 outputs were fp32."""
    inter = state.inter
    slot = inter.slot(self) if inter is not None else None
    if slot is None:
        members = self.group[next(i for i, m in enumerate(self.group) if m is self) :]
        queries = torch.stack([m.query() for m in members])
        out, lse, state.blocks = inter_block_read_chained(state.blocks, queries, self.eps)
        state.inter = inter = residual.InterBlock(members, [o.float() for o in out], lse)
        slot = 0
    if state.partial is None:
        return inter.out[slot].to(state.blocks[0].dtype)
    h, state.partial = merge_partial_chained(
        inter.out[slot], inter.lse[slot], state.partial, self.query(), self.eps
    )
    return h


def _model_bytes(cfg: ModelConfig, tokens: torch.Tensor, before: bool) -> int:
    torch.manual_seed(0)
    model = Transformer(cfg)
    x, y = tokens[:, :-1], tokens[:, 1:]
    original = residual.AttnResidual._two_phase_read
    if before:
        residual.AttnResidual._two_phase_read = _two_phase_read_fp32_outs
    try:
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16):
            return saved_activation_bytes(
                lambda: cross_entropy(model(x), y), list(model.parameters())
            )
    finally:
        residual.AttnResidual._two_phase_read = original


def _ops_bytes(m: int, S: int, B: int, T: int, d: int, before: bool) -> int:
    gen = torch.Generator().manual_seed(0)
    blocks = [torch.randn(B, T, d, generator=gen).bfloat16().requires_grad_() for _ in range(m)]
    partial = torch.randn(B, T, d, generator=gen).bfloat16().requires_grad_()
    queries = (torch.randn(S, d, generator=gen) * 0.5).requires_grad_()

    def reads():
        out, lse, _ = inter_block_read_chained(blocks, queries, EPS)
        outs, p = [out[0]], partial
        for s in range(1, S):
            o = out[s].float() if before else out[s]
            h, p = merge_partial_chained(o, lse[s], p, queries[s], EPS)
            outs.append(h)
        return outs

    return saved_activation_bytes(reads, [*blocks, partial, queries])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=4, help="sublayers per AttnRes block")
    ap.add_argument("--sources", type=int, default=4, help="ops: completed blocks m")
    ap.add_argument("--note", default="", help="free text stored in the JSON")
    args = ap.parse_args()
    start = time.perf_counter()
    base = dict(
        vocab_size=args.vocab,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        max_seq_len=args.seq,
    )
    block = ModelConfig(**base, residual="block", attnres_block_size=args.block_size)
    standard = ModelConfig(**base)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
    B, T, d, L = args.batch, args.seq, args.dim, block.n_sublayers
    activation = B * T * d * 2  # one bf16 [B, T, d] tensor
    attnres_ops.reset_kernel_paths()
    standard_bytes = _model_bytes(standard, tokens, before=False)
    model, ops = {}, {}
    for variant in ("before", "after"):
        total = _model_bytes(block, tokens, before=variant == "before")
        extra = total - standard_bytes
        model[variant] = {
            "block_attnres_bytes": total,
            "attnres_bytes": extra,
            "attnres_bytes_per_sublayer": extra / L,
            "attnres_activations_per_sublayer": extra / L / activation,
        }
        S = args.block_size
        kept = _ops_bytes(args.sources, S, B, T, d, before=variant == "before")
        ops[variant] = {
            "bytes": kept,
            "bytes_per_merge": kept / (S - 1),
            "activations_per_merge": kept / (S - 1) / activation,
        }
    per_sublayer = {k: model[k]["attnres_bytes_per_sublayer"] for k in model}
    result = {
        "benchmark": "attnres_activation_bytes",
        **device_info(),
        "kernel_paths": attnres_ops.kernel_paths(reasons=True),
        "config": {k: v for k, v in vars(args).items() if k != "note"},
        "bf16_activation_bytes": activation,
        "standard_model_bytes": standard_bytes,
        "model": model,
        "ops": ops,
        "saved_per_sublayer": {
            "bytes": per_sublayer["before"] - per_sublayer["after"],
            "activations": (per_sublayer["before"] - per_sublayer["after"]) / activation,
            "after/before": per_sublayer["after"] / per_sublayer["before"],
        },
        "seconds": time.perf_counter() - start,
    }
    if args.note:
        result["note"] = args.note
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
