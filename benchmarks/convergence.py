"""Quality per compute: held-out bits per byte of the residual variants at equal tokens.

    python benchmarks/convergence.py (--steps N | --budget-minutes M) [--layers 24 --dim 128
        --seq 128 --batch 8 --lrs 1.5e-3,3e-3,6e-3 --seeds 0,1 --optims adamw,muon
        --residuals standard,block,full --workers 2 --threads 1 --out RESULT.json --png CURVES.png]

What a user gets from `depthscale train`: every run is the CLI itself (`python -m depthscale train
-c configs/tiny.toml` plus overrides), one subprocess per run, so the data pipeline (the Python
standard library's source, byte tokenizer, the project's cache and seeded packing), the schedule,
the optimizer and the held-out evaluation are the trainer's own. The held-out set is the end of the
token stream (`data.val_fraction` of it, `data/loader.split_stream`); the stdlib's files are read in
sorted path order (`data.sources.stdlib_files`), so it is the source of the last files (zoneinfo,
zipfile, xml, ...), never trained on. Its first `--eval-batches` batches are evaluated, the same
windows for every run and seed, and the trainer reports them as bits per byte (the loss over the
UTF-8 bytes its tokens stand for, `data/eval_sets.bits_per_byte`).

The protocol of issue #54 (the AttnRes paper's): the peak learning rate is swept over `--lrs` on
the standard-residual AdamW baseline at the first seed; the best (lowest final val bpb) is then
shared by every variant (Muon scales its update to AdamW's RMS, so the rate carries over); every
variant runs every seed; all runs see the same tokens (steps x batch x seq) with the same warmup
and decay (`--schedule`, the project's cosine or WSD). FLOPs are the project's counter
(`observe/metrics.flops_per_token`: 6N + attention; the AttnRes depth read, a few percent at
d = 128, is not counted, so the wall time is the fairer cost of block/full).

`--budget-minutes M` picks the step count: `--workers` copies of the most expensive variant run a
few steps side by side to measure seconds per step under the machine's current load, and the steps
are chosen so that all runs (sweep, then the rest, `--workers` at a time) fit in M minutes.
Results of finished runs are kept in `--work-dir` and reused when the same command is run again
(an interrupted run resumes from its checkpoint), so Muon can be added to a finished AdamW run.

Budget used for the committed results (benchmarks/results/convergence_cpu-2core_2026-12-07.json,
.png): the issue asks for 1-2 hours of the whole 2-core machine; that session had one hour of wall
time at `nice -n 19` beside seven other CPU-heavy jobs. `--budget-minutes 62` measured 5.1 s per
step (full AttnRes, two side by side) and chose 102 steps of 8 x 128 tokens (104,448 tokens per
run, 24 layers, d = 128); the AdamW runs took 06:48-07:29 UTC, the Muon runs (its commit landed
meanwhile) were added with `--optims muon --lr 0.0015`, and `--collect` wrote the joint JSON. The
full budget, on an otherwise idle machine:
    python benchmarks/convergence.py --budget-minutes 90 --optims adamw,muon --workers 2 \
        --threads 1 --out RESULT.json --png CURVES.png

Prints one JSON object (and writes it to --out): per run the val curve, final val bpb, tokens,
FLOPs and wall time; per variant (residual, optimizer) the mean final val bpb over seeds with its
spread and its difference from standard; the commit, the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import print_result  # noqa: E402

from depthscale.config import load_config  # noqa: E402
from depthscale.data.loader import build_data  # noqa: E402
from depthscale.errors import ConfigError  # noqa: E402
from depthscale.observe.metrics import flops_per_token  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BASE_CONFIG = ROOT / "configs" / "tiny.toml"
CALIBRATION_STEPS = 12
CALIBRATION_SKIPPED = 4
"""Calibration steps whose intervals are not counted: the first ones build caches and warm up."""


@dataclass(frozen=True)
class Job:
    residual: str
    optim: str
    seed: int
    lr: float

    @property
    def name(self) -> str:
        return f"{self.residual}-{self.optim}-s{self.seed}-lr{self.lr:g}"


@dataclass
class RunResult:
    job: Job
    steps: int
    tokens: int
    flops: float
    wall_s: float
    val: list[tuple[int, float]] = field(default_factory=list)
    """(step, val bpb) in step order."""
    final_train_loss: float = math.nan

    @property
    def final_bpb(self) -> float:
        return self.val[-1][1] if self.val else math.nan


# --------------------------------------------------------------------------------------------
# Pure parts (unit-tested)


def read_metrics(lines: list[str]) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(val bpb curve, train loss curve) from metrics.jsonl lines, one point per step: a run that
    resumed from a checkpoint logs some steps twice, and the later line wins."""
    val: dict[int, float] = {}
    train: dict[int, float] = {}
    for line in lines:
        if not line.strip():
            continue
        row = json.loads(line)
        if row.get("split") == "val" and "bpb" in row:
            val[row["step"]] = row["bpb"]
        elif row.get("split") == "train" and "loss" in row:
            train[row["step"]] = row["loss"]
    return sorted(val.items()), sorted(train.items())


def spread(values: list[float]) -> dict[str, float]:
    """Mean, sample standard deviation (0 for one value), min and max of the seeds' values."""
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def best_lr(sweep: dict[float, float]) -> float:
    """The swept learning rate with the lowest final val bpb (a diverged, NaN run never wins)."""
    finite = {lr: bpb for lr, bpb in sweep.items() if math.isfinite(bpb)}
    if not finite:
        raise RuntimeError(f"every learning rate of the sweep diverged: {sweep}")
    return min(finite, key=finite.get)


def steps_for_budget(
    budget_s: float,
    step_s: float,
    startup_s: float,
    eval_steps: float,
    runs: list[int],
    workers: int,
) -> int:
    """Steps per run so that phases of `runs[i]` runs, `workers` at a time, fit in `budget_s`:
    each round costs startup_s + (steps + eval_steps)·step_s, with step_s measured with `workers`
    runs side by side and eval_steps the run's evaluation in step equivalents."""
    rounds = sum(math.ceil(n / workers) for n in runs)
    return max(0, int((budget_s / rounds - startup_s) / step_s - eval_steps))


def summarise(results: list[RunResult], residuals: list[str]) -> dict:
    """Per (residual, optimizer): the seeds' final val bpb spread, and the mean difference from
    standard with the same optimizer (negative: lower loss than standard)."""
    variants: dict[str, dict] = {}
    for optim in dict.fromkeys(r.job.optim for r in results):
        for residual in residuals:
            finals = [
                r.final_bpb for r in results if r.job.optim == optim and r.job.residual == residual
            ]
            if finals:
                variants[f"{residual}/{optim}"] = {"final_val_bpb": spread(finals)}
        base = variants.get(f"standard/{optim}")
        for residual in residuals:
            entry = variants.get(f"{residual}/{optim}")
            if base and entry and residual != "standard":
                entry["minus_standard_bpb"] = (
                    entry["final_val_bpb"]["mean"] - base["final_val_bpb"]["mean"]
                )
    for residual in residuals:
        adamw, muon = variants.get(f"{residual}/adamw"), variants.get(f"{residual}/muon")
        if adamw and muon:
            muon["minus_adamw_bpb"] = muon["final_val_bpb"]["mean"] - adamw["final_val_bpb"]["mean"]
    return variants


# --------------------------------------------------------------------------------------------
# Runs (the CLI)


def overrides(args, job: Job, steps: int, run_dir: Path, eval_every: int) -> list[str]:
    warmup = max(1, round(args.warmup_fraction * steps))
    values = {
        "model.dim": args.dim, "model.n_layers": args.layers, "model.n_heads": args.heads,
        "model.n_kv_heads": args.kv_heads, "model.residual": job.residual,
        "model.attnres_n_blocks": args.blocks,
        "data.seq_len": args.seq, "data.max_bytes": 0, "data.val_fraction": args.val_fraction,
        "train.steps": steps, "train.batch_size": args.batch, "train.seed": job.seed,
        "train.eval_every": eval_every, "train.eval_batches": args.eval_batches,
        "train.run_dir": str(run_dir), "train.name": job.name,
        "optim.name": job.optim, "optim.lr": job.lr, "optim.warmup_steps": warmup,
        "optim.schedule": args.schedule,
        "checkpoint.every": eval_every, "checkpoint.keep": 1, "logging.log_every": args.log_every,
    }  # fmt: skip
    return [item for key, value in values.items() for item in (f"--{key}", str(value))]


def train(args, job: Job, steps: int, eval_every: int, work: Path) -> RunResult | None:
    """One `depthscale train` run (or the finished one already in `work`; with --collect, None
    for a run that has not finished)."""
    run_dir = work / job.name / f"steps{steps}"
    done = run_dir / "result.json"
    if done.is_file():
        saved = json.loads(done.read_text())
        return RunResult(job=job, **{k: v for k, v in saved.items() if k != "job"})
    if args.collect:
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "depthscale", "train", "-c", str(BASE_CONFIG)]
    cmd += overrides(args, job, steps, run_dir, eval_every)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    start = time.perf_counter()
    with open(run_dir / "train.log", "a") as log:
        code = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - start
    if code != 0:
        raise RuntimeError(f"{job.name}: depthscale train exited {code}; see {run_dir}/train.log")
    val, train_loss = read_metrics((run_dir / "metrics.jsonl").read_text().splitlines())
    cfg = load_config(run_dir / "config.toml")
    tokens = steps * args.batch * args.seq
    result = RunResult(
        job=job, steps=steps, tokens=tokens,
        flops=flops_per_token(cfg.model, cfg.data.seq_len) * tokens, wall_s=wall, val=val,
        final_train_loss=statistics.fmean(v for _, v in train_loss[-3:]) if train_loss else math.nan,
    )  # fmt: skip
    done.write_text(json.dumps(asdict(result)))
    return result


def calibrate(args, work: Path) -> tuple[float, float]:
    """(seconds per step, seconds of start-up) of `--workers` side-by-side runs of the most
    expensive variant (full AttnRes), from the trainer's own per-step log times."""
    job = Job("full" if "full" in args.residuals else args.residuals[-1], "adamw", 0, args.lrs[0])
    run_dir = work / "calibration"
    cmd = [sys.executable, "-m", "depthscale", "train", "-c", str(BASE_CONFIG)]

    def one(i: int) -> tuple[float, float]:
        d = run_dir / f"worker{i}"
        argv = overrides(args, job, CALIBRATION_STEPS, d, CALIBRATION_STEPS)
        argv += ["--logging.log_every", "1", "--train.eval_batches", "1", "--train.name", d.name]
        start = time.perf_counter()
        with open(run_dir / f"worker{i}.log", "w") as log:
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
            subprocess.run(cmd + argv, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
        wall = time.perf_counter() - start
        times = [json.loads(x)["time"] for x in (d / "metrics.jsonl").read_text().splitlines()]
        times = times[:CALIBRATION_STEPS]  # the train lines come first, one per step
        step_s = (times[-1] - times[CALIBRATION_SKIPPED]) / (len(times) - 1 - CALIBRATION_SKIPPED)
        return step_s, wall - CALIBRATION_STEPS * step_s

    run_dir.mkdir(parents=True, exist_ok=True)
    for old in run_dir.glob("worker*/"):
        subprocess.run(["rm", "-rf", str(old)], check=True)
    with ThreadPoolExecutor(args.workers) as pool:
        measured = list(pool.map(one, range(args.workers)))
    return max(m[0] for m in measured), max(m[1] for m in measured)


def check_settings(args) -> None:
    """Every run's settings through the project's own validation, before any work: a bad value
    (or Muon asked for before the optimizer exists) is one line naming the key."""
    for optim in args.optims:
        for residual in args.residuals:
            job = Job(residual, optim, args.seeds[0], args.lrs[0])
            load_config(
                BASE_CONFIG, overrides(args, job, max(args.steps, 10), Path("/nonexistent"), 10)
            )


def warm_cache(args) -> None:
    """Tokenize the corpus into the project's cache once, before runs side by side would each
    do it (the cache's renames make that safe, not free)."""
    job = Job("standard", "adamw", args.seeds[0], args.lrs[0])
    cfg = load_config(BASE_CONFIG, overrides(args, job, 10, Path("/nonexistent"), 10))
    build_data(cfg.data, cfg.train.seed, cfg.train.batch_size)


def machine(commit: str) -> dict:
    """Where the numbers come from: the commit (`--commit` when run from a `git archive` export,
    else the checkout's HEAD, with the files under src/ that differ from it), the host, its load."""
    import depthscale

    modified = None
    if not commit:
        try:
            git = ["git", "-C", str(ROOT)]
            commit = subprocess.run(
                [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
            ).stdout.strip()
            status = subprocess.run(
                [*git, "status", "--porcelain", "--", "src"], capture_output=True, text=True
            ).stdout
            modified = [line[3:] for line in status.splitlines()]
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    return {
        "commit": commit,
        "src_modified_since_commit": modified,
        "depthscale_imported_from": str(Path(depthscale.__file__).parent),
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "niceness": os.nice(0),
        "load_average_at_end": os.getloadavg(),
    }


def plot(results: list[RunResult], sweep: list[RunResult], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    optims = list(dict.fromkeys(r.job.optim for r in results))
    fig, axes = plt.subplots(
        1, len(optims) + 1, figsize=(5.5 * (len(optims) + 1), 4.2), sharey=True
    )
    colors = {"standard": "tab:gray", "block": "tab:blue", "full": "tab:red"}
    for ax, optim in zip(axes, optims):
        for r in (r for r in results if r.job.optim == optim):
            per_step = r.tokens / r.steps
            ax.plot([s * per_step / 1e6 for s, _ in r.val], [b for _, b in r.val],
                    color=colors.get(r.job.residual), alpha=0.8,
                    label=f"{r.job.residual} seed {r.job.seed}",
                    linestyle="-" if r.job.seed == results[0].job.seed else "--")  # fmt: skip
        ax.set_title(f"{optim}, lr {results[0].job.lr:g}")
        ax.set_xlabel("training tokens (M)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    ax = axes[-1]
    for r in sweep:
        per_step = r.tokens / r.steps
        ax.plot(
            [s * per_step / 1e6 for s, _ in r.val], [b for _, b in r.val], label=f"lr {r.job.lr:g}"
        )
    ax.set_title("lr sweep: standard, adamw, seed 0")
    ax.set_xlabel("training tokens (M)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out bits per byte (stdlib tail)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# --------------------------------------------------------------------------------------------


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = ap.add_mutually_exclusive_group(required=True)
    size.add_argument("--steps", type=int, default=0, help="optimizer steps of every run")
    size.add_argument("--budget-minutes", type=float, default=0.0, help="pick steps to fit this")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=8, help="Block AttnRes: number of blocks N")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lrs", type=floats, default=[1.5e-3, 3e-3, 6e-3], help="swept peak lrs")
    ap.add_argument(
        "--lr", type=float, default=0.0, help="no sweep: this lr (e.g. a finished run's sweep's)"
    )
    ap.add_argument("--seeds", type=lambda t: [int(x) for x in t.split(",")], default=[0, 1])
    ap.add_argument("--optims", type=lambda t: t.split(","), default=["adamw"])
    ap.add_argument(
        "--residuals", type=lambda t: t.split(","), default=["standard", "block", "full"]
    )
    ap.add_argument("--schedule", default="cosine", help="the project's cosine | wsd")
    ap.add_argument("--warmup-fraction", type=float, default=0.1)
    ap.add_argument("--evals", type=int, default=6, help="val evaluations per run")
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--val-fraction", type=float, default=0.01)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--workers", type=int, default=2, help="runs side by side")
    ap.add_argument("--threads", type=int, default=1, help="OMP threads of each run")
    ap.add_argument("--work-dir", default="/tmp/depthscale-convergence")
    ap.add_argument("--out", default="")
    ap.add_argument("--png", default="")
    ap.add_argument("--note", default="")
    ap.add_argument(
        "--collect",
        action="store_true",
        help="train nothing: report the finished runs of --work-dir",
    )
    ap.add_argument("--commit", default="", help="the commit of a `git archive` export run here")
    args = ap.parse_args()
    if not args.lr and ("standard" not in args.residuals or "adamw" not in args.optims):
        sys.exit(
            "convergence.py: --residuals must include standard and --optims adamw (the lr sweep's baseline)"
        )
    try:
        check_settings(args)
    except ConfigError as e:
        sys.exit(f"convergence.py: {e}")

    work = Path(args.work_dir)
    started = time.perf_counter()
    warm_cache(args)
    sweep_jobs = [] if args.lr else [Job("standard", "adamw", args.seeds[0], x) for x in args.lrs]
    n_rest = len(args.residuals) * len(args.optims) * len(args.seeds) - len(sweep_jobs[:1])
    calibration = None
    steps = args.steps
    if args.budget_minutes:
        step_s, overhead_s = calibrate(args, work)
        eval_steps = args.evals * args.eval_batches / 3  # a val batch: a forward, ~1/3 of a step
        budget_s = args.budget_minutes * 60 - (time.perf_counter() - started)
        steps = steps_for_budget(
            budget_s, step_s, overhead_s, eval_steps, [len(sweep_jobs), n_rest], args.workers
        )
        calibration = {"step_s": step_s, "startup_s": overhead_s, "budget_s": budget_s}
    eval_every = max(1, steps // args.evals)
    steps = eval_every * args.evals  # the last step is evaluated
    print(f"convergence: {steps} steps per run ({calibration or 'given'})", file=sys.stderr)

    with ThreadPoolExecutor(args.workers) as pool:
        sweep = [
            r for r in pool.map(lambda j: train(args, j, steps, eval_every, work), sweep_jobs) if r
        ]
        lr = args.lr or best_lr({r.job.lr: r.final_bpb for r in sweep})
        print(f"convergence: lr {lr:g}", file=sys.stderr)
        jobs = [
            Job(residual, optim, seed, lr)
            for seed in args.seeds for optim in args.optims for residual in args.residuals
        ]  # fmt: skip
        rest = [j for j in jobs if j not in set(sweep_jobs)]
        done = list(pool.map(lambda j: train(args, j, steps, eval_every, work), rest))
    by_job = {r.job: r for r in [*sweep, *done] if r is not None}
    results = [by_job[j] for j in jobs if j in by_job]
    missing = [j.name for j in [*sweep_jobs, *jobs] if j not in by_job]

    result = {
        "benchmark": "convergence",
        "corpus": "Python standard library source (all of it, sorted by path); held out: the "
        f"last {args.val_fraction:.0%} of the byte stream, first {args.eval_batches} batches",
        "model": {"layers": args.layers, "dim": args.dim, "heads": args.heads,
                  "kv_heads": args.kv_heads, "attnres_n_blocks": args.blocks,
                  "seq_len": args.seq, "batch": args.batch, "tokenizer": "byte"},
        "schedule": {"name": args.schedule, "warmup_fraction": args.warmup_fraction,
                     "min_lr_ratio": "project default"},
        "steps": steps,
        "tokens_per_run": steps * args.batch * args.seq,
        "flops_per_run": {r.job.residual: r.flops for r in results},
        "lr_sweep": {f"{r.job.lr:g}": r.final_bpb for r in sweep},
        "lr": lr,
        "lr_at_sweep_edge": None if args.lr else lr in (min(args.lrs), max(args.lrs)),
        "seeds": args.seeds,
        "variants": summarise(results, args.residuals),
        "missing_runs": missing,
        "runs": [
            {"name": r.job.name, "final_val_bpb": r.final_bpb, "final_train_loss": r.final_train_loss,
             "wall_s": r.wall_s, "val_bpb_curve": r.val}
            for r in [*sweep, *(r for r in results if r not in sweep)]
        ],
        "wall_s_total": time.perf_counter() - started,
        "run_wall_s_sum": sum(r.wall_s for r in by_job.values()),
        "calibration": calibration,
        "workers": args.workers,
        "threads_per_run": args.threads,
        "machine": machine(args.commit),
        "note": args.note,
    }  # fmt: skip
    if args.png:
        plot(results, sweep, Path(args.png), f"{args.layers} layers, d={args.dim}: "
             f"{result['tokens_per_run']:,} tokens per run, {len(args.seeds)} seeds")  # fmt: skip
        result["png"] = Path(args.png).name
    print_result(result, args.out or None)


if __name__ == "__main__":
    main()
