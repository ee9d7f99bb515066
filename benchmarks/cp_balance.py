"""Attention work per cp rank on real packed rows: zigzag vs balanced over the documents (#55).

    python benchmarks/cp_balance.py [--seq 8192 16384 32768 --cp 4 8 --window 0 1024 --rows 64]

Documents: the Python standard library's .py files (`data.path = "stdlib"`, the default corpus),
tokenized with the default tokenizer (`data.tokenizer = "byte"`), each followed by EOS, in a
shuffled order (`--seed`), packed back to back and cut into rows of `--seq` tokens (`--rows`
of them, spread evenly over the corpus) — a row as `data.document_mask` sees it
(`Documents.of`). Every row is one micro-batch (the layout is per micro-batch; long-context runs
take one row each).

Per (seq, cp, window; 0 = causal) it prints the per-rank attention work — the (query, key) pairs
each rank attends to under causal ∧ window ∧ same document, `cp_balance.query_work` — as
max / mean over the cp ranks: `zigzag` (`parallel.cp_balance = "zigzag"`) and `balanced`
(`"documents"`, chunks of at least `--min-chunk` tokens), each as the mean and the worst over the
rows, and `step` = Σ max / Σ mean over the rows (what a run of such steps loses to imbalance: the
ring waits for its most loaded rank at every step). `host_ms_per_row`: planning the balanced
layout of one row on the host. No process group: the work is counted, not timed.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import device_info, print_result  # noqa: E402

from depthscale.config import Config  # noqa: E402
from depthscale.data.sources import iter_documents  # noqa: E402
from depthscale.data.tokenizer import build_tokenizer  # noqa: E402
from depthscale.model.documents import Documents  # noqa: E402
from depthscale.parallel.cp_balance import chunk_count, layout_for  # noqa: E402


def token_stream(seed: int) -> tuple[torch.Tensor, int, dict]:
    """The corpus's documents as one stream of token ids (EOS after each), shuffled by document,
    with the tokenizer's EOS and the document lengths' summary."""
    data = Config().data
    docs = list(iter_documents(data))
    tokenizer = build_tokenizer(data, lambda: iter(docs))
    encoded = [tokenizer.encode(d) + [tokenizer.eos_id] for d in docs]
    random.Random(seed).shuffle(encoded)
    lengths = sorted(len(e) for e in encoded)
    summary = {
        "corpus": data.path,
        "tokenizer": data.tokenizer,
        "documents": len(lengths),
        "tokens": sum(lengths),
        "length_median": statistics.median(lengths),
        "length_p10": lengths[len(lengths) // 10],
        "length_p90": lengths[len(lengths) * 9 // 10],
        "length_max": lengths[-1],
    }
    stream = torch.tensor([t for e in encoded for t in e], dtype=torch.long)
    return stream, tokenizer.eos_id, summary


def measure(rows: torch.Tensor, eos: int, cp: int, window: int, min_chunk: int) -> dict:
    zigzag, balanced, top, mean, seconds = [], [], [0.0, 0.0], [0.0, 0.0], 0.0
    for row in rows.split(1):
        starts = Documents.of(row, eos).host_starts
        z = layout_for(starts, row.shape[1], cp, window, min_chunk, "zigzag")
        t0 = time.perf_counter()
        b = layout_for(starts, row.shape[1], cp, window, min_chunk, "documents")
        seconds += time.perf_counter() - t0
        for i, lay in enumerate((z, b)):
            top[i] += max(lay.work)
            mean[i] += sum(lay.work) / cp
        zigzag.append(z.imbalance)
        balanced.append(b.imbalance)

    def summary(values: list[float], i: int) -> dict:
        return {
            "mean": round(statistics.fmean(values), 4),
            "worst": round(max(values), 4),
            "step": round(top[i] / mean[i], 4),
        }

    return {
        "zigzag": summary(zigzag, 0),
        "balanced": summary(balanced, 1),
        "balanced_chunk_tokens": rows.shape[1] // chunk_count(rows.shape[1], cp, min_chunk),
        "host_ms_per_row": round(seconds / rows.shape[0] * 1e3, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--cp", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--window", type=int, nargs="+", default=[0, 1024], help="0: causal")
    ap.add_argument("--rows", type=int, default=64, help="rows per sequence length")
    ap.add_argument("--min-chunk", type=int, default=64, help="parallel.cp_balance_chunk")
    ap.add_argument("--seed", type=int, default=0, help="document order")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    for seq in args.seq:
        for cp in args.cp:
            if seq % (2 * cp):
                ap.error(f"--seq {seq} must be a multiple of 2·cp = {2 * cp}")
    torch.set_num_threads(1)
    stream, eos, corpus = token_stream(args.seed)
    result = {
        "benchmark": "cp_balance",
        **device_info(),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "corpus": corpus,
        "note": (
            "max / mean attention work over the cp ranks, per row (mean, worst over the rows) and "
            "over all rows as steps (sum of max / sum of mean); counted (query, key) pairs, not "
            "timed"
        ),
        "results": [],
    }
    for seq in args.seq:
        every = stream[: stream.numel() // seq * seq].view(-1, seq)
        usable = min(args.rows, every.shape[0])
        rows = every[torch.linspace(0, every.shape[0] - 1, usable).long()]  # spread over the corpus
        for cp in args.cp:
            for window in args.window:
                entry = {"seq": seq, "cp": cp, "window": window, "rows": usable}
                entry |= measure(rows, eos, cp, window, args.min_chunk)
                result["results"].append(entry)
                print(
                    f"seq {seq} cp {cp} window {window}: zigzag {entry['zigzag']} "
                    f"balanced {entry['balanced']}",
                    file=sys.stderr,
                )
    worst = max(e["balanced"]["worst"] for e in result["results"])
    result["balanced_worst_row"] = worst
    result["zigzag_worst_row"] = max(e["zigzag"]["worst"] for e in result["results"])
    print_result(result, args.out)


if __name__ == "__main__":
    main()
