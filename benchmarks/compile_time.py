"""Graphs and compile seconds of `train.compile` against depth, standard residual and Block AttnRes
side by side.

    python benchmarks/compile_time.py [--depths 4,16,64 --backend inductor --dim 64 --seq 32
                                       --batch 2 --whole-layer --out benchmarks/results/...]

Each model's blocks are compiled as the trainer compiles them (`setup.compile_blocks`: each block's
`compile`, static shapes, the recompile limit raised to two entries a block), then trained for
three steps (forward + backward):

- `graphs`: graphs dynamo produced (its `unique_graphs` counter: recompiles included), each one
  Inductor compile of a forward and one of a backward graph — what a cold GPU start pays for;
- `first_step_s`: the first step's seconds, compile included; `compile_s`: that minus a compiled
  step's (the later two's median); each row in a fresh process with empty Inductor and Triton
  caches, so each compiles cold, as a first start does;
- `graphs_per_layer`: graphs over layers — constant graphs mean it falls as 1/depth.

`--whole-layer` adds `block (whole layers)` rows: Block AttnRes blocks compiled whole
(`nn.Module.compile`, the policy before AttnRes blocks compiled their sublayer parts), one graph a
layer; with Inductor on CPU that costs minutes at 64 layers (`--backend aot_eager` counts graphs
without Inductor's code generation).

Prints one JSON object; `--out` also writes it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import device_info, print_result, sync  # noqa: E402

from depthscale.config import ModelConfig  # noqa: E402
from depthscale.model.transformer import Transformer, cross_entropy  # noqa: E402

N_BLOCKS = 8
"""Block AttnRes blocks (the paper's N ≈ 8, the config default), fewer for shallow models."""


def _model(args, residual: str, n_layers: int) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=args.vocab,
        dim=args.dim,
        n_layers=n_layers,
        n_heads=max(1, args.dim // 64),
        max_seq_len=args.seq,
        residual="standard" if residual == "standard" else "block",
        attnres_n_blocks=min(N_BLOCKS, 2 * n_layers),
    )
    return Transformer(cfg)


def _step(model: Transformer, tokens: torch.Tensor) -> float:
    sync()
    t0 = time.perf_counter()
    model.zero_grad(set_to_none=True)
    cross_entropy(model(tokens), tokens).backward()
    sync()
    return time.perf_counter() - t0


def _measure(args, residual: str, n_layers: int) -> dict:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    device = torch.device(args.device)
    model = _model(args, residual, n_layers).to(device)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
    _step(model, tokens)  # eager first: loads the read kernels, so compiling is what step 1 adds
    layers = list(model.layers.values())
    torch._dynamo.config.recompile_limit = max(
        torch._dynamo.config.recompile_limit, 2 * len(layers)
    )
    before = counters["stats"]["unique_graphs"]
    for layer in layers:
        if residual == "block (whole layers)":
            torch.nn.Module.compile(layer, backend=args.backend, dynamic=False)
        else:
            layer.compile(backend=args.backend, dynamic=False)  # as setup.compile_blocks does
    first = _step(model, tokens)
    steady = statistics.median(_step(model, tokens) for _ in range(2))
    graphs = counters["stats"]["unique_graphs"] - before
    return {
        "residual": residual,
        "layers": n_layers,
        "compiled": layers[0].compiled_parts,
        "graphs": graphs,
        "graphs_per_layer": round(graphs / n_layers, 3),
        "first_step_s": round(first, 2),
        "step_s": round(steady, 3),
        "compile_s": round(first - steady, 2),
    }


def _cold(args, residual: str, n_layers: int) -> dict:
    """One measurement in a fresh process with empty Inductor and Triton caches: what a first
    start compiles (in one process, later depths would reuse the kernels the first compiled)."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": cache}
        argv = [sys.executable, __file__, "--row", f"{residual}:{n_layers}"]
        for key in ("backend", "dim", "seq", "batch", "vocab", "device"):
            argv += [f"--{key}", str(getattr(args, key))]
        out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--depths", default="4,16,64")
    p.add_argument("--backend", default="inductor", help="inductor | aot_eager | eager")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--whole-layer", action="store_true", help="add Block AttnRes compiled whole")
    p.add_argument("--row", help=argparse.SUPPRESS)  # RESIDUAL:LAYERS, one cold measurement
    p.add_argument("--out")
    args = p.parse_args()
    if args.row:
        residual, n_layers = args.row.rsplit(":", 1)
        print(json.dumps(_measure(args, residual, int(n_layers))))
        return
    residuals = ["standard", "block"] + (["block (whole layers)"] if args.whole_layer else [])
    rows = [
        _cold(args, residual, int(depth))
        for depth in args.depths.split(",")
        for residual in residuals
    ]
    config = {k: getattr(args, k) for k in ("backend", "dim", "seq", "batch", "vocab")}
    config["attnres_n_blocks"] = f"min({N_BLOCKS}, 2 * layers)"
    date = datetime.date.today().isoformat()
    print_result({**device_info(), "date": date, "config": config, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
