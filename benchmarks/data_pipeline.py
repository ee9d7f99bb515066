"""The data pipeline's costs: offline tokenization throughput per worker, and what a three-source
mixture costs training against one source, side by side in one run.

    python benchmarks/data_pipeline.py [--mb 24 --files 12 --steps 30 --rounds 3
                                        --out benchmarks/results/data_pipeline_cpu.json]

1. `depthscale tokenize` (`data/shards.py`) on a generated corpus of `--files` .jsonl files
   (`--mb` MB of seeded words), with the byte tokenizer and a BPE tokenizer.json (trained here on
   a sample), at 1 and 2 workers: tokens/s, tokens/s per worker, and whether the shards of every
   worker count are byte-identical (they must be).
2. Batches drawn from the loader alone: one stream (`PackedBatches`) against a mixture of three
   (`MixedBatches`, dealt window by window): batches/s of each.
3. Training tokens/s of a tiny model (the CLI, `--steps` steps, median of the logged tokens/s
   after the first logged step) on one source, on the same text split into three weighted
   sources, and on that mixture with document masking (`data.document_mask`: attention within
   each packed document), the three alternating for `--rounds` rounds: each one's ratio to one
   source. Documents are ~1.5 kB of text, rows 64 tokens, so the masked rows mostly hold one
   document and sometimes two.

Prints one JSON object; `--out` also writes it. On a 2-core box the absolute numbers are
only indicative; the ratios are the point.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import device_info, print_result  # noqa: E402

from depthscale.config import DataConfig  # noqa: E402
from depthscale.data.loader import PackedBatches, tokenize_corpus  # noqa: E402
from depthscale.data.mixture import MixedBatches, Stage  # noqa: E402
from depthscale.data.shards import input_files, tokenize_to_shards  # noqa: E402
from depthscale.data.tokenizer import ByteTokenizer, HFTokenizer, train_bpe  # noqa: E402

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "a",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "her",
    "she",
    "there",
    "had",
    "one",
    "all",
    "we",
    "can",
    "their",
    "has",
    "been",
    "if",
    "more",
]


def _corpus(root: Path, mb: float, files: int) -> Path:
    rng = np.random.default_rng(0)
    folder = root / "corpus"
    folder.mkdir()
    per_file = int(mb * 1e6 / files)
    for i in range(files):
        with open(folder / f"part{i:03d}.jsonl", "w") as f:
            written = 0
            while written < per_file:
                line = json.dumps({"text": " ".join(rng.choice(WORDS, 300))}) + "\n"
                f.write(line)
                written += len(line)
    return folder


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.iterdir()):
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()[:16]


def _tokenize(files, tokenizer, root: Path, name: str) -> dict:
    out = {}
    digests = set()
    for workers in (1, 2):
        target = root / f"{name}-w{workers}"
        start = time.perf_counter()
        manifest = tokenize_to_shards(files, tokenizer, target, workers=workers)
        seconds = time.perf_counter() - start
        digests.add(_digest(target))
        out[f"workers_{workers}"] = {
            "tokens": manifest["tokens"],
            "seconds": round(seconds, 3),
            "tokens_per_s": round(manifest["tokens"] / seconds),
            "tokens_per_s_per_worker": round(manifest["tokens"] / seconds / workers),
        }
    out["identical_for_1_and_2_workers"] = len(digests) == 1
    return out


def _loader(tokens: np.ndarray, seq: int, batch: int, n: int) -> dict:
    third = len(tokens) // 3
    parts = {"a": tokens[:third], "b": tokens[third : 2 * third], "c": tokens[2 * third :]}
    one = PackedBatches(tokens, seq, batch, 0)
    mixed = MixedBatches(parts, seq, batch, 0, [Stage(0, {"a": 0.5, "b": 0.3, "c": 0.2})])
    out = {}
    for name, loader in (("one_source", one), ("mixture_of_3", mixed)):
        start = time.perf_counter()
        for _ in range(n):
            loader.next_batch()
        out[f"{name}_batches_per_s"] = round(n / (time.perf_counter() - start), 1)
    out["mixture_over_one"] = round(
        out["mixture_of_3_batches_per_s"] / out["one_source_batches_per_s"], 3
    )
    return out


def _train(root: Path, config: Path, steps: int, tag: str, *extra: str) -> float:
    run = root / f"run-{tag}-{time.perf_counter_ns()}"
    args = [
        sys.executable, "-m", "depthscale.cli", "train", "-c", str(config),
        "--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "2",
        "--data.seq_len", "64", "--train.batch_size", "8", "--train.steps", str(steps),
        "--optim.warmup_steps", "2", "--logging.log_every", "1", "--logging.progress", "false",
        "--train.eval_every", "0", "--checkpoint.every", "0", "--data.cache_dir",
        str(root / "cache"), "--train.run_dir", str(run), *extra,
    ]  # fmt: skip
    subprocess.run(args, check=True, capture_output=True, cwd=root)
    records = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in records if r["split"] == "train"][1:]
    return statistics.median(rates)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=24.0)
    p.add_argument("--files", type=int, default=12)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus = _corpus(root, args.mb, args.files)
        files = input_files([str(corpus)], "text")
        bpe_path = root / "bpe.json"
        train_bpe([" ".join(WORDS)] * 200, 1024).tok.save(str(bpe_path))
        result = {
            "device": device_info(),
            "corpus": {"mb": args.mb, "files": args.files},
            "tokenize": {
                "byte": _tokenize(files, ByteTokenizer(), root, "byte"),
                "bpe1024": _tokenize(files, HFTokenizer.from_file(bpe_path), root, "bpe"),
            },
        }
        tokens = tokenize_corpus(
            DataConfig(path=str(corpus), cache_dir=str(root / "cache")), ByteTokenizer()
        )
        result["loader"] = _loader(np.asarray(tokens), 128, 16, 300)
        one = root / "one.toml"
        one.write_text(f'[data]\npath = "{corpus}"\n')
        mixture = root / "mix.toml"
        parts = [root / "p0", root / "p1", root / "p2"]
        for k, part in enumerate(parts):
            part.mkdir()
            for f in files[k::3]:
                (part / f.name).symlink_to(f)
        mixture.write_text(
            "[data]\n"
            + "".join(
                f'[[data.sources]]\nname = "s{k}"\npath = "{part}"\nweight = {w}\n'
                for k, (part, w) in enumerate(zip(parts, (0.5, 0.3, 0.2)))
            )
        )
        runs = {
            "one_source": (one,),
            "mixture_of_3": (mixture,),
            "mixture_of_3_document_mask": (mixture, "--data.document_mask", "true"),
        }
        rates: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(args.rounds):
            for name, (config, *extra) in runs.items():
                rates[name].append(_train(root, config, args.steps, name, *extra))
        medians = {k: statistics.median(v) for k, v in rates.items()}
        one_rate = medians["one_source"]
        result["training_tokens_per_s"] = {
            **{k: round(v) for k, v in medians.items()},
            "mixture_over_one": round(medians["mixture_of_3"] / one_rate, 3),
            "masked_mixture_over_one": round(medians["mixture_of_3_document_mask"] / one_rate, 3),
            "rounds": args.rounds,
        }
    print_result(result, args.out)


if __name__ == "__main__":
    main()
