"""`depthscale tokenize`: text corpora tokenized offline into shards (`data/shards.py`), in
parallel, resumable, the same bytes for any number of workers; `data.path = OUT` trains on them."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from depthscale.cli.output_paths import check_output
from depthscale.errors import ConfigError


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from depthscale.config import DataConfig
    from depthscale.data.shards import input_files, refuse_other_tokenizer, tokenize_to_shards
    from depthscale.data.tokenizer import build_tokenizer

    if args.tokenizer == "bpe":
        raise ConfigError(
            "--tokenizer bpe: shards need a fixed tokenizer; allowed: 'byte', a tokenizer.json, "
            "or a run's tokenizer/ directory"
        )
    out = Path(args.out)
    check_output("--out", out, directory=True)
    files = input_files(args.inputs, args.field)  # every input checked before any work
    tokenizer = build_tokenizer(DataConfig(tokenizer=args.tokenizer), lambda: ())
    if out.is_dir():
        refuse_other_tokenizer(out, tokenizer)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the workers are processes
    total = sum(f.stat().st_size for f in files)
    bars: list = []  # shown from the first shard on, once every input is checked
    started, tokens = [0.0], [0, 0]  # when shards began; all tokens, and those tokenized now

    def progress(record: dict, done: int, count: int) -> None:
        if not bars:
            started[0] = time.perf_counter()
            off = not args.progress
            bars.append(tqdm(total=total, unit="B", unit_scale=True, desc="tokenize", disable=off))
        tokens[0] += record["tokens"]
        if not record.get("kept"):
            tokens[1] += record["tokens"]
        rate = tokens[1] / max(time.perf_counter() - started[0], 1e-9)
        bars[0].set_postfix(shards=f"{done}/{count}", tok_s=f"{rate:,.0f}")
        bars[0].update(record["source_bytes"])

    try:
        manifest = tokenize_to_shards(files, tokenizer, out, args.workers, args.field, progress)
    except KeyboardInterrupt:
        for bar in bars:
            bar.close()
        print(
            f"depthscale: note: the finished shards in {out} are kept; the same command "
            "finishes the rest",
            file=sys.stderr,
        )
        raise
    finally:
        for bar in bars:
            bar.close()
    print(
        f"depthscale: {len(manifest['shards'])} shards, {manifest['tokens']:,} tokens, "
        f"{manifest['documents']:,} documents in {out} ({tokens[1]:,} tokens tokenized now); "
        f"train on them with --data.path {out} --data.tokenizer {args.tokenizer}"
    )
    return 0
