"""`depthscale convert`: a Hugging Face Llama directory into a depthscale run, or back."""

from __future__ import annotations

import argparse
from pathlib import Path

from depthscale.cli.output_paths import check_output


def run(args: argparse.Namespace) -> int:
    from depthscale.interop.run_dir import hf_to_run, run_to_hf
    from depthscale.interop.safetensors_shards import parse_size

    check_output("--out", Path(args.out), directory=True)
    shard_bytes = parse_size(args.max_shard_size)
    if args.direction == "hf-to-ds":
        out = hf_to_run(Path(args.hf), Path(args.out))
    else:
        out = run_to_hf(Path(args.run), Path(args.out), args.checkpoint, shard_bytes)
    print(f"wrote {out}")
    return 0
