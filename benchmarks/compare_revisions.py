"""Run one benchmark against two revisions of depthscale, alternately, and report ratios.

    python benchmarks/compare_revisions.py --base 4a07612 [--runs 3] -- benchmarks/pipeline.py --pp 2

The benchmark script is the working tree's; only the library it imports changes: the base revision
is checked out into a temporary git worktree and put first on PYTHONPATH. Runs alternate base,
head, head, base, … so drift on a shared machine, and going first, hit both alike. Prints one JSON
object: for every numeric leaf of the benchmark's JSON, the median over runs for base and head,
head/base, and the smallest and largest run of each (the noise to read the ratio against).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _leaves(obj, prefix: str = "") -> dict[str, float]:
    if isinstance(obj, bool):
        return {}
    if isinstance(obj, int | float):
        return {prefix: float(obj)}
    out: dict[str, float] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_leaves(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.update(_leaves(v, f"{prefix}[{i}]"))
    return out


def _run(script: list[str], src: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [sys.executable, *script], env=env, capture_output=True, text=True, cwd=ROOT
    )
    if proc.returncode:
        raise SystemExit(f"{' '.join(script)} failed against {src}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout[proc.stdout.index("{") :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="git revision to compare the working tree with")
    ap.add_argument("--runs", type=int, default=3, help="runs per revision (alternating)")
    ap.add_argument("script", nargs=argparse.REMAINDER, help="-- benchmark script and its args")
    args = ap.parse_args()
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        ap.error("give the benchmark after --, e.g. -- benchmarks/pipeline.py --pp 2")
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "base"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(tree), args.base],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        try:
            samples: dict[str, list[dict[str, float]]] = {"base": [], "head": []}
            for i in range(args.runs):  # base, head, head, base, …: drift and order cancel
                for rev in ("base", "head") if i % 2 == 0 else ("head", "base"):
                    src = tree / "src" if rev == "base" else ROOT / "src"
                    samples[rev].append(_leaves(_run(script, src)))
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True
            )
    med = {
        rev: {k: statistics.median(run[k] for run in runs if k in run) for k in runs[0]}
        for rev, runs in samples.items()
    }
    rows = {}
    for key in med["head"]:
        base, head = med["base"].get(key), med["head"][key]
        spread = {
            rev: [
                min(run[key] for run in runs if key in run),
                max(run[key] for run in runs if key in run),
            ]
            for rev, runs in samples.items()
            if all(key in run for run in runs)
        }
        rows[key] = {
            "base": base,
            "head": head,
            "head/base": round(head / base, 3) if base else None,
            "min_max": spread,
        }
    head_rev = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    print(
        json.dumps(
            {
                "benchmark": " ".join(script),
                "base": args.base,
                "head": f"{head_rev} + working tree",
                "runs_per_revision": args.runs,
                "metrics": rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
